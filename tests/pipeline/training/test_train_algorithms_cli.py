"""Every algorithm through the `sim2real` command line on a small budget: train, --resume, export (parity),
eval, shadow and serve, from the shipped config; and a key the chosen algorithm would ignore exits 2. The flow
(`sim2real run`) for each: tests/flows/test_flows.py.

The learning itself is tested elsewhere (test_train_learning.py: APPO; test_offpolicy.py: SAC reach a return
threshold); here a run is only asked to go through every path and hand each command what the next one needs.
APPO, the default, goes through the same commands in test_train_fault.py, test_eval_cli.py and test_flows.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import ray
import yaml

from pipeline.cli import main
from shield.client import PolicyClient
from shield.runtime import EdgeRuntime
from tests.helpers.algorithm_configs import small_config
from tests.helpers.serve_bundles import ServerProcess

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def sim2real(capsys, *argv) -> tuple[int, dict]:
    """Run `sim2real ARGV --json` in this process (Ray stays up between commands); (exit code, its JSON)."""
    capsys.readouterr()
    code = main([*map(str, argv), "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("algorithm", ["sac", "td3", "impala"])
def test_an_algorithm_goes_through_every_command(ray_local, algorithm, tmp_path, capsys):
    config, run, bundle = small_config(tmp_path, algorithm), tmp_path / "run", tmp_path / "bundle"

    code, trained = sim2real(capsys, "train", "--config", config, "--steps", 1_000, "--out", run)
    assert code == 0 and trained["algorithm"] == algorithm and trained["run_dir"] == str(run)
    assert trained["env_steps"] >= 1_000 and trained["updates"] > 0
    off_policy = trained["replay"] is not None
    if off_policy:
        assert trained["replay"]["learned_samples"] > 0
    # Every algorithm selects on validation: export takes the best checkpoint by validation return.
    selection = json.loads((run / "selection.json").read_text())
    assert trained["best_updates"] == selection["best"]["updates"] and selection["evaluations"] >= 2
    assert trained["best_validation_return"] == max(h["validation_return"] for h in selection["history"])

    if off_policy:  # (the on-policy resume through the CLI: test_train_fault.py)
        code, resumed = sim2real(capsys, "train", "--resume", run, "--steps", 1_600)  # with the run's own config.yaml
        assert code == 0 and resumed["updates"] > trained["updates"] and resumed["env_steps"] >= 1_600
        assert resumed["replay"]["replay_restored"] > 0

    code, exported = sim2real(capsys, "export", run, "--out", bundle)
    assert code == 0 and exported["parity_max_abs_err"] <= 1e-5
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["extra"]["checkpoint"] == "best.pt"

    # serve: over UDP, the bundle answers with the shielded action the in-process edge runtime computes.
    reference = EdgeRuntime.load(bundle)
    observations = np.random.default_rng(0).normal(0.0, 0.3, (8, reference.obs_dim)).astype(np.float32)
    with (
        ServerProcess(str(bundle), "--deadline-us", "1e7") as server,
        PolicyClient(server.host, server.port, timeout_s=5.0) as client,
    ):
        for obs in observations:
            assert client.act(obs).action.tobytes() == reference.act(obs)[0].tobytes()
        server.stop()

    code, evaluated = sim2real(capsys, "eval", bundle, "--config", config, "--episodes", 2, "--domains", "reality")
    assert code == 0 and evaluated["episodes"] == 2 and evaluated["violations"] == 0  # the shield holds the band

    code, shadow = sim2real(
        capsys, "shadow", bundle, "--config", config, "--episodes", 2, "--report", tmp_path / "report"
    )
    # The gate looks after each batch of 2 until its bounds decide or the budget ends (gate.max_episodes).
    assert shadow["decision"] in ("pass", "fail", "inconclusive") and code == (0 if shadow["decision"] == "pass" else 1)
    assert shadow["metrics"]["episodes"] >= 2 and shadow["metrics"]["episodes"] % 2 == 0


@pytest.mark.parametrize(
    "key, value", [("lr_schedule", "linear"), ("batches_per_update", 2), ("adr", {"enabled": True})]
)
def test_train_refuses_a_key_the_algorithm_would_ignore(key, value, tmp_path, capsys):
    data = yaml.safe_load((ROOT / "configs" / "cartpole_sac.yaml").read_text())
    data["train"][key] = value
    config = tmp_path / "sac.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"train.{key}: not read by train.algorithm 'sac'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
