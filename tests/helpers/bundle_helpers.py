"""Shared builders for the export/bundle/registry tests: a trained-looking policy, no training run."""

from __future__ import annotations

import torch

from pipeline.training.model import ActorCritic, DeterministicPolicy
from tests.helpers.shield_specs import planar_double_integrator

OBS_MEAN = [0.3, -1.0, 0.05, 4.0]
OBS_STD = [0.5, 2.0, 0.1, 3.0]


def trained_like_policy(seed: int = 0, weight_scale: float = 500.0) -> tuple[DeterministicPolicy, dict]:
    """A 4-obs, 2-action policy with random weights scaled up and a non-trivial normalizer.

    A scaled-up head makes the mean saturate the action bounds on part of the
    data, so clipping inside the graph is exercised by the parity check.
    """
    torch.manual_seed(seed)
    ac = ActorCritic(4, 2, (64, 64), action_low=[-1.0, -0.5], action_high=[1.0, 0.5])
    data = torch.randn(5000, 4, dtype=torch.float64) * torch.tensor(OBS_STD, dtype=torch.float64)
    ac.obs_rms.update(data + torch.tensor(OBS_MEAN, dtype=torch.float64))
    with torch.no_grad():
        ac.pi[-1].weight.mul_(weight_scale)  # the freshly initialised head is tiny (gain 0.01)
    meta = dict(task="planar", env_id="sim2real/Planar-test", updates=7, env_steps=1234, **ac.spec())
    return DeterministicPolicy(ac), meta


def shield_spec() -> dict:
    """A valid shield.json for the 4-obs, 2-action test policy."""
    return planar_double_integrator()


def export_test_bundle(tmp_path_factory, name: str):
    """One real exported (parity-checked) bundle of `trained_like_policy()`; returns (bundle dir, policy)."""
    from pipeline.deployment.export import export_deterministic

    policy, meta = trained_like_policy()
    out = tmp_path_factory.mktemp(name) / "bundle"
    export_deterministic(
        policy, meta, shield_spec(), config_hash="c0ffee", out_dir=out, registry_root=tmp_path_factory.mktemp("unused")
    )
    return out, policy


def resealed_copy(src, dst, edit_contract):
    """A copy of bundle `src` at `dst` whose manifest's contract `edit_contract(contract)` changed in place,
    resealed (its own hash made right again): a bundle as a careless or hostile editor would ship it."""
    import json
    import shutil

    from shield.bundle import MANIFEST_FILE, seal_manifest

    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST_FILE).read_text())
    edit_contract(manifest["contract"])
    (dst / MANIFEST_FILE).write_text(json.dumps(seal_manifest(manifest)))
    return dst
