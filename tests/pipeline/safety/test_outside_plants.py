"""Plants outside users declared from the docs alone (tests/pipeline/safety/plants/), no shield number set by hand,
each on which synthesis once picked a filter that did not keep it, or refused it for the wrong reason.

- short_crane: a 2 kg trolley under a 3 kg payload on a 0.4 m rod, a 30 N drive, 0-3 steps of latency. Full action
  brakes both positions, so synthesis kept it with the braking barrier. But the model error the barrier must cover
  over the latency (about 20 m/s^2 on the trolley, 50 rad/s^2 on the swing) outruns that braking: no action met the
  barrier's conditions even at rest, it fell back on every step, and the legacy LQR behind it crossed the rail limit
  (14 violating steps in 10 `reality` episodes), which it never does unshielded.
- gantry2d: a bridge carrying a trolley, a 4 kg payload swinging in x and y on a 0.6 m rod, 40 N and 60 N drives.
  Its barrier holds the plant at rest, so the check at rest passed it; but with up to 20 rad/s^2 of model error
  on a swing against 2 m/s^2 of trolley braking, it found an action by its conditions on almost no state of its own
  safe set and acted by its least-violation fallback, which nothing certifies. Falsification crossed the bridge's
  band, and the user's adversary went 8 cm past it in 3 of 30 `reality` episodes.
- dpcrane: a 1 kg hook on a 0.7 m cable, a 5 kg payload on a 0.3 m sling. At a corner of its constraint box the
  drive's effect on the sling angle reverses, on the nominal plant too; the refusal blamed whichever randomized
  range it measured there (payload, then hook, then drive gain as each was narrowed) and offered a "largest
  sub-range" for it.
- hoist_lift (a vertical hoist, a load swinging sideways): a vertical force cannot swing the load, so no shield can
  keep its swing limit; synthesis failed on a schema check of a braking figure the user never set. As declared
  first (hoist.xml, a plain motor against gravity) it told the user to "linearize where the plant rests", which a
  hoist never does off its stops; and as a double integrator with two positions and one actuator it crashed.
- wheel_pendulum: a pendulum balanced upright by a reaction wheel (0.5 N m), its tilt and the wheel's speed limited,
  0-2 steps of latency. Synthesis refused it, telling the user to change their legacy LQR's weights; they did, and
  narrowed the latency, and it then certified with 4.9 % of that controller's steps changed. The backup on the
  legacy weights needed more of the input box near rest than it may use, and was not softened as an unstable one
  is; softened, its plans never settled: it brought the wheel's angle (weighed 1e-4, limited by nothing) back at
  0.999 per step.
- hovercraft: a puck in a walled arena, one thrust along its heading (kept in the first quadrant by a heading
  limit) and a yaw torque. Full thrust brakes x, and brakes y, so synthesis kept it with the braking barrier; but
  braking x toward its upper limit while y closes on its lower one needs the thrust both ways at once. The
  certified, promoted shield fell back there and bang-bang drove the puck 0.2 m past its limit, on the nominal
  plant too, in 150-step falsification episodes too short to reach that corner.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@pytest.mark.parametrize(
    "plant, why, barrier_problem",
    [
        ("short_crane", "cannot hold the plant even at rest", "at_rest"),
        ("gantry2d", "finds no action", "over_its_safe_set"),
    ],
)
def test_a_barrier_that_cannot_act_gives_way_to_the_predictive_filter(plant, why, barrier_problem):
    from pipeline.config import load_config
    from pipeline.safety.barrier_checks import barrier_holding_problem, barrier_sample_states
    from pipeline.safety.certificate import certificate
    from pipeline.safety.shield_spec import build_shield_spec
    from tests.helpers.shield_specs import assert_kept_on_reality

    cfg = load_config(HERE / "plants" / f"{plant}.yaml")
    spec = build_shield_spec(cfg)
    record = certificate(cfg, None, spec, None, None)
    assert record["filter"]["type"] == "predictive" and record["shield_numbers"]["set_by_hand"] == []
    assert any(why in w for w in record["filter"]["why"]), record["filter"]
    # The same spec without its predictive section is the barrier synthesis picked before.
    barrier = {k: v for k, v in spec.items() if k != "predictive"}
    rest = [0.0] * len(spec["state_index"])
    at_rest = barrier_holding_problem(barrier, rest)
    if barrier_problem == "at_rest":
        assert "swing_limit" in (at_rest or "")
        assert "steps of latency, and the pushes)" in at_rest and "push_velocity" in barrier  # the crane's are declared
    else:  # it holds at rest, and nowhere much else
        assert at_rest is None
        assert "inside its own safe set" in (barrier_holding_problem(barrier, rest, barrier_sample_states(cfg)) or "")
    assert_kept_on_reality(cfg, spec, seed=0)


def test_a_barrier_refusal_names_the_pushes_and_the_latency_the_plant_has():
    """helper-65's hoist declared no push, and its refusal said the model error was carried "over 2 steps of
    latency, and the pushes"."""
    from pipeline.safety.barrier_checks import _covered

    assert _covered({"latency_steps": 2, "push_velocity": [[0.0, 0.3]]}) == "over 2 steps of latency, and the pushes"
    assert _covered({"latency_steps": 1}) == "over 1 step of latency"
    assert _covered({"latency_steps": 0}) == "with no latency"


def test_a_barrier_that_acts_on_only_half_its_safe_set_gives_way_to_the_predictive_filter():
    """helper-52's lift arm: a braking barrier that finds an action on about half the states inside its own safe
    set was certified, and answered FALLBACK (least-violation braking, nothing certifying it) on 60 % of the legacy
    controller's steps on reality, changing 92 % of them. The barrier is picked only where it acts on
    BARRIER_ACTS_SHARE of them; the arms that keep it act on 88 % (arm_vertical) and 93 % (the shipped arm)."""
    from pipeline.config import load_config
    from pipeline.safety.barrier_checks import BARRIER_ACTS_SHARE, barrier_holding_problem, barrier_sample_states
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(HERE / "plants" / "lift_arm.yaml")
    spec = build_shield_spec(cfg)
    assert "predictive" in spec
    (why,) = spec["predictive"]["measured"]["why"]
    stuck, inside = (int(n) for n in re.search(r"on (\d+) of (\d+) sampled states", why).groups())
    assert (1.0 - BARRIER_ACTS_SHARE) * inside < stuck < 0.6 * inside  # acts on about half of them
    barrier = {k: v for k, v in spec.items() if k != "predictive"}
    assert barrier_holding_problem(barrier, [1.2, 0.0]) is None  # it does act at rest
    assert barrier_holding_problem(barrier, [1.2, 0.0], barrier_sample_states(cfg)) == why


def test_the_certificate_says_which_starts_the_predictive_filter_admits_from_the_first_step():
    """helper-71's ball on a plate fell back from the first step of 23 % of its episodes (started 5 cm off centre,
    the filter's tube 10 cm wide at the horizon) and falsification found it at its stops, with nothing saying
    the starts were the cause. The certificate now states the corners of plant.initial_state the filter admits no
    plan from and the box, shrunk about its middle, from which every start is admitted; the lift arm's tube (0.21
    rad at the horizon, 0.2 from its limit at 1.3) leaves out its upper corners. The admitted set is convex, so
    every start inside that box is admitted, and a start just past it is not."""
    from pipeline.config import load_config
    from pipeline.safety import predictive
    from pipeline.safety.certificate import filter_record
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.cbf import CbfShield

    cfg = load_config(HERE / "plants" / "lift_arm.yaml")
    spec = build_shield_spec(cfg)
    starts = filter_record(spec, cfg)["starts"]
    assert starts["corners"] == 4 and starts["not_admitted"] == 2 and starts["example"]["q"] == pytest.approx(1.3)
    (lo, hi), (vlo, vhi) = starts["admitted_box"]["qpos.shoulder"], starts["admitted_box"]["qvel.shoulder"]
    assert 1.1 < lo < hi < 1.3 and starts["message"].startswith("the predictive filter admits no plan from 2 of")
    shield = CbfShield(spec)
    fallback = np.asarray(spec["fallback_action"], np.float32)

    def admitted(q: float, dq: float) -> bool:
        shield.reset()
        return not shield.filter(np.array([q, dq, 1.2], np.float32), fallback)[1]["fallback"]

    rng = np.random.default_rng(0)
    assert all(admitted(rng.uniform(lo, hi), rng.uniform(vlo, vhi)) for _ in range(50))
    assert not admitted(1.3, -0.05)
    assert predictive.start_coverage(cfg, spec) == starts  # what the certificate states is the measurement


def test_the_arm_keeps_its_braking_barrier():
    # The arm's synthesized barrier (every corner swept holds) falls back only at speed near its joint limits.
    from pipeline.config import load_config
    from pipeline.safety.barrier_checks import barrier_holding_problem, barrier_sample_states
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(HERE.parents[2] / "configs" / "arm.yaml")
    spec = build_shield_spec(cfg)
    assert "predictive" not in spec
    assert barrier_holding_problem(spec, [0.0] * len(spec["state_index"]), barrier_sample_states(cfg)) is None


def test_a_drive_that_reverses_at_a_state_of_the_nominal_plant_is_refused_for_the_state_not_a_range():
    from pipeline.config import load_config
    from pipeline.safety import synthesis
    from pipeline.safety.certificate import refusal
    from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

    cfg = load_config(HERE / "plants" / "dpcrane.yaml")
    meas = synthesis.measure(cfg)
    weak = synthesis.gain_problems(meas)
    assert weak and meas.names[weak[0][0]] == "th2"
    record = refusal(cfg, meas, weak)  # with the bisection `shield synthesize` runs
    assert record["state_is_the_cause"] and "parameter" not in record and "certifiable_range" not in record
    assert "no parameter's range is the cause" in record["message"] and "Narrow the constraints" in record["message"]
    # It reverses at rest too (the sling's angles, not the trolley's speed): said so, not left to a guess from the
    # state listed, whose speeds would point at a box on a speed that changes nothing.
    assert record["effect_at_rest"] < 0.1 and "at rest at the same positions: no parameter's" in record["message"]
    with pytest.raises(EnvelopeError, match="no parameter.s range is the cause"):
        build_shield_spec(cfg, measurement=meas)


def _hoist(tmp_path, name: str, edit) -> Path:
    """hoist_lift.yaml edited by `edit(plant)`, written as its own task (the MJCF by absolute path)."""
    doc = yaml.safe_load((HERE / "plants" / "hoist_lift.yaml").read_text())
    doc["task"] = {"name": name, "env_id": f"sim2real/{name.title().replace('_', '')}-v0"}
    doc["plant"]["mjcf"] = str(HERE / "plants" / doc["plant"]["mjcf"])
    edit(doc["plant"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_limit_no_actuator_can_move_is_refused_by_name(tmp_path):
    from pipeline.config import ConfigError, load_config
    from pipeline.safety.shield_spec import ShieldSpecError, build_shield_spec

    with pytest.raises(ShieldSpecError, match=r"constraint swing_limit: no actuator moves theta \(obs\[1\]"):
        build_shield_spec(load_config(HERE / "plants" / "hoist_lift.yaml"))

    def gravity(plant):  # a plain motor: it holds the carriage and its load only under a steady action
        plant["mjcf"] = str(HERE / "plants" / "hoist.xml")
        plant["actuators"][0]["units_per_action"] = 120.0

    def swing_kept_free(plant):  # the swing limit dropped, the swing still listed as a position to brake
        plant["constraints"] = [c for c in plant["constraints"] if c["name"] != "swing_limit"]

    with pytest.raises(ShieldSpecError, match=r"plant.kinematics.positions\[1\] \(theta\): no constraint reads it"):
        build_shield_spec(load_config(_hoist(tmp_path, "hoist_swing_free", swing_kept_free)))

    import envs

    held = load_config(_hoist(tmp_path, "hoist_gravity", gravity))  # its weight is the trim: 7 kg x g / 120 N
    assert envs.nominal_model(held.task.env_id).trim == pytest.approx((7.0 * 9.81 / 120.0,), abs=1e-6)

    def two_positions(plant):
        plant["shield_model"] = {"type": "double_integrator", "accel_per_action": [12.0]}
        plant["legacy"] = {
            "type": "pid",
            "loops": [{"action": 0, "measured": "z", "setpoint": "z_ref", "rate": "z_dot", "kp": 3.0}],
        }

    with pytest.raises(ConfigError, match=r"plant.kinematics.positions: .* 2 position\(s\) for 1 actuator"):
        load_config(_hoist(tmp_path, "hoist_two_positions", two_positions))


def test_a_plant_its_shield_refuses_is_still_measured_bare_and_a_run_is_refused_before_training(
    tmp_path, capsys, monkeypatch
):
    """An outside user's hovercraft (a limit no input moves at the operating point) with the shield refused:
    `eval --no-shield` still measures it (the adversary reads only the limits), and `sim2real run` refuses it
    in one line before a flow starts, where export had refused it with a traceback after training."""
    import json

    from pipeline.cli import main as sim2real

    monkeypatch.setenv("SIM2REAL_TASKS", "")
    path = str(HERE / "plants" / "hoist_lift.yaml")
    args = ["eval", "--config", path, "--policy", "adversarial", "--domains", "reality", "--episodes", "2"]
    assert sim2real([*args, "--no-shield", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
    runs = tmp_path / "runs"
    assert sim2real(["run", "--config", path, "--models", str(tmp_path / "models"), "--runs", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "no actuator moves theta" in err and "Traceback" not in err, err
    assert not runs.exists() or not any(runs.iterdir())  # nothing trained


def test_a_predictive_refusal_says_over_which_states_it_sampled(tmp_path):
    """Without its swing limit the hoist's height is left to the filters: its barrier cannot hold it even at rest,
    and the predictive filter admits almost no plan, since the load's hinge has no range and is drawn over its whole
    circle. The refusal used to name neither; it now gives the box the plans were drawn from."""
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

    def height_only(plant):
        plant["kinematics"] = {"positions": ["z"], "velocities": ["z_dot"]}
        plant["constraints"] = [c for c in plant["constraints"] if c["name"] != "swing_limit"]

    with pytest.raises(EnvelopeError, match=r"theta \[-3.14, 3.14\].*theta turns without limit.*give it its range"):
        build_shield_spec(load_config(_hoist(tmp_path, "hoist_height_only", height_only)))


def test_a_single_thrust_on_two_limited_positions_is_refused_naming_both():
    """No filter is certified for the hovercraft: the barrier cannot brake x and y together, and the predictive
    filter has no backup LQR (y is not reachable at rest). The refusal names both limits and what to change."""
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

    with pytest.raises(EnvelopeError) as refused:
        build_shield_spec(load_config(HERE / "plants" / "hovercraft.yaml"))
    message = str(refused.value)
    side = r"toward its (upper|lower) limit \(arena\)"
    pair = rf"cannot brake x {side} and y {side} at once"
    assert re.search(pair, message), message
    assert "none of it" in message and "an input of its own" in message
    assert "the predictive filter cannot keep it either" in message
    assert "sim2real shield synthesize --config {config}" in refused.value.next_step  # no range named: look for one


def test_a_refusal_that_names_no_range_sends_config_check_to_synthesize(capsys):
    """helper-65: `config --check` and `eval` refused a hoist naming no range and no next step, where `shield
    synthesize` named two ways to a certificate. They now say to run it, on the config given."""
    from pipeline.cli import main as sim2real

    path = str(HERE / "plants" / "hovercraft.yaml")
    assert sim2real(["config", "--check", path]) == 2
    err = capsys.readouterr().err
    assert "the predictive filter cannot keep it either" in err and "Traceback" not in err, err
    assert f"  next: `sim2real shield synthesize --config {path}` looks for a range" in err, err


def test_braking_limits_together_is_asked_of_the_inputs_that_move_them():
    """The arm's two joints each have a motor: its barrier brakes both at once, within its input box, with the
    input's effect at its weakest. The same spec with one motor driving both joints together cannot brake them
    in opposite directions at once, and is refused for it, naming both joints."""
    import envs
    from pipeline.config import load_config
    from pipeline.safety.barrier_checks import barrier_compatibility_problem, directly_driven
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(ROOT / "configs" / "arm.yaml")
    spec = build_shield_spec(cfg)
    names = cfg.observation_names(range(spec["obs_dim"]))
    driven = directly_driven(envs.nominal_model(cfg.task.env_id))
    assert driven == set(spec["kinematics"]["position_index"])  # each joint has its motor
    assert barrier_compatibility_problem(spec, names, driven) is None

    coupled = copy.deepcopy(spec)
    B = np.asarray(coupled["model"]["B"])
    B[:, 0] += B[:, 1]  # one motor moves both joints as both motors did
    B[:, 1] = 0.0
    coupled["model"]["B"] = B.tolist()
    problem = barrier_compatibility_problem(coupled, names, driven)
    joints = [names[o] for o in spec["kinematics"]["position_index"]]
    assert problem is not None and all(f"{j} toward its" in problem for j in joints), problem
    assert "an input of its own" in problem
    # Each joint with its motor, but both weaker than the braking counted on (helper-39's direct-drive arm): every
    # direction is reachable, only not that hard at once. Another input would not help; more authority would.
    weak = copy.deepcopy(spec)
    weak["model"]["B"] = (np.asarray(spec["model"]["B"]) * 0.3).tolist()
    problem = barrier_compatibility_problem(weak, names, driven)
    assert problem is not None and "an input of its own" not in problem, problem
    assert "The inputs reach each of them, but not all at once that hard" in problem


def test_a_wheel_angle_no_limit_reads_is_left_free_and_the_users_own_weights_certify():
    from pipeline.config import load_config
    from pipeline.safety import predictive
    from pipeline.safety.certificate import certificate
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.cbf import CbfShield
    from tests.helpers.shield_specs import assert_kept_on_reality

    cfg = load_config(HERE / "plants" / "wheel_pendulum.yaml")
    spec = build_shield_spec(cfg)
    record = certificate(cfg, None, spec, None, None)
    assert record["filter"]["type"] == "predictive" and record["shield_numbers"]["set_by_hand"] == []
    section = spec["predictive"]
    # The wheel's angle is free: the backup never acts on it, and plans end anywhere along it, so they settle within
    # the horizon the rest of the loop needs.
    assert section["free_states"] == [1]
    assert all(row[1] == 0.0 for row in section["backup_gain"]) and section["terminal_box"][1] == 0.0
    assert section["horizon"] < predictive.MAX_HORIZON
    # The legacy weights' own gain pushed too hard near rest: the backup was made gentler by synthesis itself.
    assert section["measured"]["backup_input_weight_scale"] > 1.0
    assert_kept_on_reality(cfg, spec, seed=1)
    # A spec that calls free a state a limit reads (the tilt; the wheel's speed) is refused where it is loaded.
    for read in (0, 3):
        wrong = copy.deepcopy(spec)
        wrong["predictive"]["free_states"] = [read]
        with pytest.raises(ValueError, match=f"free_states: state {read} is not free"):
            CbfShield(wrong)
