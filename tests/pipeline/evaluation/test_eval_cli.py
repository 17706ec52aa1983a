"""`sim2real eval` handler and the reusable `evaluate`: JSON keys, domains files, bundles, clear errors."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.bench_shield import mlp_onnx
from pipeline.cli import build_parser
from pipeline.commands.eval import run as run_cli
from pipeline.config import load_config
from pipeline.evaluation.evaluate import evaluate, reference_policy
from pipeline.safety.shield_spec import build_shield_spec
from shield.bundle import make_manifest, write_bundle
from tests.helpers.cli_args import cli_args

KEYS = {
    "episodes",
    "return_mean",
    "return_std",
    "violations",
    "violation_episodes",
    "terminated_episodes",
    "held_episodes",
    "intervention_rate",
    "fallbacks",
    "shield_us_p50",
    "shield_us_p99",
}


def _args(**kw) -> argparse.Namespace:
    return cli_args("eval", **{"policy": "adversarial", "domains": "reality", "episodes": 3, "json": True, **kw})


def test_cli_prints_one_json_object_with_the_safety_figures(capsys):
    assert run_cli(_args()) == 0
    shielded = json.loads(capsys.readouterr().out)
    assert KEYS <= set(shielded) and shielded["episodes"] == 3 and shielded["violations"] == 0
    assert shielded["intervention_rate"] > 0  # the adversary is pushing at the rail ends
    # Behind the config's shield, not a bundle's: it says nothing certified it (an outside user read 0 violations
    # behind a shield `shield synthesize` had refused as if verified).
    assert any("has not certified it" in n for n in shielded["notes"]), shielded["notes"]
    assert run_cli(_args(no_shield=True)) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["violations"] > 0 and bare["intervention_rate"] == 0
    assert not any("certified" in n for n in bare["notes"])
    assert bare["held_episodes"] == 0  # nothing held a bare policy at a limit


def test_eval_says_which_limit_was_crossed_by_how_much_and_which_barrier_intervened(capsys):
    """Per constraint: violating steps (true state), the worst excursion past it, the shield's lowest barrier
    value and the interventions charged to it; the quadrotor's random actions cross its floor, not its fence."""
    quad = "configs/quadrotor.yaml"
    assert run_cli(_args(config=quad, policy="random", episodes=2, no_shield=True)) == 0
    bare = json.loads(capsys.readouterr().out)
    per = bare["constraints"]
    assert list(per) == ["geofence", "altitude_floor", "person_keepout"]  # the task's constraints, in its order
    assert per["altitude_floor"]["violating_steps"] > 0 and per["altitude_floor"]["worst_excursion"] > 0
    assert per["geofence"]["violating_steps"] == 0 and per["geofence"]["worst_excursion"] == 0.0
    assert bare["violations"] <= sum(c["violating_steps"] for c in per.values())
    assert all(c["min_h"] is None and c["interventions"] == 0 for c in per.values())  # no shield ran
    assert run_cli(_args(config=quad, policy="random", episodes=2)) == 0
    shielded = json.loads(capsys.readouterr().out)
    per = shielded["constraints"]
    assert all(c["violating_steps"] == 0 and c["min_h"] is not None for c in per.values())
    steps = shielded["steps"]
    assert sum(c["interventions"] for c in per.values()) == round(shielded["intervention_rate"] * steps) > 0
    assert run_cli(_args(config=quad, policy="random", episodes=1, no_shield=True, json=False)) == 0
    table = capsys.readouterr().out
    assert "altitude_floor" in table and "worst excursion" in table  # the human output says it too


def test_past_termination_steps_on_past_a_fallen_pole_and_the_shield_still_holds_the_band(capsys):
    """bang-bang drops the pole within a second: the task ends there; with --past-termination each episode runs
    its full 500 steps (the pole swinging and spinning round) and the cart stays on its band."""
    assert run_cli(_args(policy="bang_bang")) == 0
    ended = json.loads(capsys.readouterr().out)
    assert ended["steps"] < 3 * 500
    assert run_cli(_args(policy="bang_bang", past_termination=True)) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["steps"] == 3 * 500 and on["violations"] == 0
    assert run_cli(_args(policy="bang_bang", past_termination=True, no_shield=True)) == 0
    assert json.loads(capsys.readouterr().out)["violations"] > 0  # the band is at stake there


def test_same_seed_gives_the_same_figures():
    cfg = load_config("configs/cartpole.yaml")
    spec = build_shield_spec(cfg)
    runs = [
        evaluate(
            cfg, reference_policy("random", cfg, _spec(spec), seed=5), domains="train", episodes=3, seed=7, spec=spec
        )
        for _ in range(2)
    ]
    assert runs[0]["returns"] == runs[1]["returns"] and runs[0]["intervention_rate"] == runs[1]["intervention_rate"]


@pytest.mark.parametrize("name", ["random", "bang_bang"])
def test_any_episode_of_a_run_replays_alone_from_its_seed(name):
    """`eval --seed 9 --episodes 1` is episode 9 of `eval --seed 7 --episodes 3`: a reference policy's own
    randomness draws from each episode's seed, whatever seed the run (and the policy) started from."""
    cfg = load_config("configs/cartpole.yaml")
    spec = build_shield_spec(cfg)
    run = evaluate(
        cfg, reference_policy(name, cfg, _spec(spec), seed=7), domains="train", episodes=3, seed=7, spec=spec
    )
    alone = evaluate(
        cfg, reference_policy(name, cfg, _spec(spec), seed=9), domains="train", episodes=1, seed=9, spec=spec
    )
    assert alone["returns"] == run["returns"][2:] and len(set(run["returns"])) == 3


def _spec(d):
    from shield.spec import ShieldSpec

    return ShieldSpec.from_dict(d)


def test_domains_from_a_yaml_file(tmp_path, capsys):
    calm = tmp_path / "calm.yaml"
    calm.write_text("latency_steps: {low: 2, high: 2}\nobs_noise_std: 0.0\n")
    assert run_cli(_args(domains=str(calm), policy="legacy")) == 0
    assert json.loads(capsys.readouterr().out)["violations"] == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("latency_stepz: 3\n")
    assert run_cli(_args(domains=str(bad))) == 2
    assert "latency_stepz" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw,culprit",
    [
        (dict(domains="nowhere"), "nowhere"),
        (dict(episodes=0), "--episodes"),
        (dict(policy=None), "BUNDLE"),
        (dict(config="configs/missing.yaml"), "missing.yaml"),
        (dict(policy=None, bundle="no/such/bundle"), "no/such/bundle"),
    ],
)
def test_bad_arguments_name_the_culprit(kw, culprit, capsys):
    assert run_cli(_args(**kw)) == 2
    err = capsys.readouterr().err
    assert culprit in err and "Traceback" not in err


def _random_bundle(out: Path, cfg, spec: dict) -> Path:
    """A cart-pole bundle of an untrained policy (random weights) carrying `spec` as its shield.json."""
    policy = mlp_onnx(5, 1, seed=3)
    spec_bytes = json.dumps(spec).encode()
    files = {"policy.onnx": policy, "shield.json": spec_bytes}
    manifest = make_manifest(
        task="cartpole", env_id=cfg.task.env_id, files=files, config_hash=cfg.config_hash(), obs_dim=5, act_dim=1
    )
    return write_bundle(out, policy_onnx=policy, shield_spec=spec_bytes, manifest=manifest)


def test_a_bundle_is_evaluated_with_its_own_shield_json(tmp_path, capsys):
    cfg = load_config("configs/cartpole.yaml")
    spec = build_shield_spec(cfg)
    bundle = _random_bundle(tmp_path / "b", cfg, spec)
    assert run_cli(_args(policy=None, bundle=str(bundle), domains="train", episodes=2)) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["violations"] == 0 and np.isfinite(result["return_mean"])
    assert result["notes"] == []  # judged under the config it was trained under
    # Under another config of the same plant (a stricter gate), eval says so, as shadow does.
    doc = yaml.safe_load(Path("configs/cartpole.yaml").read_text())
    doc["gate"]["confidence"] = 0.99
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc))
    assert run_cli(_args(policy=None, bundle=str(bundle), config=str(other), episodes=1, json=False)) == 0
    assert f"note: the config hashes to {load_config(other).config_hash()[:12]}" in capsys.readouterr().out


def test_a_bundle_is_run_behind_the_spec_it_is_given(tmp_path):
    """A case found against a bundle's policy, replayed with `--bundle B --shield S`, runs behind S: it ran the
    bundle's own shield.json whatever S was, so a re-measured spec could not be checked on the case it was for."""
    from shield.runtime import EdgeRuntime

    cfg = load_config("configs/cartpole.yaml")
    spec = build_shield_spec(cfg)
    bundle = _random_bundle(tmp_path / "b", cfg, spec)
    runtime = EdgeRuntime.load(bundle, shield=False)
    wider = {**spec, "margin": 0.8}  # most of the band: the barrier acts wherever the cart moves
    common = dict(domains="train", episodes=2, seed=0)
    own = evaluate(cfg, runtime, shield=True, **common)
    assert evaluate(cfg, runtime, shield=True, spec=spec, **common)["intervention_rate"] == own["intervention_rate"]
    assert evaluate(cfg, runtime, shield=True, spec=wider, **common)["intervention_rate"] > own["intervention_rate"]


def test_a_bundle_of_another_task_is_refused_by_name(tmp_path, capsys):
    """A bundle run against another task's config used to say only `observation must have 5 entries, got 6`
    (or, the same size, nothing at all); eval and shadow now name both tasks."""
    from pipeline.cli import main

    cfg = load_config("configs/cartpole.yaml")
    spec_bytes = json.dumps(build_shield_spec(cfg)).encode()
    policy = mlp_onnx(5, 1, seed=3)
    files = {"policy.onnx": policy, "shield.json": spec_bytes}
    manifest = make_manifest(
        task="cartpole", env_id=cfg.task.env_id, files=files, config_hash=cfg.config_hash(), obs_dim=5, act_dim=1
    )
    bundle = write_bundle(tmp_path / "b", policy_onnx=policy, shield_spec=spec_bytes, manifest=manifest)
    for command in (
        ["eval", str(bundle), "--episodes", "1"],
        ["shadow", str(bundle), "--episodes", "1", "--report", str(tmp_path / "report")],
    ):
        assert main([*command, "--config", "configs/arm.yaml"]) == 2
        err = capsys.readouterr().err
        assert "exported for task cartpole" in err and "arm" in err and "Traceback" not in err, err
    assert not (tmp_path / "report").exists()


def test_the_cli_offers_every_reference_policy():
    from pipeline.evaluation.adversary import REFERENCE_POLICIES

    parser, _ = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    policy = next(a for a in commands.choices["eval"]._actions if a.dest == "policy")
    assert tuple(policy.choices) == REFERENCE_POLICIES


def test_bang_bang_holds_every_action_at_a_bound_and_flips_each_at_its_own_period():
    from pipeline.evaluation.adversary import BangBangPolicy

    low, high = np.float32([-1.0, -2.0, 0.0]), np.float32([1.0, 3.0, 0.5])
    policy, twin = BangBangPolicy(low, high, seed=4), BangBangPolicy(low, high, seed=4)
    patterns = []
    for _ in range(3):
        policy.reset(), twin.reset()
        actions = np.concatenate([policy(np.zeros((1, 5))) for _ in range(90)])
        np.testing.assert_array_equal(actions, np.concatenate([twin(np.zeros((1, 5))) for _ in range(90)]))  # seeded
        assert np.all((actions == low) | (actions == high))
        flips = [np.flatnonzero(np.diff(actions[:, k]) != 0) + 1 for k in range(3)]
        for k, at in enumerate(flips):
            assert len(at) >= 2 and len(set(np.diff(at))) == 1  # a fixed half-period per dimension
        patterns.append(tuple(int(f[0]) for f in flips))
    assert len(set(patterns)) > 1  # each episode draws a new pattern


# The refusal names the range synthesis cannot certify: the drive's, or the payload it cannot stop.
REFUSED = r"cannot certify randomization\.\*\.(actuator_gain\.trolley_force|body_mass\.payload)"


@pytest.fixture(scope="module")
def weak_crane(tmp_path_factory) -> Path:
    """A crane whose drive keeps only 5-8 % of its force: no filter can keep the trolley's limits (at a fifth of
    it, the predictive filter with its state-dependent tube still certifies the crane)."""
    import yaml

    doc = yaml.safe_load(open("configs/crane.yaml"))
    doc["plant"]["mjcf"] = str((Path("configs") / doc["plant"]["mjcf"]).resolve())
    for domain in doc["randomization"].values():
        domain["actuator_gain"] = {"trolley_force": {"dist": "uniform", "low": 0.05, "high": 0.08}}
    path = tmp_path_factory.mktemp("weak_crane") / "weak_crane.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_plant_the_shield_cannot_certify_is_still_measured_bare(weak_crane, capsys):
    """The shield refuses the weak crane's envelope (exit 2, naming the drive's range), yet `eval --no-shield`
    runs it, so its owner can see what the bare plant does."""
    from pipeline.cli import main as sim2real

    argv = ["eval", "--config", str(weak_crane), "--policy", "legacy", "--domains", "reality", "--episodes", "1"]
    assert sim2real([*argv, "--json"]) == 2
    assert re.search(REFUSED, capsys.readouterr().err)
    assert sim2real([*argv, "--json", "--no-shield"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["episodes"] == 1 and bare["shield"] is False and bare["intervention_rate"] == 0


def test_a_bare_spec_certifies_nothing_and_refuses_nothing(weak_crane):
    """Bare, the weak crane's spec builds: its measured braking floored to what the schema reads (all above 0),
    no predictive section, no envelope check; a plant the shield certifies gets its shielded spec unchanged."""
    from pipeline.safety.shield_spec import EnvelopeError
    from shield.spec import ShieldSpec, brake_pairs

    cfg = load_config(weak_crane)
    with pytest.raises(EnvelopeError, match=REFUSED):
        build_shield_spec(cfg)
    bare = build_shield_spec(cfg, bare=True)
    ShieldSpec.from_dict(bare)
    assert "predictive" not in bare
    kin = bare["kinematics"]
    assert all(a > 0 for pair in brake_pairs(kin["brake_accel"], len(kin["position_index"])) for a in pair)
    cartpole = load_config("configs/cartpole.yaml")
    assert build_shield_spec(cartpole, bare=True) == build_shield_spec(cartpole)
