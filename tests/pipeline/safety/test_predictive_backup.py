"""The predictive filter's backup gain is chosen for every latency the spec admits, not only the one the shield
predicts through: a gain designed on the prediction can be unstable on a plant with less latency."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.safety import predictive
from tests.helpers.predictive_specs import crane_model


def slowest(M: np.ndarray) -> float:
    return float(np.abs(np.linalg.eigvals(M)).max())


@settings(max_examples=40, deadline=None)
@given(latency=st.integers(0, 3), data=st.data())
def test_the_latency_loop_is_the_shield_and_the_plant_step_by_step(latency, data):
    """The loop's matrix moves (x, the actions in flight) exactly as the shield (predicting through `latency`
    steps from the pending actions) and a plant applying each action `applied` steps after it was sent do."""
    applied = data.draw(st.integers(0, latency))
    A, B, _ = crane_model()
    K = np.array([[1.0, -2.0, 3.0, 0.5]])
    rng = np.random.default_rng(latency * 10 + applied)
    x, sent = rng.normal(size=4), [rng.normal(size=1) for _ in range(latency)]  # oldest first
    z = np.concatenate([x, *reversed(sent)])  # (x_t, u_{t-1}, ..., u_{t-latency})
    M = predictive.latency_loop(A, B, K, latency, applied)
    for _ in range(12):
        x_hat = x.copy()
        for u in sent[len(sent) - latency :] if latency else []:
            x_hat = A @ x_hat + B @ u
        u = -K @ x_hat
        sent.append(u)
        x = A @ x + B @ sent[len(sent) - 1 - applied]
        z = M @ z
        assert np.allclose(z[:4], x, atol=1e-9) and (latency == 0 or np.allclose(z[4:5], u, atol=1e-9))


def test_a_gain_unstable_at_a_latency_the_spec_admits_is_made_gentler_until_every_one_holds():
    """The cart-pole's legacy weights, predicting through 3 steps: on a plant that applies each action 1 step after
    it is sent the loop grows (slowest mode above 1). The backup's input weight is raised until it is stable at
    every latency from 0 to 3; at the latency it predicts through alone, the legacy gain is kept."""
    import envs
    from envs.linearization import discrete_lqr
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import linearize_mujoco

    cfg = load_config("configs/cartpole.yaml")
    A, B, _ = linearize_mujoco(envs.nominal_model(cfg.task.env_id), [0, 1, 2, 3])
    legacy = discrete_lqr(A, B, np.diag(cfg.plant["legacy"]["q"]), np.diag(cfg.plant["legacy"]["r"]))
    assert slowest(predictive.latency_loop(A, B, legacy, 3, 1)) > 1.0
    half = np.ones(4)
    K, scale, modes = predictive.backup_gain(cfg, A, B, half, 3, (0, 1, 2, 3))
    assert scale > 1.0 and max(modes) < 1.0 and len(modes) == 4
    assert all(slowest(predictive.latency_loop(A, B, K, 3, lk)) < 1.0 for lk in range(4))
    K3, scale3, _ = predictive.backup_gain(cfg, A, B, half, 3, (3,))
    assert scale3 == 1.0 and np.array_equal(K3, legacy)


def test_a_latency_range_no_gain_holds_is_refused_naming_the_key(monkeypatch):
    from pipeline.config import load_config

    cfg = load_config("configs/crane.yaml")
    A, B, _ = crane_model()
    monkeypatch.setattr(predictive, "BACKUP_INPUT_WEIGHT_SCALES", (1.0,))
    monkeypatch.setattr(predictive, "latency_loop", lambda *args: 2.0 * np.eye(4))
    with pytest.raises(ValueError, match=r"randomization\.\*\.latency_steps"):
        predictive.backup_gain(cfg, A, B, np.ones(4), 2, (0, 1, 2))


def test_a_gain_stable_on_the_model_but_not_on_a_plant_of_the_envelope_is_made_gentler():
    """The crane's legacy gain, 0-2 steps of latency: stable on the nominal model, but a plant of the envelope
    with three times the drive's authority rings out of it (slowest mode 1.14 at one step of latency). Checked on that
    plant too, the backup's input weight is raised until it holds there as well."""
    from pipeline.config import load_config

    cfg = load_config("configs/crane.yaml")
    A, B, _ = crane_model()
    K1, scale1, _ = predictive.backup_gain(cfg, A, B, np.ones(4), 2, (0, 1, 2))
    strong = (A, 3.0 * B)
    assert scale1 == 1.0 and slowest(predictive.latency_loop(A, B, K1, 2, 1, strong)) > 1.0
    K, scale, modes = predictive.backup_gain(cfg, A, B, np.ones(4), 2, (0, 1, 2), [strong])
    assert scale > 1.0 and max(modes) < 1.0
    assert all(
        slowest(predictive.latency_loop(A, B, K, 2, lk, plant)) < 1.0 for lk in range(3) for plant in [(A, B), strong]
    )


def test_the_envelopes_plants_are_linearized_each_with_its_own_parameters():
    """`plant_models` linearizes every sampled plant as the nominal model is: the crane's payload (0.5x to 1.5x)
    pulls the trolley in proportion to its mass, so the coupling spans about that range around the nominal's."""
    from pipeline.config import load_config
    from pipeline.safety.sampling import EnvelopeSampler

    env = EnvelopeSampler(load_config("configs/crane.yaml"), np.random.default_rng(0), draws=2)
    models = env.plant_models()
    assert len(models) == sum(len(d) for d in env.domains.values())
    pull = np.array([A[2, 1] for A, _ in models])  # trolley velocity per radian of swing, one control period
    assert pull.min() < env.A[2, 1] < pull.max() < 0.0
    assert 2.0 < pull.min() / pull.max() < 4.0  # a full payload over the lightest: ~3x, the trolley's mass aside


def test_a_conservative_certificate_says_what_the_tube_takes_off_each_constraint_at_rest():
    """The closed-form crane's plan from rest stays at rest, so what its tube takes off each constraint is the
    tube's largest position entry over the horizon (2e-4 per step per unit of `tube_per_step`); a certificate whose
    legacy controller is changed on more than CONSERVATIVE_SHARE of its steps names the constraint it takes most
    of, and one under that share says nothing."""
    from pipeline.safety.certificate import CONSERVATIVE_SHARE, conservative_line, conservative_record
    from tests.helpers.predictive_specs import crane_spec

    for factor in (0.0, 1.0, 3.0):
        spec = crane_spec(tube_per_step=factor)
        expected = 2e-4 * spec["predictive"]["horizon"] * factor
        rows = predictive.tube_at_rest(spec)
        assert [name for name, _, _ in rows] == ["rail", "swing"]
        assert all(taken == pytest.approx(expected, abs=1e-12) and room > expected for _, taken, room in rows)
    spec = crane_spec(tube_per_step=3.0)
    assert conservative_record(None, spec, {"episodes": 10, "intervention_rate": CONSERVATIVE_SHARE}) is None
    record = conservative_record(None, spec, {"episodes": 10, "intervention_rate": 0.4})
    line = conservative_line(record)
    assert "40.0%" in line and "constraint 'swing'" in line, line  # the swing's room is the smaller
    # The backup's weights are named as they were chosen: a pid legacy has none to give (helper-56 was told to
    # weigh "your legacy LQR's weights" it did not have).
    lqr = SimpleNamespace(plant={"legacy": {"type": "lqr", "q": [1.0] * 4, "r": [1.0]}})
    pid = SimpleNamespace(plant={"legacy": {"type": "pid", "loops": []}})
    said = {
        k: conservative_line(conservative_record(c, spec, {"episodes": 10, "intervention_rate": 0.4}))
        for k, c in (("lqr", lqr), ("pid", pid))
    }
    assert "your legacy LQR's weights" in said["lqr"] and "Bryson" not in said["lqr"], said
    assert "Bryson's rule" in said["pid"] and "LQR's weights" not in said["pid"], said


def test_synthesis_says_when_legacy_behind_the_shield_met_its_alarm():
    """The legacy line names the share of steps answered FALLBACK (the protocol's alarm) when there were any."""
    from pipeline.commands.shield import legacy_lines

    base = {"episodes": 10, "intervention_rate": 0.136, "violations": 0, "fallback_rate": 0.0, "backup_rate": 0.05}
    assert len(legacy_lines(base)) == 1 and "13.6% of steps changed" in legacy_lines(base)[0]
    alarmed = legacy_lines({**base, "fallback_rate": 0.02})
    assert len(alarmed) == 2 and "2.0% of its steps answered FALLBACK" in alarmed[1] and "the tube" in alarmed[1]
    barrier = legacy_lines({**base, "fallback_rate": 0.02}, predictive=False)[1]  # said for the filter in use
    assert "braking barrier found no action" in barrier and "tube" not in barrier
    assert legacy_lines(None) == []


def _wheel_model(dt: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """(tilt, wheel angle, tilt rate, wheel speed): the tilt falls under gravity, the motor's torque spins the
    wheel one way and the pendulum the other; nothing depends on the wheel's angle."""
    A = np.eye(4)
    A[0, 2] = A[1, 3] = dt
    A[2, 0], A[3, 0] = 35.0 * dt, -35.0 * dt
    B = np.array([[0.0], [0.0], [-11.0 * dt], [790.0 * dt]])
    return A, B


def test_a_state_nothing_depends_on_and_no_limit_reads_is_free_and_the_backup_leaves_it():
    """helper-70's reaction-wheel pendulum: its legacy LQR weighs the wheel's angle at 1e-4, so a backup built on
    those weights brings the wheel back to its angle with a mode of 0.999 per step: no plan settled within the
    horizon, and the filter admitted 0 of 34,560 sampled plans. The angle moves nothing and no limit reads it
    (the wheel-speed limit reads its rate): it is free, the backup is designed without it and never acts on it."""
    A, B = _wheel_model()
    tilt, angle = np.array([[1.0, 0.0, 0.0, 0.0]]), np.array([[0.0, 1.0, 0.0, 0.0]])
    speed = np.array([[0.0, 0.0, 0.0, 1.0]])
    assert predictive.free_states(A, np.vstack([tilt, speed])) == [1]
    assert predictive.free_states(A, np.vstack([tilt, angle])) == []  # a limit reads it
    coupled = A.copy()
    coupled[2, 1] = 0.01  # the tilt depends on it (an unbalanced wheel)
    assert predictive.free_states(coupled, tilt) == []
    assert predictive.free_states(A, tilt, [(coupled, B)]) == []  # so on one plant of the envelope
    cfg = SimpleNamespace(plant={"legacy": {"type": "lqr", "q": [50.0, 1e-4, 1.0, 0.01], "r": [1.0]}})
    bound, _, _ = predictive.backup_gain(cfg, A, B, np.ones(4), 0, (0,))
    assert slowest(A - B @ bound) > 0.998  # the wheel's angle brought back, slowly
    K, _, modes = predictive.backup_gain(cfg, A, B, np.ones(4), 0, (0,), free=[1])
    assert np.all(K[:, 1] == 0.0) and max(modes) < 0.99
    keep = [0, 2, 3]
    assert slowest((A - B @ K)[np.ix_(keep, keep)]) == pytest.approx(max(modes))
    # Its mode is 1 for good: the tail is followed until the rest has settled, and the angle has no terminal box.
    box, reach = predictive.terminal(np.ones(4), A - B @ K, K, np.vstack([tilt, speed]), np.full(1, 10.0), [1])
    assert box[1] == 0.0 and np.all(box[keep] > 0.0) and np.all(np.isfinite(reach))


def test_a_backup_whose_tail_needs_more_than_its_share_of_the_box_is_made_gentler():
    """The same pendulum on its legacy weights: stable, but near where it stops the plant the backup's tail needs
    more than half the input box. The input weight is raised until it fits, as it is raised until stable; the
    user's legacy weights (the controller the gate compares with) are not what they must change."""
    A, B = _wheel_model()
    W = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    cfg = SimpleNamespace(plant={"legacy": {"type": "lqr", "q": [50.0, 1e-4, 1.0, 0.01], "r": [1.0]}})
    half = np.array([0.25, np.pi, 2.6, 150.0])

    def fits(K):
        try:
            predictive.terminal(half, A - B @ K, K, W, np.ones(1), [1])
        except ValueError as err:
            return str(err)
        return None

    first, scale1, _ = predictive.backup_gain(cfg, A, B, half, 0, (0,), free=[1])
    assert scale1 == 1.0 and fits(first) is not None
    K, scale, modes = predictive.backup_gain(cfg, A, B, half, 0, (0,), fits=fits, free=[1])
    assert scale > 1.0 and fits(K) is None and max(modes) < 1.0
    with pytest.raises(ValueError, match="input weight raised up to"):
        predictive.backup_gain(cfg, A, B, half, 0, (0,), fits=lambda K: "too hard", free=[1])


def test_where_both_filters_refuse_the_reason_that_leads_is_one_with_a_way_out():
    """helper-70's wheel pendulum: both filters refused, and the refusal led with the braking barrier's "no
    sub-range of it ... can be certified", a dead end for a plant whose limits braking cannot keep anyway; the
    predictive filter's reason, the filter such a plant needs, came last. It now leads there; where the barrier
    names a sub-range that certifies (a way to a certificate), the barrier's refusal still leads."""
    from types import SimpleNamespace

    from pipeline.commands.shield import both_refused
    from pipeline.safety.shield_spec import PREDICTIVE_TOO

    cfg = SimpleNamespace(task=SimpleNamespace(name="wheel"))
    braking = "cannot certify randomization.*.body_mass.pole over [0.7, 1.4] (both ends): braking 0.2 < 0.5"
    why = "its backup's tail needs more than the input box"
    predictive = f"{braking}{PREDICTIVE_TOO}{why}"
    dead_end = both_refused(cfg, {"message": braking + "; no sub-range of it", "certifiable_range": None}, predictive)
    assert dead_end["message"].startswith("cannot certify wheel: the predictive filter")
    assert dead_end["message"].endswith(why) and braking not in dead_end["message"]
    assert dead_end["braking"].startswith("randomization.*.body_mass.pole over [0.7, 1.4]")
    way = {
        "message": braking + "; the largest sub-range that can be certified is [0.8, 1.2]",
        "certifiable_range": [0.8, 1.2],
    }
    kept = both_refused(cfg, way, predictive)
    assert kept["message"] == way["message"] and kept["predictive"] == predictive and "braking" not in kept
