"""Field logs calibration must use or refuse cleanly: late samples, damaged files, empty recordings.

Logs come from a simulated cart-pole driven by its legacy LQR (pipeline.calibration.simulate),
with the config's own noise; the CLI is run as a user runs it, and a refusal is one line, exit 2.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.calibration.fit import cut_windows
from pipeline.calibration.logs import CalibrationError, load_field_log
from pipeline.calibration.simulate import simulated_log
from pipeline.calibration.twin import Twin
from pipeline.config import load_config
from shield.shadowlog import read_shadow_log, write_shadow_log

ROOT = Path(__file__).resolve().parents[3]
CFG = ROOT / "configs" / "cartpole.yaml"
PLANT = {
    "body_mass.cart": 1.2,
    "body_mass.pole": 1.1,
    "joint_damping.slider": 1.1,
    "joint_damping.hinge": 2.0,
    "actuator_gain.cart_force": 0.9,
}
STEPS = 700  # 14 s at 50 Hz: above the config's 10 s minimum


@pytest.fixture(scope="module")
def log_file(tmp_path_factory) -> Path:
    return simulated_log(load_config(CFG), PLANT, 1, tmp_path_factory.mktemp("logs") / "field.npz", steps=STEPS)


def _load(path):
    return load_field_log(path, task="cartpole", obs_dim=5, act_dim=1, dt=0.02, min_seconds=10.0)


def _cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "calibrate", "--config", str(CFG), "--from-log", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def test_a_log_with_one_late_sample_is_used_the_row_counted_and_its_windows_left_out(log_file, tmp_path):
    cols, meta = read_shadow_log(log_file)
    cols["t"] = cols["t"].copy()
    cols["t"][350:] += 0.016  # one 36 ms period on a loaded box; the step counter shows nothing missing
    late = write_shadow_log(tmp_path / "late.npz", cols, meta)
    log = _load(late)
    assert log.late == (350,)
    assert log.runs == [(0, STEPS)] and len(log.obs) == STEPS
    windows = cut_windows(Twin("sim2real/CartPoleRail-v0"), log, horizon=15, stride=16, max_latency=3)
    assert windows.dropped_late == 1
    spans = [(s - 3, s + 15) for s in windows.starts]
    assert not any(lo < 350 <= hi for lo, hi in spans)  # no window replays across the stretched period


@pytest.mark.parametrize("factor", [1.5, 0.1])
def test_a_clock_far_from_the_period_is_not_read_and_the_summary_says_so(log_file, tmp_path, factor):
    """A helper's log stamped at 0.03 s per step (a rig at 33 Hz?) against a 0.02 s config was fitted with no
    word; one 10x fast likewise. Such a clock is still not read (a simulated plant steps off real time), but the
    log says so, with what to do if the rig really ran at that period; a real-time clock says nothing."""
    assert _load(log_file).clock_note is None
    cols, meta = read_shadow_log(log_file)
    cols["t"] = cols["t"] * factor
    log = _load(write_shadow_log(tmp_path / "clock.npz", cols, meta))
    assert log.clock_note is not None and f"{factor:.2g}x the control period 0.02 s: not read" in log.clock_note
    assert "plant.control_period is that" in log.clock_note


def test_a_missing_step_is_still_refused_with_its_row(log_file, tmp_path):
    cols, meta = read_shadow_log(log_file)
    keep = np.r_[0:300, 301:STEPS]
    gap = write_shadow_log(tmp_path / "gap.npz", {k: v[keep] for k, v in cols.items()}, meta)
    with pytest.raises(CalibrationError, match=r"1 gap\(s\) .*first at row 300 .*step 299 -> 301"):
        _load(gap)
    # In a directory of parts (a server's log), the part to cut is named with its own row (helper-36).
    parts = tmp_path / "parts"
    parts.mkdir()
    for name, rows in (("a.npz", keep[:200]), ("b.npz", keep[200:])):
        write_shadow_log(parts / name, {k: v[rows] for k, v in cols.items()}, meta)
    with pytest.raises(CalibrationError, match=r"b\.npz: 1 gap\(s\) .*first at row 100 "):
        _load(parts)


def test_a_truncated_npz_is_refused_in_one_line_naming_the_file_exit_2(log_file, tmp_path):
    data = log_file.read_bytes()
    cut = tmp_path / "truncated.npz"
    cut.write_bytes(data[: len(data) // 2])  # a partial copy
    out = _cli(cut)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert str(cut) in out.stderr and "truncated" in out.stderr


def test_a_damaged_part_in_a_directory_is_the_one_named(log_file, tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "a.npz").write_bytes(log_file.read_bytes())
    (parts / "b.npz").write_bytes(log_file.read_bytes()[:1000])
    with pytest.raises(CalibrationError, match=r"b\.npz: damaged or truncated NPZ"):
        _load(parts)


def test_an_all_zero_log_is_refused_in_one_line_naming_the_file_exit_2(log_file, tmp_path):
    cols, meta = read_shadow_log(log_file)
    zero = write_shadow_log(tmp_path / "zeros.npz", {k: np.zeros_like(v) for k, v in cols.items()}, meta)
    out = _cli(zero)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert str(zero) in out.stderr and "same value" in out.stderr


@pytest.mark.parametrize(
    "column,scale,said",
    [
        ("obs", 1000.0, "x (obs[0]) reaches"),  # the cart's position in mm
        ("legacy_action", 10.0, "legacy_action[0] reaches"),  # the drive's force in N, not the normalized action
    ],
)
def test_values_in_other_units_are_refused_before_any_fit(log_file, tmp_path, column, scale, said):
    """An outside user's log with positions in mm crashed the fit (an overflow in its interval, after 3 minutes),
    and one with actions in newtons was fitted as a misfit plant: both are refused first, naming the file."""
    cols, meta = read_shadow_log(log_file)
    cols[column] = cols[column].copy()
    if column == "obs":
        cols["obs"][:, 0] *= scale
    else:
        cols[column] *= scale
    bad = write_shadow_log(tmp_path / "units.npz", cols, meta)
    out = _cli(bad)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert str(bad) in out.stderr and said in out.stderr, out.stderr


@pytest.mark.parametrize("fault", ["milliseconds", "dead sensor", "actions in N"])
def test_a_bad_part_among_good_ones_is_refused_by_its_name(log_file, tmp_path, fault):
    """Pooled with a good part, a part whose clock is in ms was fitted with a wrong note, and a dead sensor's part
    was fitted: each part is checked alone first, as a single file is."""
    cols, meta = read_shadow_log(log_file)
    bad = {k: v.copy() for k, v in cols.items()}
    if fault == "milliseconds":
        bad["t"] *= 1000.0
    elif fault == "dead sensor":
        bad["obs"][:] = 0.0
    else:
        bad["legacy_action"] *= 10.0
    parts = tmp_path / "parts"
    parts.mkdir()
    write_shadow_log(parts / "a.npz", cols, meta)
    write_shadow_log(parts / "b.npz", bad, meta)
    said = {"milliseconds": "milliseconds", "dead sensor": "sensors recorded nothing", "actions in N": "action box"}
    with pytest.raises(CalibrationError, match=r"b\.npz: .*" + said[fault]):
        load_field_log(
            parts,
            task="cartpole",
            obs_dim=5,
            act_dim=1,
            dt=0.02,
            action_box=Twin("sim2real/CartPoleRail-v0").action_box(),
        )


@settings(max_examples=300, deadline=None)
@given(
    var=st.floats(-1.0, 1.0),
    se=st.floats(0.0, 1.0),
    configured=st.floats(1e-4, 1.0),
    white=st.booleans(),
)
def test_a_configured_noise_is_never_set_to_zero_and_is_kept_where_the_log_admits_it(var, se, configured, white):
    """For every estimate and interval: the calibrated std is positive wherever a noise is configured, the
    configured one where the interval holds it, and otherwise inside the interval's positive part. An interval that
    reaches 0, or residuals not white past one step (helper-47's flexible joint: its 0.01 rad/s sensor read as
    0.004), never lower it."""
    from pipeline.calibration.noise import noise_used

    lo, hi = var - 2 * se, var + 2 * se
    used, why = noise_used(var, lo, hi, configured, white=white)
    assert used > 0.0, (used, why)
    if lo <= configured**2 <= hi or hi <= 0.0 or (hi < configured**2 and (lo <= 0.0 or not white)):
        assert used == configured, why
    else:
        assert lo - 1e-12 <= used**2 <= hi + 1e-12 or used**2 == var, (used, lo, hi)


@pytest.mark.parametrize("command", [["calibrate"], ["run"], ["schedule", "--cron", "0 3 * * *"]])
def test_a_task_coded_in_python_is_refused_before_any_log_is_read_or_flow_started(log_file, tmp_path, command):
    """The shipped quadrotor is a Python task whose observation is not its MuJoCo state: calibration cannot replay
    its logs. `calibrate`, `run --from-log` and `schedule --from-log` say so in one line, exit 2, before a flow
    starts (`run` printed tracebacks, then "gate FAIL" and exit 1, after a Prefect server came up)."""
    args = [*command, "--config", str(ROOT / "configs" / "quadrotor.yaml"), "--from-log", str(log_file)]
    if command[0] != "calibrate":
        args += ["--models", str(tmp_path / "models")]
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "coded in Python" in out.stderr and "cannot be fitted" in out.stderr
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    "fault,said",
    [
        ("two positions swapped", "follows the change of theta (obs[1])"),
        ("a position and its velocity swapped", "position and velocity columns are swapped"),
        ("a velocity of the other sign", "moves against the change of x (obs[0])"),
        ("a velocity in deg/s", "x as fast as that change per second: in other units"),
        ("a velocity in mm/s", "x as fast as that change per second: in other units"),
        # helper-57: columns moved onto another kind's place were fitted, or refused as "barely moves the plant".
        ("a position on its set-point's column", "x_dot (obs[2]) does not integrate to the change of x (obs[0])"),
        ("an angle and its rate swapped", "theta_dot (obs[3]) does not integrate to the change of theta (obs[1])"),
        ("a velocity on another joint's angle", "x_dot (obs[2]) does not integrate to the change of x (obs[0])"),
    ],
)
def test_columns_in_another_order_or_sign_are_refused_before_the_fit(log_file, tmp_path, fault, said):
    """helper-42 fed a log whose columns were in another order than the plant declares: it was fitted, as a plant
    that does not exist. Each velocity is now checked against the change of the positions, step by step. helper-47's
    velocities in deg/s beside positions in rad were fitted as a misfit of the twin: the check now reads the scale
    too."""
    cols, meta = read_shadow_log(log_file)
    obs = cols["obs"].copy()
    if fault == "two positions swapped":
        obs[:, [0, 1]] = obs[:, [1, 0]]
    elif fault == "a position and its velocity swapped":
        obs[:, [0, 2]] = obs[:, [2, 0]]
    elif fault == "a velocity in deg/s":
        obs[:, 3] *= 180.0 / np.pi
    elif fault == "a velocity in mm/s":
        obs[:, 2] *= 1000.0
    elif fault == "a position on its set-point's column":
        obs[:, [0, 4]] = obs[:, [4, 0]]
    elif fault == "an angle and its rate swapped":
        obs[:, [1, 3]] = obs[:, [3, 1]]
    elif fault == "a velocity on another joint's angle":
        obs[:, [1, 2]] = obs[:, [2, 1]]
    else:
        obs[:, 2] *= -1.0
    bad = write_shadow_log(tmp_path / "order.npz", {**cols, "obs": obs}, meta)
    out = _cli(bad)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert str(bad) in out.stderr and said in out.stderr and "not the config" in out.stderr, out.stderr
    if "velocity in" in fault:  # the factor read is the units' (an estimate from the noisy log: within 10 %)
        factor = float(re.search(r"but ([0-9.]+)x as fast", out.stderr).group(1))
        assert abs(factor / (180.0 / np.pi if "deg" in fault else 1000.0) - 1.0) < 0.1, out.stderr
    pairs = Twin("sim2real/CartPoleRail-v0").velocity_pairs()
    assert pairs == [(0, 2, "slider"), (1, 3, "hinge")]
    kept = load_field_log(log_file, task="cartpole", obs_dim=5, act_dim=1, dt=0.02, velocity_pairs=pairs)
    assert len(kept.obs) == STEPS  # the log as recorded passes the same check


def test_noise_is_lowered_only_on_residuals_white_past_one_step(log_file):
    """The log's noise is reality's; a config that claims twice as much is lowered toward it where the twin at the
    log's own plant leaves white residuals, to an interval that holds the log's. A twin 4x off in cart damping or
    half the drive leaves residuals that decay over steps, or hide the noise (helper-47's flexible joint: its
    0.01 rad/s sensor read as 0.004 and set so); the configured noise then stays, and nothing drops below the log's."""
    from pipeline.calibration.noise import observation_noise

    twin = Twin("sim2real/CartPoleRail-v0")
    log = _load(log_file)
    logged = np.array([0.003, 0.006, 0.015, 0.03])  # reality's, which simulated_log gave the log
    right = observation_noise(twin, log, PLANT, 1, 2.0 * logged)
    lowered = [c for c in right if c["used"] < c["configured"]]
    assert lowered, right
    for c, true in zip(right, logged):
        if c["used"] < c["configured"]:
            assert c["interval"][0] <= true <= c["interval"][1] * 1.05 and "lower than configured" in c["why"], c
    for wrong_twin in ({**PLANT, "joint_damping.slider": 4.0}, {**PLANT, "actuator_gain.cart_force": 0.5}):
        wrong = observation_noise(twin, log, wrong_twin, 1, 2.0 * logged)
        held = [c for c in wrong if "correlated" in c["why"] or "reaches 0" in c["why"]]
        assert held and all(c["used"] == c["configured"] for c in held), wrong
        # Nothing is set below the noise the log holds.
        assert all(c["used"] >= 0.95 * true for c, true in zip(wrong, logged)), wrong


def test_a_log_cut_into_files_is_one_recording_and_two_nights_are_two(log_file, tmp_path):
    """A recorder that cuts one session into files (the step counter runs on) gives one recording, whatever the
    files' names; files that do not continue each other are recordings of their own, each starting its own runs
    (both numbering their episodes from 0 is no gap)."""
    cols, meta = read_shadow_log(log_file)
    cut = tmp_path / "cut"
    cut.mkdir()
    write_shadow_log(cut / "a.npz", {k: v[:300] for k, v in cols.items()}, meta)
    write_shadow_log(cut / "b.npz", {k: v[300:] for k, v in cols.items()}, meta)
    one = _load(cut)
    assert one.recordings == () and one.runs == [(0, STEPS)]
    nights = tmp_path / "nights"
    nights.mkdir()
    write_shadow_log(nights / "night1.npz", {k: v[:350] for k, v in cols.items()}, meta)
    second = {k: v[350:] for k, v in cols.items()}
    second["step"] = second["step"] - second["step"][0]  # its own recorder's counter, from 0 again
    write_shadow_log(nights / "night2.npz", second, meta)
    two = _load(nights)
    assert two.recordings == (("night1", 0, 350), ("night2", 350, STEPS)) and two.runs == [(0, 350), (350, STEPS)]


def test_a_site_column_in_other_units_or_another_columns_place_is_refused_by_name(tmp_path):
    """helper-63's tip angle (a tendon sensor, theta + alpha) logged in degrees was accepted "down to the noise
    floor": the fit predicts the joints only. Where the logged joints are the whole state a site or sensor depends
    on, the MJCF computes it from them and the column must follow at the same scale. The two-mass spring observes
    its load's world position through a site."""
    from pipeline.calibration.calibrate import fit_setup

    cfg = load_config(ROOT / "configs" / "two_mass_spring.yaml")
    log = simulated_log(cfg, {}, 1, tmp_path / "log.npz", steps=1000)
    setup = fit_setup(cfg, log)  # as recorded, with reality's noise: accepted
    assert list(setup.twin.derived) == [4]  # x_l, the load_site's world x
    cols, meta = read_shadow_log(log)
    for change, reason in [
        (lambda o: o[:, 4] * 1000.0, r"x_l \(obs\[4\]\) reads 1e\+03x what the MJCF computes .* mm for m"),
        (lambda o: o[:, 2], r"x_l \(obs\[4\]\) does not follow what the MJCF computes .* another order"),
    ]:
        bad = {k: v.copy() for k, v in cols.items()}
        bad["obs"][:, 4] = change(cols["obs"])
        path = write_shadow_log(tmp_path / "bad.npz", bad, meta)
        with pytest.raises(CalibrationError, match=reason):
            fit_setup(cfg, path)


def test_an_angle_logged_whole_turns_apart_is_unwrapped_along_each_episode(log_file, tmp_path):
    """The pole's hinge has no range: the declared env observes it wrapped into half a turn either way, a plant's
    encoder may count turns. Either way the log jumps whole turns where the twin's prediction, integrated by MuJoCo,
    does not: each episode's angle is unwrapped before anything reads it, and is then the log as recorded, a whole
    number of turns apart."""
    cols, meta = read_shadow_log(log_file)
    twin = Twin("sim2real/CartPoleRail-v0")
    assert twin.unlimited_angles() == [1]
    obs = np.asarray(cols["obs"], np.float64).copy()
    obs[:, 1] += 2.0 * np.pi * np.random.default_rng(0).integers(-3, 4, len(obs))
    counted = write_shadow_log(tmp_path / "turns.npz", {**cols, "obs": obs.astype(cols["obs"].dtype)}, meta)
    pairs = twin.velocity_pairs()
    common = dict(task="cartpole", obs_dim=5, act_dim=1, dt=0.02, velocity_pairs=pairs)
    plain = load_field_log(log_file, **common)
    kept = load_field_log(counted, **common, angles=[1])
    assert kept.runs == plain.runs
    for a, b in kept.runs:
        shift = kept.obs[a, 1] - plain.obs[a, 1]
        assert abs(shift / (2.0 * np.pi) - round(shift / (2.0 * np.pi))) < 1e-5
        assert np.allclose(kept.obs[a:b, 1] - shift, plain.obs[a:b, 1], atol=1e-4)
    assert np.array_equal(load_field_log(log_file, **common, angles=[1]).obs, plain.obs)  # nothing to unwrap
