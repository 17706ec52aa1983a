"""Export (`sim2real export`): a training run's deterministic policy -> a parity-checked ONNX bundle.

The exported graph is the whole deployable policy: raw observation in,
normalization (clipped to +-10 sigma), the mean head, clipping to the env's
action bounds, action out. Nothing is written until the graph passes
`onnx.checker` (full check) and onnxruntime matches torch to `PARITY_TOL` on
>= 10,000 observations at batch 1 and 64: samples from the training
observation distribution (the normalizer's mean and std), +-10 sigma extremes
and zeros. Without `--out` the bundle is registered as the task's next version
(not promoted).

A history policy (`train.history_length` H > 0) carries its state explicitly:
a second input `history` float32[batch, H, obs_dim + act_dim]
(shield.policy.HistoryBuffer's layout) and a second output `next_history`, the
same one step on; the manifest's contract states its shape, initial value and
reset rules. The parity check then draws observation and history together from
the training input distribution, and also runs a few plants closed-loop for
`STATE_PARITY_STEPS` steps through the edge's own per-plant calls, with episode
resets and a shield's overrides, against torch stepping its own state. The manifest records which checkpoint was
exported and why (`selection`: best validation return) and, with ADR, the
train ranges reached.

An adaptive student with an estimate head (pipeline/training/model.py) outputs
`plant_estimate` float32[batch, P] too: the domain parameters it believes the
plant has, in physical units. The contract names each one with its unit and
train range, and the parity checks cover it as they cover the action.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import onnx
import torch

from pipeline.deployment.contract import io_contract
from pipeline.deployment.registry import Registry
from shield.bundle import (
    POLICY_FILE,
    SCHEMA_VERSION,
    SHIELD_FILE,
    BundleError,
    make_manifest,
    shield_json_bytes,
    write_bundle,
)
from shield.policy import ESTIMATE_OUTPUT, OnnxPolicy
from shield.spec import ShieldSpec, ShieldSpecError

BUNDLE_VERSION = SCHEMA_VERSION  # also written into the ONNX metadata
OPSET = 17
PARITY_TOL = 1e-5
# Plant estimates are for an operator to read, in physical units; the float32 noise of the actions a closed loop
# writes back into the history reaches them at about 1e-5 (relative) on a 64x64 head.
ESTIMATE_PARITY_TOL = 1e-4
PARITY_SAMPLES = 10_000
PARITY_BATCHES = (1, 64)
EXTREME_SIGMA = 10.0
INPUT_NAME, HISTORY_NAME, OUTPUT_NAME, NEXT_HISTORY_NAME = "obs", "history", "action", "next_history"
STATE_PARITY_STEPS = 256
STATE_PARITY_PLANTS = 3
STATE_EPISODE_STEPS = 70  # plant p starts a new episode every this many steps (offset by p): resets inside the run


class ExportError(RuntimeError):
    """The policy cannot be exported, or the exported graph failed a check; nothing was written."""


class ExportResult(TypedDict):
    """What an export returns: where the bundle went, its registry version, and the parity it passed."""

    task: str
    parity_max_abs_err: float  # max |onnxruntime - torch| over the parity observations and batch sizes
    parity_by_batch: dict[int, float]
    parity_observations: int
    state_parity_max_abs_err: float | None  # closed-loop, with resets (a policy with state); None when memoryless
    estimate_parity_max_rel_err: float | None  # its plant_estimate (open and closed loop); None without one
    parent: int | None  # the production version when it was exported (the registry's lineage)
    config_hash: str
    bundle: str  # the bundle's folder
    version: int | None  # its registry version; None for a standalone bundle (--out)


def git_commit() -> str:
    """`git rev-parse HEAD` of the source tree, or "unknown" outside a repo / before the first commit."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def estimates_of(policy: torch.nn.Module) -> list[list]:
    """[name, low, high, log scale] of each parameter the policy estimates (its `plant_estimate`); [] if none."""
    return [list(e) for e in getattr(policy, "estimates", None) or []] if getattr(policy, "estimate_head", None) else []


class ExplicitStatePolicy(torch.nn.Module):
    """(obs, history) -> (action, next_history[, plant_estimate]): a history policy whose state is an output of
    the graph too (and, with an estimate head, the plant it believes it is on).

    next_history is the history one step on, newest first: (obs, the policy's own action) then the older rows.
    The edge overwrites that newest action with the one the plant was really sent (after the shield).
    """

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy
        self.obs_dim, self.act_dim = int(getattr(policy, "obs_dim")), int(getattr(policy, "act_dim"))
        self.history_length = int(getattr(policy, "history_length"))
        self.estimating = bool(estimates_of(policy))

    def forward(self, obs: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, ...]:
        action = self.policy(obs, history)
        newest = torch.cat([obs, action], dim=-1).unsqueeze(1)
        state = torch.cat([newest, history[:, : self.history_length - 1]], dim=1)
        if self.estimating:
            return action, state, getattr(self.policy, "plant_estimate")(obs, history)
        return action, state


def to_onnx(policy: torch.nn.Module, obs_dim: int, metadata: dict[str, str]) -> onnx.ModelProto:
    """Trace `policy` to an ONNX model with a dynamic batch axis and `metadata` in metadata_props."""
    buf = io.BytesIO()
    history_length = int(getattr(policy, "history_length", 0))
    args: tuple[torch.Tensor, ...] = (torch.zeros(1, obs_dim),)
    names, outputs = [INPUT_NAME], [OUTPUT_NAME]
    if history_length:
        args += (torch.zeros(1, history_length, obs_dim + int(getattr(policy, "act_dim"))),)
        names.append(HISTORY_NAME)
        outputs.append(NEXT_HISTORY_NAME)
        if estimates_of(policy):
            outputs.append(ESTIMATE_OUTPUT)
        policy = ExplicitStatePolicy(policy)
    elif estimates_of(policy):
        raise ExportError("a plant estimate needs the policy's history: a memoryless policy cannot carry one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        # dynamo=False: the TorchScript exporter works offline (no onnxscript) and
        # yields a small Gemm/Tanh/Clip graph for these MLPs.
        torch.onnx.export(
            policy.eval(),
            args,
            cast(Any, buf),  # a file object works (TorchScript exporter); torch's stub names only paths
            input_names=names,
            output_names=outputs,
            opset_version=OPSET,
            dynamo=False,
            dynamic_axes={n: {0: "batch"} for n in names + outputs},
        )
    model = onnx.load_from_string(buf.getvalue())
    for key, value in sorted(metadata.items()):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(value)
    return model


def check_graph(model: onnx.ModelProto) -> None:
    """`onnx.checker` with full shape inference; ExportError if the graph is invalid."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise ExportError(f"{POLICY_FILE}: onnx.checker rejected the exported graph: {err}") from None


def check_shield_spec(shield_spec: dict, obs_dim: int, act_dim: int) -> None:
    """The shield spec must validate and fit the policy, or the bundle would fail at load on the edge."""
    try:
        spec = ShieldSpec.from_dict(shield_spec)
    except ShieldSpecError as err:
        raise ExportError(f"{SHIELD_FILE}: {err}") from None
    if (spec.obs_dim, spec.act_dim) != (obs_dim, act_dim):
        raise ExportError(
            f"{SHIELD_FILE}: sized for obs {spec.obs_dim}/act {spec.act_dim}, the policy is obs {obs_dim}/act {act_dim}"
        )


def _buffer(policy: torch.nn.Module, name: str) -> np.ndarray:
    """A registered buffer of the policy (its observation normalizer) as numpy."""
    value = getattr(policy, name)
    assert isinstance(value, torch.Tensor), name
    return value.numpy()


def parity_observations(
    obs_mean: np.ndarray, obs_std: np.ndarray, n: int = PARITY_SAMPLES, seed: int = 0
) -> np.ndarray:
    """Observations for the parity check: n Gaussian draws of the training distribution + extremes + zeros."""
    rng = np.random.default_rng(seed)
    mean, std = np.asarray(obs_mean, np.float64), np.asarray(obs_std, np.float64)
    dim = mean.shape[0]
    sampled = mean + std * rng.standard_normal((n, dim))
    # Each coordinate alone at +-10 sigma (the normalizer's clip edge), all at once, and random corners.
    eye = np.eye(dim)
    extremes = [mean + s * EXTREME_SIGMA * std * eye for s in (1.0, -1.0)]
    extremes += [mean + s * EXTREME_SIGMA * std for s in (1.0, -1.0)]
    extremes.append(mean + EXTREME_SIGMA * std * rng.choice([-1.0, 1.0], size=(64, dim)))
    extremes.append(np.zeros((1, dim)))
    return np.concatenate([sampled, *[np.atleast_2d(e) for e in extremes]]).astype(np.float32)


def split_inputs(policy: torch.nn.Module, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Flat network inputs [n, input_dim] -> (obs [n, obs_dim], history [n, H, obs_dim + act_dim] or None)."""
    obs_dim, history_length = int(getattr(policy, "obs_dim")), int(getattr(policy, "history_length", 0))
    if not history_length:
        return inputs, None
    return (
        np.ascontiguousarray(inputs[:, :obs_dim]),
        np.ascontiguousarray(inputs[:, obs_dim:].reshape(len(inputs), history_length, -1)),
    )


def estimate_error(got: np.ndarray, reference: np.ndarray) -> float:
    """Max |onnxruntime - torch| of plant estimates, relative where a value exceeds 1 (a damping of 4x nominal is
    decoded through exp): compared with ESTIMATE_PARITY_TOL, as the closed loop's float32 noise in the actions it
    reads back from its history reaches the estimate too."""
    reference = np.asarray(reference, np.float64)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - reference) / np.maximum(1.0, np.abs(reference))))
    return err if np.isfinite(err) else float("inf")


def parity_error(
    policy: torch.nn.Module, session: OnnxPolicy, inputs: np.ndarray, batches: tuple[int, ...] = PARITY_BATCHES
) -> dict[int, float]:
    """Max |onnxruntime - torch| over flat `inputs` (observation [+ history]), edge session, per batch size."""
    obs, history = split_inputs(policy, inputs)
    with torch.no_grad():
        reference = policy(*[torch.from_numpy(a) for a in (obs, history) if a is not None]).numpy()
    errors = {}
    for batch in batches:
        actions = np.concatenate(
            [
                session.run(obs[i : i + batch], None if history is None else history[i : i + batch])
                for i in range(0, len(obs), batch)
            ]
        )
        if actions.shape != reference.shape:
            raise ExportError(f"{POLICY_FILE}: onnxruntime returned shape {actions.shape}, torch {reference.shape}")
        errors[batch] = float(np.max(np.abs(actions.astype(np.float64) - reference)))
        if not np.isfinite(errors[batch]):
            errors[batch] = float("inf")  # NaN in one and not the other: never parity
    return errors


def estimate_parity_error(policy: torch.nn.Module, session: OnnxPolicy, inputs: np.ndarray) -> float:
    """`estimate_error` of the graph's plant_estimate against torch's over flat `inputs`, in batches of 64."""
    obs, history = split_inputs(policy, inputs)
    assert history is not None  # export refuses an estimate without a history (to_onnx)
    with torch.no_grad():
        reference = getattr(policy, "plant_estimate")(torch.from_numpy(obs), torch.from_numpy(history)).numpy()
    got = np.concatenate([session.outputs(obs[i : i + 64], history[i : i + 64])[-1] for i in range(0, len(obs), 64)])
    if got.shape != reference.shape:
        raise ExportError(f"{POLICY_FILE}: {ESTIMATE_OUTPUT} has shape {got.shape}, torch {reference.shape}")
    return estimate_error(got, reference)


def state_parity_error(
    policy: torch.nn.Module,
    session: OnnxPolicy,
    obs_mean: np.ndarray,
    obs_std: np.ndarray,
    steps: int = STATE_PARITY_STEPS,
    plants: int = STATE_PARITY_PLANTS,
    seed: int = 0,
) -> tuple[float, int, float | None]:
    """(max |onnxruntime - torch| over actions and states, resets done, `estimate_error` of the plant estimates each
    memory keeps or None without them) along `plants` interleaved closed loops.

    The onnxruntime side is what the edge runs: one `PlantMemory` per plant, `act` then `remember` the action
    sent, `clear` at an episode start. The torch side steps `ExplicitStatePolicy`, feeding each plant its own
    next_history. Every third step
    the plant is sent half the policy's action (a shield's override), written into the newest row on both
    sides; each plant starts a new episode every STATE_EPISODE_STEPS steps.
    """
    stateful = ExplicitStatePolicy(policy)
    rng = np.random.default_rng(seed)
    mean, std = np.asarray(obs_mean, np.float64), np.asarray(obs_std, np.float64)
    obs = (mean + std * rng.standard_normal((steps, plants, len(mean)))).astype(np.float32)
    memories = [session.new_memory() for _ in range(plants)]
    shape = (1, stateful.history_length, stateful.obs_dim + stateful.act_dim)
    states = [torch.zeros(shape) for _ in range(plants)]
    worst, resets, estimate_worst = 0.0, 0, 0.0
    for t in range(steps):
        for p in range(plants):
            memory = memories[p]
            assert memory is not None  # a history policy: one memory per plant
            if t and (t + p * 23) % STATE_EPISODE_STEPS == 0:
                memory.clear()
                states[p] = torch.zeros(shape)
                resets += 1
            action = session.act(obs[t, p], memory)
            with torch.no_grad():
                ref, nxt, *estimate = stateful(torch.from_numpy(obs[t, p][None]), states[p])
            sent, ref_sent = (0.5 * action, 0.5 * ref[0]) if t % 3 == 2 else (action, ref[0])
            session.remember(memory, obs[t, p], sent)
            nxt[0, 0, stateful.obs_dim :] = ref_sent
            states[p] = nxt
            err = max(
                float(np.max(np.abs(action.astype(np.float64) - ref[0].numpy()))),
                float(np.max(np.abs(memory.array.astype(np.float64) - nxt.numpy()))),
            )
            worst = max(worst, err if np.isfinite(err) else float("inf"))
            if estimate:
                assert memory.estimate is not None  # the graph has the output, so `act` kept it
                estimate_worst = max(estimate_worst, estimate_error(memory.estimate, estimate[0][0].numpy()))
    return worst, resets, (estimate_worst if stateful.estimating else None)


def export_deterministic(
    policy: torch.nn.Module,
    meta: dict,
    shield_spec: dict,
    *,
    config_hash: str,
    out_dir: str | Path | None = None,
    registry_root: str | Path = "models",
    parity_tol: float = PARITY_TOL,
    metrics: dict | None = None,
    extra: dict | None = None,
) -> ExportResult:
    """Export a given deterministic policy (+ meta from `load_policy`) to a bundle; see `export_policy`."""
    obs_dim, act_dim = int(meta["obs_dim"]), int(meta["act_dim"])
    check_shield_spec(shield_spec, obs_dim, act_dim)
    commit = git_commit()
    metadata = dict(
        task=meta["task"],
        env_id=meta["env_id"],
        obs_dim=obs_dim,
        act_dim=act_dim,
        action_low=json.dumps([float(v) for v in np.broadcast_to(meta["action_low"], (act_dim,))]),
        action_high=json.dumps([float(v) for v in np.broadcast_to(meta["action_high"], (act_dim,))]),
        obs_clip_sigma=EXTREME_SIGMA,
        bundle_version=BUNDLE_VERSION,
        config_hash=config_hash,
        git_commit=commit,
        history_length=int(meta.get("history_length", 0)),
    )
    model = to_onnx(policy, obs_dim, metadata)
    check_graph(model)
    onnx_bytes = model.SerializeToString()

    obs = parity_observations(_buffer(policy, "obs_mean"), _buffer(policy, "obs_std"))
    session = OnnxPolicy(onnx_bytes)  # the one edge session every parity check below runs
    errors = parity_error(policy, session, obs)
    worst = max(errors.values())
    if not worst <= parity_tol:
        detail = ", ".join(f"batch {b}: {e:.3g}" for b, e in errors.items())
        raise ExportError(
            f"{POLICY_FILE}: onnxruntime disagrees with torch (max abs error {detail}; "
            f"tolerance {parity_tol:g}) on {len(obs)} observations; bundle not written"
        )
    state_err: float | None = None
    estimate_err = estimate_parity_error(policy, session, obs) if estimates_of(policy) else None
    if int(meta.get("history_length", 0)):
        state_err, resets, loop_estimate_err = state_parity_error(
            policy, session, _buffer(policy, "obs_mean")[:obs_dim], _buffer(policy, "obs_std")[:obs_dim]
        )
        if not state_err <= parity_tol:
            raise ExportError(
                f"{POLICY_FILE}: the policy state diverges between onnxruntime and torch (max abs error "
                f"{state_err:.3g}, tolerance {parity_tol:g}) over {STATE_PARITY_STEPS} steps of "
                f"{STATE_PARITY_PLANTS} plants with {resets} resets; bundle not written"
            )
        if loop_estimate_err is not None and estimate_err is not None:
            estimate_err = max(estimate_err, loop_estimate_err)
    if estimate_err is not None and not estimate_err <= ESTIMATE_PARITY_TOL:
        raise ExportError(
            f"{POLICY_FILE}: {ESTIMATE_OUTPUT} differs between onnxruntime and torch (max relative error "
            f"{estimate_err:.3g}, tolerance {ESTIMATE_PARITY_TOL:g}) on the parity observations and closed loops; "
            "bundle not written"
        )

    registry = Registry(registry_root)
    parent = _production_or_none(registry, meta["task"])
    all_metrics = {
        "parity_max_abs_err": worst,
        "parity_observations": int(len(obs)),
        **(
            {"state_parity_max_abs_err": state_err, "state_parity_steps": STATE_PARITY_STEPS * STATE_PARITY_PLANTS}
            if state_err is not None
            else {}
        ),
        **({"estimate_parity_max_rel_err": estimate_err} if estimate_err is not None else {}),
        "train_updates": meta.get("updates"),
        "train_env_steps": meta.get("env_steps"),
        **(metrics or {}),
    }
    if meta.get("selection"):
        sel = meta["selection"]
        all_metrics["validation_return"] = sel.get("validation_return")
        # Which checkpoint and why; the train ranges it was trained on (ADR: the ranges reached, fraction < 1).
        extra = {
            **(extra or {}),
            "selection": {k: v for k, v in sel.items() if k != "train_randomization"},
            "checkpoint": meta.get("checkpoint"),
            "adr_fraction": sel.get("adr_fraction"),
            "train_randomization": sel.get("train_randomization"),
        }
    shield_bytes = shield_json_bytes(shield_spec)
    action_low = [float(v) for v in np.broadcast_to(meta["action_low"], (act_dim,))]
    action_high = [float(v) for v in np.broadcast_to(meta["action_high"], (act_dim,))]
    # The normalizer covers the network's whole input (a history policy's too): the observation comes first.
    contract = io_contract(
        meta["env_id"],
        _buffer(policy, "obs_mean")[:obs_dim],
        _buffer(policy, "obs_std")[:obs_dim],
        action_low,
        action_high,
        int(meta.get("history_length", 0)),
        state_names=(HISTORY_NAME, NEXT_HISTORY_NAME),
        estimates=estimates_of(policy),
        estimate_output=ESTIMATE_OUTPUT,
        estimate_skill=meta.get("estimate_skill"),
    )
    manifest = make_manifest(
        task=meta["task"],
        env_id=meta["env_id"],
        config_hash=config_hash,
        git_commit=commit,
        parent=parent,
        files={POLICY_FILE: onnx_bytes, SHIELD_FILE: shield_bytes},
        metrics=all_metrics,
        extra=extra,
        obs_dim=obs_dim,
        act_dim=act_dim,
        action_low=action_low,
        action_high=action_high,
        contract=contract,
        hidden_sizes=list(meta.get("hidden_sizes", [])),
        opset=OPSET,
        history_length=int(meta.get("history_length", 0)),
    )
    version: int | None = None
    if out_dir is not None:
        bundle = write_bundle(out_dir, policy_onnx=onnx_bytes, shield_spec=shield_bytes, manifest=manifest)
    else:
        staging = Path(tempfile.mkdtemp(prefix="sim2real-export-"))
        try:
            write_bundle(staging / "bundle", policy_onnx=onnx_bytes, shield_spec=shield_bytes, manifest=manifest)
            version = registry.register(staging / "bundle")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        bundle = registry.bundle_dir(meta["task"], version)
    return ExportResult(
        task=meta["task"],
        parity_max_abs_err=worst,
        parity_by_batch=errors,
        parity_observations=int(len(obs)),
        state_parity_max_abs_err=state_err,
        estimate_parity_max_rel_err=estimate_err,
        parent=parent,
        config_hash=config_hash,
        bundle=str(bundle),
        version=version,
    )


def _production_or_none(registry, task: str) -> int | None:
    try:
        return registry.production(task)
    except BundleError:
        return None  # an unreadable pointer is the registry's problem to report, not export's


def export_policy(
    run_dir: str | Path,
    *,
    out_dir: str | Path | None = None,
    registry_root: str | Path = "models",
    shield_spec: Callable[[Any], dict] | None = None,
) -> ExportResult:
    """Export a run's latest checkpoint to a bundle (registered unless `out_dir`); returns bundle, version, parity.

    `shield_spec(cfg)` builds the bundle's shield.json from the run's config (default `build_shield_spec`; the CLI
    and the flows pass `pipeline.evaluation.monitor_bounds.bundle_spec`, whose monitor bounds are measured)."""
    from pipeline.config import load_config
    from pipeline.training.policy import load_policy

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such training run directory")
    cfg = load_config(run_dir / "config.yaml")
    policy, meta = load_policy(run_dir)
    from pipeline.safety.shield_spec import build_shield_spec

    build = shield_spec or build_shield_spec

    extra = {"run": run_dir.resolve().name}  # the run's name: a bundle carries no path of the training machine
    from pipeline.training.adaptive import ESTIMATE_SKILL_FILE

    if (run_dir / ESTIMATE_SKILL_FILE).is_file():  # an adaptive run: its estimate's recalibration and skill
        skill = json.loads((run_dir / ESTIMATE_SKILL_FILE).read_text())
        if skill.get("checkpoint") == meta.get("checkpoint"):
            rows = skill["parameters"]
            getattr(policy, "recalibrate_estimate")([r["offset"] for r in rows], [r["scale"] for r in rows])
            meta["estimate_skill"] = {r["name"]: r["held_out_r2"] for r in rows}
        else:
            print(
                f"warning: {run_dir / ESTIMATE_SKILL_FILE} was measured on {skill.get('checkpoint')}, the export "
                f"takes {meta.get('checkpoint')}: its plant estimate goes out uncalibrated and unscored",
                file=sys.stderr,
            )
    if meta["config_hash"] != cfg.config_hash():
        # The manifest keeps the hash the weights were trained under; say loudly that config.yaml drifted.
        print(
            f"warning: {run_dir / 'config.yaml'} hashes to {cfg.config_hash()[:12]}..., the checkpoint was "
            f"trained under {meta['config_hash'][:12]}...: the run dir was edited, or the run was resumed with "
            f"other settings (--steps, --actors) after this checkpoint",
            file=sys.stderr,
        )
        extra["config_yaml_hash"] = cfg.config_hash()
    return export_deterministic(
        policy,
        meta,
        build(cfg),
        config_hash=meta["config_hash"],
        out_dir=out_dir,
        registry_root=registry_root,
        extra=extra,
    )
