"""The assumption monitor flags a plant outside the envelope and is silent inside it.

- Quadrotor with every rotor at half gain (far outside reality's 0.88..1.05), flown by the
  legacy PID through the shield on MuJoCo: flagged within FLAG_WITHIN steps (0.8 s) of
  every episode, and while flagged the shield is in its conservative mode.
- Plants inside the envelope: the shield's own model with the input's effect at either end
  of 1 +- input_gain_error, a constant disturbance at the declared bound, any latency from
  0 to the spec's, and Gaussian observation noise at the declared std, driven by random
  actions: no flag in 10^5 steps (both tasks' specs together). The MuJoCo plants of
  `reality` and its corners are counted in bench/bench_safety.py (envelope flags column).
- With its bounds measured over the envelope (`pipeline.evaluation.monitor_bounds`): a quadrotor whose
  thrust/weight is 10 % below the envelope's lowest (0.72 against 0.80) is flagged within
  EDGE_FLAG_WITHIN steps and before its first violation; the model plants above, with the largest
  unmodelled acceleration the envelope showed, stay silent over 50,000 steps per task (the crane's and the
  Furuta pendulum's predictive specs among them); a steady force on the crane's or the Furuta pendulum's payload
  (the unactuated swing) UNACTUATED_RATIO times the bound is flagged within UNACTUATED_FLAG_WITHIN steps.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from shield.cbf import CbfShield
from tests.helpers.parallel import map_in_processes, process_pool
from tests.helpers.steady_push import force_accel, measured, steadily_pushed, synthesized

FLAG_WITHIN = 40  # steps (0.8 s at 50 Hz)
EDGE_FLAG_WITHIN = 50  # steps (1 s at 50 Hz), a plant 10 % past the envelope's edge


def test_quadrotor_with_rotors_at_half_gain_is_flagged_and_shield_turns_conservative():
    import envs

    cfg, spec = synthesized("quadrotor")
    half = {"actuator_gain": {f"rotor{i}": {"low": 0.5, "high": 0.5} for i in range(4)}}
    env = gym.make(cfg.task.env_id, randomization=half, max_episode_steps=FLAG_WITHIN + 10)
    shield, legacy = CbfShield(spec), envs.legacy_controller(cfg.task.env_id)
    normal_keep = shield._keep_normal
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        shield.reset()
        legacy.reset()
        flagged_at = None
        for t in range(FLAG_WITHIN):
            u, info = shield.filter(obs, legacy(obs[None])[0])
            if info["envelope"]:
                flagged_at = t
                assert shield._keep is shield._keep_conservative
                assert np.all(shield._keep > normal_keep)  # the gains are divided: a slower approach
                break
            obs, _, terminated, truncated, _ = env.step(u)
            assert not terminated
        assert flagged_at is not None, f"episode {seed}: not flagged within {FLAG_WITHIN} steps"
    env.close()


def _model_plant_steps(
    spec: dict,
    steps: int,
    rng: np.random.Generator,
    glitch_at: int | None = None,
    accel: list[float] | None = None,
    shadow: bool = False,
) -> int:
    """Run the shield on its own model at the envelope's edges; return the number of flagged steps.

    `glitch_at`: at that step of every episode one velocity reads 1e20 (a sensor glitch, finite); flags are
    then counted only from two monitor windows later, when the glitch has long left the window. `accel`: the
    constant additive acceleration per position (default the spec's `disturbance_accel`). `shadow`: the plant
    gets another action than the shield's (a legacy controller's, in shadow mode), and the shield is told so
    (`note_sent`), as `serve --mode shadow` does."""
    # The plant here is the linear model itself, continued far past upright (it is unstable): its angle is a
    # coordinate of that model, not a pole's that turns round, so the shield reads it unwrapped.
    shield = CbfShield({k: v for k, v in spec.items() if k != "angles"})
    s = shield.spec
    model = s.linear_model()
    A, B = model.A, model.B
    n = len(s.state_index)
    noise = np.asarray(s.assumptions["obs_noise_std"], np.float64)[s.state_index]
    cols = {o: j for j, o in enumerate(s.state_index)}
    flags, done, episode = 0, 0, 0
    while done < steps:
        gain = [1.0 - s.input_gain_error, 1.0 + s.input_gain_error, rng.uniform(0.9, 1.1)][episode % 3]
        w = rng.choice([-1.0, 1.0], len(s.position_index)) * np.asarray(s.disturbance_accel if accel is None else accel)
        latency = int(rng.integers(0, s.latency_steps + 1))
        c = model.offset(gain)  # the plant's drift at this gain (gravity compensation scales with it)
        x = np.concatenate([np.zeros(n), model.initial_internal(gain)])
        pending = [np.asarray(s.fallback_action, np.float64)] * latency
        shield.reset()
        obs = np.zeros(s.obs_dim, np.float32)
        for t in range(min(200, steps - done)):  # short: the cart-pole's linear model is unstable
            obs[s.state_index] = x[:n] + rng.normal(0.0, 1.0, n) * noise
            if t == glitch_at:
                obs[s.velocity_index[episode % len(s.velocity_index)]] = 1e20
            u, info = shield.filter(obs, rng.uniform(-1, 1, s.act_dim).astype(np.float32))
            flags += info["envelope"] and (glitch_at is None or t > glitch_at + 2 * shield._monitor._window)
            if shadow:
                u = rng.uniform(-1, 1, s.act_dim).astype(np.float32)
                shield.note_sent(u)
            pending.append(u.astype(np.float64))
            applied = pending.pop(0)
            x = A @ x + gain * (B @ applied) + c
            for k, (p, v) in enumerate(zip(s.position_index, s.velocity_index)):
                x[cols[p]] += 0.5 * w[k] * s.dt * s.dt
                x[cols[v]] += w[k] * s.dt
            done += 1
        episode += 1
    return flags


@pytest.mark.parametrize("task", ["cartpole", "quadrotor"])
def test_plants_inside_the_envelope_are_never_flagged(task):
    _, spec = synthesized(task)
    assert _model_plant_steps(spec, 50_000, np.random.default_rng(7)) == 0


@pytest.mark.parametrize("task", ["cartpole", "quadrotor"])
def test_a_plant_inside_the_envelope_driven_by_another_controller_is_never_flagged(task):
    """Shadow mode: the plant applies the legacy action and the shield is told (`note_sent`). The monitor's
    velocities had been predicted with the shield's own action at every latency, those applying it at once too:
    helper-49's slewing crane, inside its envelope, was flagged from step 1 on and parked in conservative mode."""
    _, spec = synthesized(task)
    assert _model_plant_steps(spec, 20_000, np.random.default_rng(5), shadow=True) == 0


@pytest.mark.parametrize("task", ["cartpole", "quadrotor"])
def test_one_glitched_reading_is_forgotten_once_it_leaves_the_window(task):
    """The monitor keeps running sums over its window: one finite but huge reading (1e20) used to swallow the
    small terms added beside it, and the sums stayed wrong for good (flagged on 482 of 490 later steps)."""
    _, spec = synthesized(task)
    assert _model_plant_steps(spec, 4_000, np.random.default_rng(11), glitch_at=20) == 0


def test_a_quadrotor_ten_percent_past_the_envelope_is_flagged_before_it_violates():
    """Thrust/weight 0.72 (mass 1.1 x, rotors 0.792 x) where the envelope's lowest is 0.80: the monitor with the
    shipped bounds never flagged such a plant; with measured ones it does within EDGE_FLAG_WITHIN steps."""
    import envs

    cfg, _ = synthesized("quadrotor")
    spec = measured("quadrotor")[1]
    lowest = min(
        min(r.low for r in rset.actuator_gain.values()) / rset.body_mass["quad"].high
        for rset in cfg.randomization.values()
    )
    assert lowest == pytest.approx(0.8) and 0.792 / 1.1 == pytest.approx(0.9 * lowest)
    weak = {
        "body_mass": {"quad": {"low": 1.1, "high": 1.1}},
        "actuator_gain": {f"rotor{i}": {"low": 0.792, "high": 0.792} for i in range(4)},
        "latency_steps": {"low": 2, "high": 2},
    }
    env = gym.make(cfg.task.env_id, randomization=weak, max_episode_steps=200)
    shield, legacy = CbfShield(spec), envs.legacy_controller(cfg.task.env_id)
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        shield.reset()
        legacy.reset()
        flagged_at = violated_at = None
        for t in range(200):
            u, info = shield.filter(obs, legacy(obs[None])[0])
            if info["envelope"] and flagged_at is None:
                flagged_at = t
            obs, _, terminated, truncated, step_info = env.step(u)
            if step_info["cost"] > 0 and violated_at is None:
                violated_at = t
            if flagged_at is not None or terminated or truncated:
                break
        assert flagged_at is not None and flagged_at <= EDGE_FLAG_WITHIN, f"episode {seed}: flagged at {flagged_at}"
        assert violated_at is None, f"episode {seed}: violated at {violated_at}, before the flag"
    env.close()


def _flags_at_the_measured_bound(job: tuple[dict, int, int]) -> int:
    spec, steps, seed = job
    measured_accel = spec["assumptions"]["monitor"]["measured"]["excess_accel"]
    return _model_plant_steps(spec, steps, np.random.default_rng(seed), accel=measured_accel)


@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "crane", "furuta"])
def test_measured_bounds_stay_silent_inside_the_envelope(task):
    """The model plants of `test_plants_inside_the_envelope_are_never_flagged`, now pushed by the largest
    unmodelled acceleration the MuJoCo plants of the envelope showed (the measured bound less its margin): 50,000
    steps per task. The predictive plants (crane, Furuta) are covered here only: the spec's `disturbance_accel`,
    held constant, is more than the crane's drive can hold (13.3 against 11.6 m/s^2), and its linear model runs
    off to where it says nothing (the trolley 40 m out, the swing 2.6 rad)."""
    spec = measured(task)[1]
    with process_pool() as pool:
        jobs = [(spec, 25_000, seed) for seed in (5, 6)]
        assert sum(map_in_processes(pool, _flags_at_the_measured_bound, jobs, chunksize=1)) == 0


def test_past_the_edge_the_flagged_shield_is_no_worse_than_the_legacy_controller_alone():
    """Thrust/weight 0.76, past the envelope's 0.80 but with authority left to hold the floor: the legacy PID alone
    crosses it; shielded with measured bounds (flagged, conservative), neither it nor the adversary does more."""
    from envs.randomization import parse_randomization
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.evaluate import evaluate
    from shield.spec import ShieldSpec

    cfg, _ = synthesized("quadrotor")
    spec = ShieldSpec.from_dict(measured("quadrotor")[1])
    g = 0.76 * 1.1
    reality = cfg.randomization["reality"]
    weak = parse_randomization(
        {
            "body_mass": {"quad": {"low": 1.1, "high": 1.1}},
            "actuator_gain": {f"rotor{i}": {"low": g, "high": g} for i in range(4)},
            "latency_steps": {"low": 0, "high": 2},
            "obs_noise_std": reality.obs_noise_std,
            "action_noise_std": reality.action_noise_std,
        }
    )
    run = dict(domains=weak, seed=0, episodes=2, max_episode_steps=500)
    alone = evaluate(cfg, reference_policy("legacy", cfg, spec), shield=False, **run)
    for name in ("legacy", "adversarial"):
        shielded = evaluate(cfg, reference_policy(name, cfg, spec, seed=0), shield=True, spec=spec, **run)
        assert shielded["envelope_rate"] > 0  # the monitor saw it
        assert shielded["violations"] <= alone["violations"], name


UNACTUATED_RATIO = 6.0  # a steady force's acceleration on some velocity, in multiples of the monitor's `accel` there
UNACTUATED_FLAG_WITHIN = 20  # steps (0.4 s at 50 Hz)


@pytest.mark.parametrize("task,force,axes", [("crane", 80.0, ["x"]), ("furuta", 12.0, ["x", "y"])])
def test_a_steady_force_on_the_unactuated_payload_is_flagged_before_it_violates(task, force, axes):
    """A steady force on the payload, which only the unactuated swing feels first, drawn per episode up to `force`:
    wherever its acceleration (MuJoCo's M^-1 J^T f) reaches UNACTUATED_RATIO times the measured bound on some
    velocity, the legacy controller through the shield is flagged within UNACTUATED_FLAG_WITHIN steps and no later
    than its first violation. Before the bounds' tail was taken over the runs' needs (not the hull's slack) the
    crane's swing bound was 3.9 rad/s^2 and a force of 80 N on its 8 kg payload (12.5 rad/s^2) went unflagged for
    whole episodes."""
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.evaluate import make_env, resolve_domains

    cfg, spec_dict = measured(task)
    shield = CbfShield(spec_dict)
    accel = np.asarray(spec_dict["assumptions"]["monitor"]["accel"])
    policy = reference_policy("legacy", cfg, shield.spec)
    env = make_env(cfg, resolve_domains(cfg, steadily_pushed(cfg, "payload", force, axes)), None)
    far_outside = 0
    for seed in range(10):
        obs, _ = env.reset(seed=seed)
        shield.reset()
        if hasattr(policy, "reset"):
            policy.reset()
        flagged_at = violated_at = None
        ratio = np.inf  # the force is drawn at the first step
        for t in range(UNACTUATED_FLAG_WITHIN + 1):
            u, info = shield.filter(obs, policy(np.asarray(obs, np.float32)[None])[0])
            if info["envelope"]:
                flagged_at = t
                break
            obs, _, terminated, truncated, step_info = env.step(u)
            if t == 0:
                ratio = float(np.max(np.abs(force_accel(env, cfg, shield.spec, "payload")) / accel))
            if step_info["cost"] > 0 and violated_at is None:
                violated_at = t
            if terminated or truncated:
                break
        if ratio < UNACTUATED_RATIO:
            continue
        far_outside += 1
        assert flagged_at is not None, f"episode {seed}: {ratio:.1f} x the bound, not flagged"
        assert violated_at is None, f"episode {seed}: violated at {violated_at}, flagged at {flagged_at}"
    env.close()
    assert far_outside >= 4


LATE_BY = 2  # steps of latency past the spec's longest
LATE_FLAG_WITHIN = 20  # steps (0.4 s at 50 Hz)


def _late_plant_run(
    cfg, spec_dict: dict, policy_name: str, episodes: int, shielded: bool = True
) -> list[tuple[int | None, int]]:
    """Per episode of reality's plants answering each action LATE_BY steps past the spec's latency, driven by
    `policy_name` through the shield (`shielded`; else its own actions, the shield only watching): (the first
    flagged step or None, violating steps)."""
    from envs.randomization import parse_randomization
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.evaluate import make_env, resolve_domains

    shield = CbfShield(spec_dict)
    late = shield.spec.latency_steps + LATE_BY
    reality = cfg.randomization["reality"]
    domain = {
        "latency_steps": {"low": late, "high": late},
        "obs_noise_std": reality.obs_noise_std,
        "action_noise_std": reality.action_noise_std,
    }
    env = make_env(cfg, resolve_domains(cfg, parse_randomization(domain)), None)
    policy = reference_policy(policy_name, cfg, shield.spec, seed=1)
    out = []
    for seed in range(episodes):
        obs, _ = env.reset(seed=seed)
        shield.reset()
        if hasattr(policy, "reset"):
            policy.reset()
        flagged_at, violating = None, 0
        for t in range(200):
            action = policy(np.asarray(obs, np.float32)[None])[0]
            u, info = shield.filter(obs, action)
            u = u if shielded else action
            if info["envelope"] and flagged_at is None:
                flagged_at = t
            obs, _, terminated, truncated, step_info = env.step(u)
            violating += step_info["cost"] > 0
            if terminated or truncated:
                break
        out.append((flagged_at, violating))
    env.close()
    return out


@pytest.fixture(scope="module")
def late_legacy_alone() -> list[tuple[int | None, int]]:
    """The legacy controller alone on the late plant, the baseline both policies below are held to."""
    cfg, spec_dict = measured("ball_beam")
    return _late_plant_run(cfg, spec_dict, "legacy", 5, shielded=False)


@pytest.mark.parametrize("policy_name", ["random", "bang_bang"])
def test_a_plant_answering_actions_late_is_flagged(policy_name, late_legacy_alone):
    """A ball on a beam whose actions arrive LATE_BY steps later than the spec's longest latency: its residuals
    change sign with the actions, so the windowed signed sum (the first test) never flagged it in 200 steps. The
    second test, each latency a hypothesis of its own, flags every episode within LATE_FLAG_WITHIN steps, and the
    flag costs little: the predictive filter widens its tube only for the first test's flag. The plant is outside
    the envelope, where nothing is certified; what the issue asks there is no worse than the legacy controller
    alone, which this plant's lateness drives through the beam's limit on 84-157 of 200 steps. Behind the shield a
    bang-bang policy crosses it on 1 step of 1,000 (0.0015 rad past, the backup ringing at a latency it was not
    built for) since the tube is fitted at the edge of the admitted states: at most 2 of an episode's 200 steps,
    and fewer than the legacy controller alone on the same episode."""
    cfg, spec_dict = measured("ball_beam")
    flagged = _late_plant_run(cfg, spec_dict, policy_name, 5)
    for seed, ((at, violating), (_, legacy_violating)) in enumerate(zip(flagged, late_legacy_alone)):
        assert at is not None and at <= LATE_FLAG_WITHIN, f"episode {seed}: flagged at {at}"
        assert violating <= 2 and violating < legacy_violating, f"episode {seed}: {violating} violating steps"
    first_only = {**spec_dict, "assumptions": {**spec_dict["assumptions"]}}
    first_only["assumptions"]["monitor"] = {
        k: v for k, v in spec_dict["assumptions"]["monitor"].items() if k != "dist_accel"
    }
    assert all(at is None for at, _ in _late_plant_run(cfg, first_only, policy_name, 5))
