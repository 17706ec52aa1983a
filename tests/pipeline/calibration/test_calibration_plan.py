"""`sim2real calibrate --plan`: an excitation that makes what a quiet log leaves open identifiable, stated beforehand.

The plant is a cart-pole parked at its set-point (no moving target, no pushes) with good sensors: under the
legacy LQR its log is quiet, and the cart's mass and the actuator's gain stay unpinned. The plan is designed on
the nominal twin, then applied on a hidden plant (pipeline.calibration.simulate, the legacy loop adding the
sequence) and the log calibrated: the parameters must come out inside their intervals, the realized intervals
close to what the plan said, and the plan must keep every corner of `reality` inside its limits.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from pipeline.calibration.calibrate import calibrate
from pipeline.calibration.identify import SYSTEMATIC_STD
from pipeline.calibration.plan import (
    CANDIDATES,
    ExcitedLegacy,
    design_plan,
    excitation,
    load_plan,
    replay,
    write_plan,
)
from pipeline.calibration.simulate import simulated_log
from pipeline.commands import USER_ERROR
from pipeline.config import load_config
from pipeline.evaluation.excitation import corner_check

ROOT = Path(__file__).resolve().parents[3]
STEPS = 1000  # 20 s at 50 Hz, quiet log and plan alike
TRUTH = {
    "body_mass.cart": 1.1,
    "body_mass.pole": 1.1,
    "joint_damping.slider": 1.0,
    "joint_damping.hinge": 1.5,
    "actuator_gain.cart_force": 0.95,
}
WANTED = ("body_mass.cart", "actuator_gain.cart_force")
REALIZED_FACTOR = 2.0  # a realized 90 % interval within this factor of the plan's expected one, either way
# A quiet log's interval, when it pins a parameter at all, at least this much wider than planned, in its
# sampling part (the systematic floor every interval carries is the same for any log).
QUIET_WIDER = 1.5
# A planned interval this narrow or better: every stated interval carries the systematic floor
# (SYSTEMATIC_STD, +-4.1 % at 90 % on a combination), so "narrow" means within 1.25x of it.
NARROW = 1.25 * math.expm1(norm.ppf(0.95) * SYSTEMATIC_STD)


def _parked_config(base: Path) -> Path:
    """The shipped cart-pole parked at x_ref = 0, sensors 5x better, no pushes: quiet logs."""
    from envs.tasks import register_task_file

    data = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    (base / "cartpole_rail.xml").write_text((ROOT / "configs" / "cartpole_rail.xml").read_text())
    data["task"] = {"name": "cartpole_parked", "env_id": "sim2real/CartPoleParkedTest-v0"}
    data["plant"]["targets"]["rail"].update(low=[0.0], high=[0.0])
    reality = data["randomization"]["reality"]
    reality.pop("push")
    reality["obs_noise_std"] = [0.2 * s for s in reality["obs_noise_std"]]
    reality["action_noise_std"] = 0.01
    # The plant's bench-measured motor constant (back-EMF) fixes the scale kinematic logs cannot see.
    data["calibration"] = {"known": {"joint_damping.slider": TRUTH["joint_damping.slider"]}}
    # Only the cart's mass and the gain vary in reality: its four corners keep the safety sweep small.
    reality["body_mass"]["pole"] = {"dist": "uniform", "low": 1.1, "high": 1.1}
    reality["joint_damping"] = {
        "slider": {"dist": "uniform", "low": 1.0, "high": 1.0},
        "hinge": {"dist": "loguniform", "low": 1.5, "high": 1.5},
    }
    reality["latency_steps"] = {"low": 1, "high": 1}
    path = base / "parked.yaml"
    path.write_text(yaml.safe_dump(data))
    register_task_file(path)
    return path


@pytest.fixture(scope="module")
def parked(tmp_path_factory) -> Path:
    return _parked_config(tmp_path_factory.mktemp("parked"))


@pytest.fixture(scope="module")
def planned(parked, tmp_path_factory):
    base = tmp_path_factory.mktemp("plan")
    config = parked
    cfg = load_config(config)
    quiet = simulated_log(cfg, TRUTH, 1, base / "quiet.npz", steps=STEPS, seed=3)
    check = lambda sequence: corner_check(cfg, sequence, seed=0)  # noqa: E731
    plan = design_plan(
        cfg, params=list(WANTED), amplitude=0.1, steps=STEPS, from_log=str(quiet), seed=0, safety_check=check
    )
    path = write_plan(plan, base / "plan.json")
    applied = simulated_log(
        cfg, TRUTH, 1, base / "applied.npz", steps=STEPS, seed=3, probe=replay(load_plan(path)["sequence"])
    )
    return config, cfg, plan, load_plan(path), calibrate(cfg, applied)


@pytest.mark.timeout(900)
def test_a_quiet_log_leaves_the_cart_wide_and_the_plan_states_a_narrow_interval_for_it(planned):
    _, _, plan, _, _ = planned
    quiet = plan["quiet_log"]["parameters"]
    assert plan["params"] == list(WANTED)
    for name in WANTED:
        expected = plan["expected"]["parameters"][name]
        assert expected["pinned"] and expected["expected_half_width"] < NARROW, (name, expected)
        # The quiet log: not pinned alone, or pinned with a sampling std at least QUIET_WIDER times the plan's.
        if quiet[name]["pinned"]:
            assert quiet[name]["log_std_sampling"] >= QUIET_WIDER * expected["expected_log_std_sampling"], (
                name,
                quiet[name],
                expected,
            )
        # The plan's own quiet reference (no excitation, the same nominal twin) does not pin it.
        assert not plan["quiet_expected"]["parameters"][name]["pinned"]
    assert plan["excitation"]["kind"] != "none" and plan["amplitude"] == 0.1
    assert len(plan["sequence"]) == STEPS and max(abs(v) for row in plan["sequence"] for v in row) <= 0.1 + 1e-9


@pytest.mark.timeout(900)
def test_a_log_calibrate_refuses_as_quiet_is_what_the_plan_reads_and_a_quiet_plan_says_so(planned, monkeypatch):
    """A log that barely moves the plant is refused by calibrate, naming the plan command to run on it, and read by
    the plan (which is what it is for); a plan whose own simulated log would be refused says so before anyone
    records it. The planned log here moves every channel well past its noise."""
    import pipeline.calibration.logs as logs
    from pipeline.calibration.calibrate import fit_setup
    from pipeline.calibration.logs import CalibrationError
    from pipeline.calibration.plan import plan_lines

    config, cfg, plan, _, _ = planned
    assert plan["expected"]["quiet"] == []
    assert not any(line.lstrip().startswith("QUIET") for line in plan_lines(plan))
    quiet_log = simulated_log(cfg, TRUTH, 1, Path(config).parent / "still.npz", steps=STEPS, seed=3)
    monkeypatch.setattr(logs, "QUIET_SPREAD", 1e9)  # every channel is quiet now
    with pytest.raises(CalibrationError, match="--plan --from-log"):
        calibrate(cfg, str(quiet_log))
    assert fit_setup(cfg, str(quiet_log), quiet_ok=True).names  # the plan's reading of it goes through
    loud = {**plan, "expected": {**plan["expected"], "quiet": ["theta spreads 1.9x its noise std (0.01)"]}}
    assert any("QUIET" in line and "raise --amplitude" in line for line in plan_lines(loud))


@pytest.mark.timeout(900)
def test_the_plan_applied_on_a_hidden_plant_recovers_it_inside_intervals_close_to_the_stated_ones(planned):
    _, _, plan, _, result = planned
    assert result["verdict"] == [], result["verdict"]
    for name in WANTED:
        p = result["parameters"][name]
        assert p["identified_ok"], (name, p)
        lo, hi = p["interval"]
        assert lo <= TRUTH[name] <= hi, (name, p["interval"], TRUTH[name])
        realized = math.sqrt(hi / lo) - 1.0
        expected = plan["expected"]["parameters"][name]["expected_half_width"]
        assert expected / REALIZED_FACTOR <= realized <= expected * REALIZED_FACTOR, (name, realized, expected)


@pytest.mark.timeout(900)
def test_the_plan_crosses_no_limit_at_any_corner_of_reality_even_without_the_shield(planned):
    from pipeline.evaluation.evaluate import evaluate
    from pipeline.evaluation.falsify import corner_domains

    _, cfg, plan, loaded, _ = planned
    chosen = plan["safety"][-1]
    assert chosen["safe"] and chosen["violations"] == 0 and chosen["corners"] >= 4
    for i, corner in enumerate(corner_domains(cfg.randomization["reality"])):
        run = evaluate(
            cfg,
            ExcitedLegacy(cfg.task.env_id, loaded["sequence"]),
            domains=corner,
            episodes=1,
            seed=100 + i,
            shield=False,
            max_episode_steps=STEPS,
        )
        assert run["violations"] == 0 and run["steps"] == STEPS, (corner, run["violations"], run["steps"])


def _cli(config: Path, **kw) -> argparse.Namespace:
    args = {"config": str(config), "from_log": None, "out": None, "json": False, "plan": True}
    args.update(params=None, amplitude=0.1, steps=STEPS, seed=0)
    args.update(kw)
    return argparse.Namespace(**args)


@pytest.mark.parametrize(
    "change, culprit",
    [
        ({"amplitude": 0.0}, "--amplitude 0.0"),
        ({"amplitude": 1.5}, "--amplitude 1.5"),
        ({"params": "body_mass.wheel"}, "--params body_mass.wheel"),
        ({"params": "joint_damping.slider"}, "--params joint_damping.slider: held fixed"),
        ({"steps": 100}, "--steps 100"),
    ],
)
def test_bad_plan_input_exits_2_naming_it_in_one_line(parked, tmp_path, capsys, change, culprit):
    from pipeline.commands.calibrate import run

    out = tmp_path / "plan.json"
    assert run(_cli(parked, out=str(out), **change)) == USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and culprit in err and "Traceback" not in err
    assert not out.exists()


def test_a_file_that_is_not_a_plan_is_refused_by_name(tmp_path):
    from pipeline.calibration.logs import CalibrationError

    path = tmp_path / "notaplan.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CalibrationError, match="notaplan.json"):
        load_plan(path)


@settings(max_examples=40, deadline=None)
@given(
    candidate=st.sampled_from(CANDIDATES),
    amplitude=st.floats(1e-3, 1.0),
    steps=st.integers(1, 3000),
    act_dim=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_every_excitation_stays_within_its_amplitude_and_replays_the_same(candidate, amplitude, steps, act_dim, seed):
    generator = {**candidate, "seed": seed}
    seq = excitation(generator, steps, act_dim, amplitude, 0.02)
    assert seq.shape == (steps, act_dim)
    assert np.all(np.abs(seq) <= amplitude * (1 + 1e-12))
    assert np.array_equal(
        seq, excitation(generator, steps, act_dim, amplitude, 0.02)
    )  # the file's generator replays it
    if candidate["kind"] != "none" and steps >= 50:
        assert np.max(np.abs(seq)) >= 0.5 * amplitude  # it does excite


def test_a_plan_expected_to_pin_nothing_says_so_and_is_not_a_success(planned):
    """A helper's Furuta plan reported 0.00 nats for every candidate and every combination as flat, then wrote the
    plan and exited 0, though the combinations had information (std 0.025 against the range's 0.058), just not
    enough to be stated. The same plan made to pin nothing says how far each combination is, NOTHING PINNED, and
    is not a success; the plan that pins what it should is."""
    import copy

    from pipeline.calibration.plan import plan_lines, plan_pins_something

    _, _, plan, _, _ = planned
    assert plan_pins_something(plan) and not any(line.startswith("NOTHING PINNED") for line in plan_lines(plan))
    weak = copy.deepcopy(plan)
    weak["expected"]["pinned_chosen"] = []
    for c in weak["expected"]["combinations"]:
        c["identified"] = False
        c["log_std"] = 0.5 * c["range_log_std"]  # informative, short of the 0.3x it takes
    lines = plan_lines(weak)
    assert not plan_pins_something(weak)
    assert any(line.startswith("NOTHING PINNED: this plan is expected to pin none") for line in lines), lines
    assert all("(flat)" not in line for line in lines)
    assert any("NOT pinned with this plan" in line and "identified below 0.3x it" in line for line in lines)


def test_a_plan_for_a_log_that_pins_everything_says_it_may_not_be_needed(planned):
    """helper-63's --plan on a log that pinned every parameter chose all of them without a word, where the docs
    promise the ones the log leaves unpinned: it now says the log pins them already."""
    import copy

    from pipeline.calibration.plan import plan_lines

    _, _, plan, _, _ = planned
    assert plan["log_pins_all"] is False  # its parameters were named (--params), not read off the log
    assert not any("pin every parameter already" in line for line in plan_lines(plan))
    pinned = {**copy.deepcopy(plan), "log_pins_all": True}
    assert any("pin every parameter already" in line for line in plan_lines(pinned))
