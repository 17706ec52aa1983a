"""The shield's assumptions follow from every randomization set, and a set they do not cover is refused.

`sim2real config --check` (and `sim2real export`, through the same spec builder)
names the set, the parameter, its range and the limit it breaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

ROOT = Path(__file__).resolve().parents[3]


def _variant(tmp_path, task: str, edit) -> Path:
    doc = yaml.safe_load((ROOT / "configs" / f"{task}.yaml").read_text())
    edit(doc)
    path = tmp_path / f"{task}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
def test_shipped_configs_are_covered(task, capsys):
    assert main(["config", "--check", str(ROOT / "configs" / f"{task}.yaml")]) == 0
    cfg = load_config(ROOT / "configs" / f"{task}.yaml")
    spec = build_shield_spec(cfg)
    sets = spec["assumptions"]["sets"]
    assert set(sets) == {"train", "validation", "reality"}  # every set, not only train
    assert spec["latency_steps"] == max(s["latency_steps_max"] for s in sets.values())
    # ... and every latency down to the fewest any set admits is a case of the prediction, by default
    assert spec["latency_min_steps"] == min(r.latency_steps.low for r in cfg.randomization.values()) == 0


def test_the_latency_cases_follow_the_sets_unless_the_config_names_them(tmp_path):
    def at_least_one(doc):  # every set admits 1 step or more
        for rset in doc["randomization"].values():
            rset["latency_steps"] = {
                "low": max(1, rset["latency_steps"]["low"]),
                "high": max(1, rset["latency_steps"]["high"]),
            }

    spec = build_shield_spec(load_config(_variant(tmp_path, "quadrotor", at_least_one)))
    assert (spec["latency_min_steps"], spec["latency_steps"]) == (1, 2)

    def exactly_two(doc):  # one latency: one case, and the spec reads as before the key existed
        for rset in doc["randomization"].values():
            rset["latency_steps"] = {"low": 2, "high": 2}

    spec = build_shield_spec(load_config(_variant(tmp_path, "quadrotor", exactly_two)))
    assert "latency_min_steps" not in spec and spec["latency_steps"] == 2

    def without_latency(doc):  # a set without the key admits 0 steps
        del doc["randomization"]["train"]["latency_steps"]

    spec = build_shield_spec(load_config(_variant(tmp_path, "quadrotor", without_latency)))
    assert (spec["latency_min_steps"], spec["latency_steps"]) == (0, 2)

    with pytest.raises(EnvelopeError, match="shield.latency_min_steps"):  # naming fewer cases than the sets admit
        build_shield_spec(
            load_config(
                _variant(tmp_path, "quadrotor", lambda d: (at_least_one(d), d["shield"].update(latency_min_steps=2)))
            )
        )


def _old_quadrotor_reality(doc):
    doc["randomization"]["reality"]["body_mass"]["quad"]["high"] = 1.2
    for i in range(4):
        doc["randomization"]["reality"]["actuator_gain"][f"rotor{i}"]["low"] = 0.85


@pytest.mark.parametrize(
    "task,edit,needles",
    [
        (
            "quadrotor",
            _old_quadrotor_reality,
            [
                "randomization.reality.actuator_gain / body_mass",
                "0.708",
                "shield.input_gain_error = 0.2",
                "floor-holding",
                "toward + on position obs[2]",
                "shield.brake_accel[2]",
            ],
        ),
        # Braking a climb at 2.6 m/s^2: the light, strong train plant (gain/mass 1.2) over-delivers its
        # gravity compensation by 1.96 m/s^2 and reaches only 2.54 downward.
        (
            "quadrotor",
            lambda d: d["shield"].update(brake_accel=[1.5, 1.5, [2.6, 0.6]]),
            [
                "randomization.train.actuator_gain / body_mass",
                "2.538 m/s^2 toward - on position obs[2]",
                "shield.brake_accel[2]",
            ],
        ),
        (
            "quadrotor",
            lambda d: d["randomization"]["reality"]["push"].pop("axes"),
            ["randomization.reality.push.max_force", "1.579 m/s^2 on position obs[2]"],
        ),
        (
            "cartpole",
            lambda d: d["randomization"]["reality"]["joint_damping"]["slider"].update(low=0.5),
            [
                "randomization.reality.joint_damping.slider: range [0.5, 1.5] leaves "
                "shield.model_ranges.joint_damping.slider"
            ],
        ),
        (
            "cartpole",
            lambda d: d["randomization"]["train"]["actuator_gain"]["cart_force"].update(high=1.4),
            ["randomization.train.actuator_gain / body_mass", "shield.input_gain_error = 0.47"],
        ),
        (
            "cartpole",
            lambda d: (
                d["randomization"]["reality"].update(latency_steps={"low": 0, "high": 3})
                or d["shield"].update(latency_steps=2)
            ),
            ["randomization.reality.latency_steps: up to 3 steps"],
        ),
        (
            "arm",
            lambda d: d["shield"].update(latency_min_steps=1),
            ["randomization.train.latency_steps: from 0 steps, below the 1 the shield predicts for"],
        ),
        # A hand-set braking fraction past what the weakest plant has left after the other joint's torque through
        # the coupling and the model error synthesis measures.
        (
            "arm",
            lambda d: d["shield"].update(brake_fraction=0.9),
            ["randomization.reality.actuator_gain / body_mass", "toward + on position obs[1]", "shield.brake_accel[1]"],
        ),
        (
            "cartpole",
            lambda d: d["randomization"]["reality"].update(obs_noise_std=0.05),
            ["randomization.reality.obs_noise_std[0]: 3 sigma = 0.1500", "shield.margin = 0.03"],
        ),
    ],
)
def test_a_set_the_shield_cannot_cover_is_refused_by_name(tmp_path, capsys, task, edit, needles):
    path = _variant(tmp_path, task, edit)
    assert main(["config", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    with pytest.raises(EnvelopeError):  # the builder `sim2real export` calls
        build_shield_spec(load_config(path))


def test_a_push_the_braking_margin_cannot_absorb_becomes_speed_the_barrier_brakes_from(tmp_path):
    """push_velocity: per position, (push - (authority - brake)) x the push's duration, the worst over the sets."""
    assert "push_velocity" not in build_shield_spec(load_config(ROOT / "configs" / "cartpole.yaml"))  # absorbed
    base = build_shield_spec(load_config(ROOT / "configs" / "quadrotor.yaml"))
    reality = base["assumptions"]["sets"]["reality"]
    slack = min(a - 1.5 for a in reality["authority_accel"][0])  # x brakes at 1.5 both ways
    assert base["push_velocity"][0] == pytest.approx((reality["push_accel"][0] - slack) * 10 * base["dt"])

    spec = build_shield_spec(
        load_config(
            _variant(tmp_path, "quadrotor", lambda d: d["randomization"]["reality"]["push"].update(duration_steps=20))
        )
    )
    assert spec["push_velocity"][:2] == pytest.approx(
        [2 * base["push_velocity"][0]] * 2
    )  # twice as long, twice the speed
