"""Real-to-sim calibration from field logs recorded through `sim2real serve --mode shadow`.

A simulated cart-pole plays the real plant: its parameters are hidden from the
calibration (drawn inside `reality`: cart 1.3x heavier, actuator 0.8x weaker,
2 control steps of latency, reality's sensor noise, action noise and pushes),
the legacy LQR drives it, and every step goes over UDP through a shadow-mode
server that writes the log. 60 s of control at 50 Hz.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import yaml

import envs
from envs.randomization import parse_randomization
from pipeline.calibration.calibrate import action_names, action_sign_hints, calibrate, fit_setup
from pipeline.calibration.logs import CalibrationError, load_field_log
from pipeline.calibration.twin import fixed_set
from pipeline.config import load_config, parse_config
from shield.client import PolicyClient
from shield.shadowlog import read_shadow_log, write_shadow_log
from tests.helpers.algorithm_configs import WIRING_GATE
from tests.helpers.serve_bundles import ServerProcess
from tests.helpers.shadow_candidates import write_estimating_bundle, write_lqr_bundle

ROOT = Path(__file__).resolve().parents[3]
ENV_ID = "sim2real/CartPoleRail-v0"
STEPS = 3000  # 60 s at the cart-pole's 0.02 s control period
TRUTH = {
    "body_mass.cart": 1.3,
    "body_mass.pole": 1.1,
    "joint_damping.slider": 1.2,
    "joint_damping.hinge": 2.0,
    "actuator_gain.cart_force": 0.8,
}
LATENCY = 2


def _hidden_plant(cfg) -> dict:
    """The plant as a fixed randomization set (low == high), with reality's noise and pushes."""
    reality = cfg.randomization["reality"]
    for name, s in TRUTH.items():
        group, element = name.split(".")
        r = getattr(reality, group)[element]
        assert r.low <= s <= r.high, f"{name} = {s} is not inside reality"
    return fixed_set(TRUTH, latency=LATENCY, like=reality)


@pytest.fixture(scope="module")
def field_log(tmp_path_factory):
    """60 s of shadow log from the hidden plant, the legacy controller driving through the server."""
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    base = tmp_path_factory.mktemp("calibrate")
    bundle = write_lqr_bundle(base / "bundle", cfg)
    env = gym.make(ENV_ID, randomization=_hidden_plant(cfg), max_episode_steps=STEPS)
    legacy = envs.legacy_controller(ENV_ID)
    logs = base / "field-logs"
    with ServerProcess(
        str(bundle),
        "--mode",
        "shadow",
        "--log",
        str(logs),
        "--deadline-us",
        "1e7",
        command=(sys.executable, "-m", "pipeline.cli", "serve"),
    ) as server:
        with PolicyClient(server.host, server.port, timeout_s=5.0) as plant:
            obs, info = env.reset(seed=7)  # a log whose latency the fit got wrong when it compared unconverged fits
            for _ in range(STEPS):
                reply = plant.act(obs, legacy_action=legacy(np.asarray(obs, np.float32)[None])[0])
                obs, _, terminated, truncated, _ = env.step(reply.action)
                assert not terminated, "the legacy controller dropped the pole: no usable log"
        server.stop()
    assert info["domain"]["latency_steps"] == LATENCY
    return logs, base


@pytest.mark.timeout(600)
def test_without_a_known_scale_the_common_scale_is_reported_flat_and_ratios_still_identified(field_log):
    """`sim2real calibrate` on the shipped config, which knows no force-unit parameter. (The calibration with one
    known scale runs in the flow test below, where `sim2real run --from-log` calibrates: one fit of each kind.)"""
    logs, base = field_log
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "calibrate",
            "--config",
            str(ROOT / "configs" / "cartpole.yaml"),
            "--from-log",
            str(logs),
            "--out",
            str(base / "calibrated.yaml"),
            "--bundle",
            str(write_estimating_bundle(base / "adaptive", load_config(ROOT / "configs" / "cartpole.yaml"))),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    params = result["parameters"]
    assert result["log"]["steps"] == STEPS
    assert result["latency_steps"]["identified"] == LATENCY
    # A latency at the end of the search says the plant's may be longer (a true 4 against 0..3 was fitted as 3).
    from pipeline.calibration.calibrate import summary_lines

    assert LATENCY < result["latency_steps"]["largest_tried"]
    assert not any("largest tried" in line for line in summary_lines(result))
    edge = {
        **result,
        "latency_steps": {**result["latency_steps"], "identified": LATENCY + 9, "largest_tried": LATENCY + 9},
    }
    assert any("largest tried" in line and "widen latency_steps" in line for line in summary_lines(edge))
    # Scaling every mass, damping and gain together leaves every trajectory unchanged.
    flat_members = {n for d in result["flat_directions"] for n in d["weights"]}
    assert {"body_mass.cart", "actuator_gain.cart_force"} <= flat_members, result["flat_directions"]
    assert {"body_mass.cart", "actuator_gain.cart_force"} <= set(result["unidentified"])
    ratio = params["actuator_gain.cart_force"]["identified"] / params["body_mass.cart"]["identified"]
    truth = TRUTH["actuator_gain.cart_force"] / TRUTH["body_mass.cart"]
    assert abs(ratio / truth - 1) < 0.10, (ratio, truth)
    err = result["prediction_error"]
    assert err["after"]["rms_normalized"] < 0.5 * err["before"]["rms_normalized"]
    # An adaptive policy's plant estimate on the same log, set beside the fit name by name (an untrained one here:
    # the wiring, not the skill; bench/bench_adaptive.py measures that).
    beside = {row["name"]: row for row in result["policy_estimate"]["parameters"]}
    assert result["policy_estimate"]["steps"] == STEPS - 8 and result["log"]["runs"] == 1
    assert beside["latency_steps"]["fit"] == LATENCY
    assert beside["body_mass.cart"]["fit"] == params["body_mass.cart"]["identified"]
    assert all(r["train_range"][0] <= r["policy_median"] <= r["train_range"][1] for r in beside.values())
    # The written set is a valid randomization set: the twin can run on it.
    calibrated = parse_randomization(yaml.safe_load((base / "calibrated.yaml").read_text()))
    assert calibrated.latency_steps.low == calibrated.latency_steps.high == LATENCY
    _, info = gym.make(ENV_ID, randomization=calibrated).reset(seed=0)
    assert info["domain"]["latency_steps"] == LATENCY


def _bad_log(field_log, name: str, change) -> Path:
    logs, base = field_log
    cols, meta = read_shadow_log(logs)
    cols, meta = change({k: v.copy() for k, v in cols.items()}, dict(meta))
    return write_shadow_log(base / "bad" / f"{name}.npz", cols, meta)


def _nan_rows(cols, meta):
    cols["obs"][1200:1203, 2] = np.nan
    return cols, meta


def _gap(cols, meta):
    keep = np.r_[0:1500, 1540 : len(cols["t"])]  # 40 control steps (0.8 s) lost
    return {k: v[keep] for k, v in cols.items()}, meta


def _other_task(cols, meta):
    meta["task"] = "quadrotor"
    return cols, meta


def _short(cols, meta):
    return {k: v[:250] for k, v in cols.items()}, meta  # 5 s


def _clock(period: float):
    def change(cols, meta):  # a real-time clock at `period` s per step
        cols["t"] = 1.8e9 + cols["step"].astype(np.float64) * period + cols["episode"] * 100.0
        return cols, meta

    return change


def _clock_back(cols, meta):
    cols, meta = _clock(0.02)(cols, meta)
    cols["t"][1201] = cols["t"][1200] - 0.001  # a clock reset by a millisecond
    return cols, meta


@pytest.mark.parametrize(
    "name, change, reason",
    [
        ("nan", _nan_rows, r"3 row\(s\) with NaN .*first at row 1200"),
        # A rig at 0.021 s against a 0.02 s config: the twin would replay each step 5 % short.
        ("slow-rig", _clock(0.021), r"clock advances 0\.021 s per step \(median\), \+5\.0 % off .* 0\.02 s"),
        ("milliseconds", _clock(20.0), r"about 1000x the control period .* milliseconds"),
        ("gap", _gap, r"gap\(s\) longer than a control period .* row 1500 .*step 1499 -> 1540"),
        ("other-task", _other_task, r"logged for task 'quadrotor', the config is 'cartpole'"),
        ("short", _short, r"only 5\.0 s of control"),
        # helper-57: a clock stepping back 1 ms, and two rows swapped, were read as one late row and fitted.
        ("backwards", _clock_back, r"1 row\(s\) stamped before the row above them, first at row 1201"),
    ],
)
def test_unusable_logs_are_refused_with_the_reason(field_log, name, change, reason):
    path = _bad_log(field_log, name, change)
    with pytest.raises(CalibrationError, match=reason):
        load_field_log(path, task="cartpole", obs_dim=5, act_dim=1, dt=0.02, min_seconds=10.0)


def test_a_log_that_barely_moves_the_plant_is_refused_before_it_is_fitted(field_log):
    """A quiet log (the pole's angle spreading about its noise std) cannot tell the twin's dynamics from sensor noise:
    fitted, the nominal plant's quiet log read as a misfit and its intervals missed it. It is refused, naming the
    quiet observation and what to do (an excitation that `calibrate --plan` designs), and a real-time clock on the
    control period is accepted on the way."""

    def quiet(cols, meta):
        cols, meta = _clock(0.02)(cols, meta)
        rng = np.random.default_rng(0)
        cols["obs"][:, 1] = 0.01 + rng.normal(0.0, 0.006, len(cols["obs"]))  # theta: reality's 0.006 rad of noise
        return cols, meta

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    with pytest.raises(CalibrationError, match=r"barely moves .*theta spreads 1\.0x its noise std .*--plan"):
        calibrate(cfg, _bad_log(field_log, "quiet", quiet))


def test_a_log_with_the_actions_sign_reversed_is_diagnosed_by_name(field_log):
    """A drive wired the other way was fitted like any log and read as a misfit with latency 0. The verdict's
    `sign?` line names the action whose negation replays the log (the full fit is the flow test's; the hint reads
    the same setup the fit does)."""
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")

    def reversed_drive(cols, meta):
        cols["legacy_action"] = -cols["legacy_action"]
        return cols, meta

    names = action_names(cfg)
    assert action_sign_hints(fit_setup(cfg, field_log[0]), names) == []
    (hint,) = action_sign_hints(fit_setup(cfg, _bad_log(field_log, "reversed", reversed_drive)), names)
    assert hint.startswith("sign? ") and "with cart_force negated" in hint and "reverse its sign" in hint


@pytest.mark.parametrize(
    "name, columns, said",
    [
        # helper-62's logs: each keeps a joint's position and velocity consistent, so the log's own checks passed
        # them, and the fit blamed the twin ("latency 4 control steps", "joint_damping.hinge: 5.42..8").
        (
            "encoder-reversed",
            lambda o: o * [1, -1, 1, -1, 1],
            "the 'hinge' joint's position and velocity (theta, theta_dot) with the other sign",
        ),
        (
            "degrees",
            lambda o: o * [1, 180 / np.pi, 1, 180 / np.pi, 1],
            "the 'hinge' joint's angle and rate (theta, theta_dot) in degrees",
        ),
        ("joints-swapped", lambda o: o[:, [1, 0, 3, 2, 4]], "joints 'slider' and 'hinge' in each other's columns"),
    ],
)
def test_a_joints_columns_in_another_sign_unit_or_place_are_named(field_log, name, columns, said):
    """The verdict's `columns?` line names the change whose undoing replays the log (the hint reads the same setup
    the fit does; calibrate() puts it first whenever a verdict has a line). The log as recorded gets none."""
    from pipeline.calibration.calibrate import observation_hints

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    names = cfg.observation_names(list(range(5)))

    def change(cols, meta):
        cols["obs"] = np.ascontiguousarray(columns(cols["obs"]), dtype=cols["obs"].dtype)
        return cols, meta

    assert observation_hints(fit_setup(cfg, field_log[0]), names) == []
    (hint,) = observation_hints(fit_setup(cfg, _bad_log(field_log, name, change)), names)
    assert hint.startswith("columns? ") and said in hint, hint


def test_cli_refuses_a_bad_log_in_one_line_with_exit_2(field_log):
    path = _bad_log(field_log, "nan-cli", _nan_rows)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "calibrate", "--from-log", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "NaN" in out.stderr and "Traceback" not in out.stderr


def test_another_tasks_dimensions_are_refused(tmp_path):
    cols = {
        "t": np.arange(1000) * 0.02,
        "episode": np.zeros(1000),
        "step": np.arange(1000),
        "obs": np.zeros((1000, 13)),
        "legacy_action": np.zeros((1000, 4)),
        "candidate_raw": np.zeros((1000, 4)),
        "candidate_action": np.zeros((1000, 4)),
        "intervened": np.zeros(1000, bool),
        "fallback": np.zeros(1000, bool),
        "h": np.zeros((1000, 1)),
        "latency_us": np.zeros(1000),
        "reward": np.zeros(1000),
        "cost": np.zeros(1000),
    }
    path = write_shadow_log(tmp_path / "q.npz", cols, {"task": "", "control_period_s": 0.02})
    with pytest.raises(CalibrationError, match="13 x 4, task cartpole has 5 x 1"):
        load_field_log(path, task="cartpole", obs_dim=5, act_dim=1, dt=0.02)


def test_a_known_scale_the_config_does_not_randomize_is_a_config_error():
    data = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    data["calibration"] = {"known": {"body_mass.wheel": 1.0}}
    with pytest.raises(CalibrationError, match=r"calibration.known: \['body_mass.wheel'\]"):
        calibrate(parse_config(data), "/nonexistent")


def _calibration_result(cfg) -> dict:
    """A calibration result as `calibrate` returns it: cart mass and gain identified, the pole not."""
    from pipeline.calibration.sets import calibrated_set

    params = {
        "body_mass.cart": {"identified": 1.3, "identified_ok": True, "range": [1.25, 1.36]},
        "actuator_gain.cart_force": {"identified": 0.8, "identified_ok": True, "range": [0.78, 0.82]},
        "body_mass.pole": {"identified": 1.8, "identified_ok": False, "range": [0.9, 1.5]},
    }
    result = {
        "parameters": params,
        "latency_steps": {"identified": 2},
        "obs_noise_std": [0.003, 0.006, 0.017, 0.025, 0.0],
    }
    result["calibrated"] = calibrated_set(result, cfg.randomization["reality"])
    return result


def test_training_ranges_move_onto_the_calibrated_set_within_the_configured_hull():
    from pipeline.calibration.sets import recentred_training
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    data = recentred_training(cfg, _calibration_result(cfg))
    derived = parse_config(data, "derived")
    train, calibrated = derived.randomization["train"], derived.randomization["calibrated"]
    cart, gain = train.body_mass["cart"], train.actuator_gain["cart_force"]
    # Re-centred (geometric centre on the identified scale) but clipped to the hull of the configured sets.
    shipped = cfg.randomization["train"]
    cart_width = shipped.body_mass["cart"].high / shipped.body_mass["cart"].low
    gain_width = shipped.actuator_gain["cart_force"].high / shipped.actuator_gain["cart_force"].low
    assert cart.high == 1.4 and cart.low == pytest.approx(1.3 / math.sqrt(cart_width))
    assert gain.low == 0.75 and gain.high == pytest.approx(0.8 * math.sqrt(gain_width))
    for name in ("cart", "pole"):  # every calibrated range is covered by training
        assert train.body_mass[name].low <= calibrated.body_mass[name].low
        assert calibrated.body_mass[name].high <= train.body_mass[name].high
    assert (train.latency_steps.low, train.latency_steps.high) == (0, shipped.latency_steps.high)  # covers 2
    assert train.obs_noise_std[2] == 0.017  # widened to the calibrated noise where it is larger
    build_shield_spec(derived)  # the shield spec (and its envelope check) accepts the calibrated config


def _tiny_flow_config(base: Path) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    data["task"]["max_episode_steps"] = 100
    data["train"].update(total_env_steps=4096, num_actors=1, envs_per_actor=4, checkpoint_every=1000)
    data["shadow"].update(episodes=2)
    data["gate"].update(WIRING_GATE)
    data["gate"]["min_return_ratio_production"] = 0.01
    data["calibration"] = {"known": {"joint_damping.slider": TRUTH["joint_damping.slider"]}}
    # as tests/flows/test_flows.py
    data["falsify"] = {"candidates": 40, "episode_steps": 80, "episodes_per_candidate": 1}
    path = base / "tiny-flow.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flow_from_field_logs_calibrates_trains_around_it_and_gates_on_both(harness, field_log):
    from flows.retrain import retrain
    from pipeline.deployment.registry import Registry
    from tests.helpers.shadow_candidates import cartpole_config

    logs, base = field_log
    # Production before the calibrated run: trained without calibration (here the legacy LQR as a bundle).
    registry = Registry(base / "models")
    incumbent = registry.register(write_lqr_bundle(base / "incumbent", cartpole_config()))
    registry.promote("cartpole", incumbent)
    state = retrain(
        config_path=str(_tiny_flow_config(base)),
        models_root=str(base / "models"),
        runs_dir=str(base / "runs"),
        from_log=str(logs),
        return_state=True,
    )
    assert state.is_completed(), state.message
    summary = state.result()
    cal = summary["calibration"]
    assert cal["latency_steps"] == LATENCY
    # The slider damping is the motor's back-EMF constant, in the motor's datasheet: one known force-unit
    # parameter fixes the common scale that kinematic logs cannot see, so the masses and the gain are identified.
    for name in ("body_mass.cart", "actuator_gain.cart_force"):
        p = cal["parameters"][name]
        assert p["identified_ok"], (name, p)
        assert abs(p["identified"] / TRUTH[name] - 1) < 0.10, (name, p["identified"], TRUTH[name])
        assert p["range"][0] <= TRUTH[name] <= p["range"][1], (name, p["range"])
    reality = load_config(ROOT / "configs" / "cartpole.yaml").randomization["reality"]
    for name in cal["unidentified"]:  # what the logs cannot pin keeps (about) its configured range
        group, element = name.split(".")
        r = getattr(reality, group)[element]
        lo, hi = cal["parameters"][name]["range"]
        assert lo <= r.low * 1.05 and hi >= r.high / 1.05, (name, (lo, hi), (r.low, r.high))
    assert cal["prediction_error_after"] < 0.5 * cal["prediction_error_before"]
    derived = load_config(cal["config"])
    assert "calibrated" in derived.randomization
    calibrated = derived.randomization["calibrated"]
    assert calibrated.latency_steps.low == calibrated.latency_steps.high == LATENCY
    _, info = gym.make(ENV_ID, randomization=calibrated).reset(seed=0)
    assert abs(info["domain"]["body_mass.cart"] / TRUTH["body_mass.cart"] - 1) < 0.10
    train_cart = derived.randomization["train"].body_mass["cart"]
    assert train_cart.low <= TRUTH["body_mass.cart"] <= train_cart.high
    assert any(r.startswith("calibrated: ") for r in summary["reasons"])  # gated on the calibrated set too
    report = Path(summary["report"]).read_text()  # and the report says what the twin was calibrated to
    assert "Twin calibration: identified vs nominal" in report and "<td>body_mass.cart</td>" in report
    # The payoff: the twin's error before/after, and the candidate against the uncalibrated production
    # version on the calibrated twin, in the same episodes.
    payoff = cal["payoff"]
    assert payoff["prediction_error_after"] < payoff["prediction_error_before"]
    versus = payoff["against_production"]
    assert versus["production_version"] == incumbent and versus["production_calibrated"] is False
    assert versus["episodes"] >= 2
    shown = registry.show("cartpole", summary["version"])["metrics"]["shadow"]["calibrated"]
    diffs = [c - p for c, p in zip(shown["candidate_returns"], shown["production_returns"])]
    assert versus["paired_difference_mean"] == pytest.approx(sum(diffs) / len(diffs))
    assert "Payoff of calibrating" in report and f"production v{incumbent} (trained without calibration)" in report


@pytest.mark.slow
def test_flow_with_an_unusable_log_stops_before_training_with_the_reason(harness, field_log, tmp_path):
    from flows.retrain import retrain

    path = _bad_log(field_log, "nan-flow", _nan_rows)
    state = retrain(
        config_path=str(_tiny_flow_config(tmp_path)),
        models_root=str(tmp_path / "models"),
        runs_dir=str(tmp_path / "runs"),
        from_log=str(path),
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(CalibrationError, match="NaN"):
        state.result()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("cartpole-*"))
