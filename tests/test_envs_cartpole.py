"""CartPoleRail-v0: spaces, true-state cost, termination, braking authority, and the legacy LQR."""

import gymnasium as gym
import mujoco
import numpy as np
import pytest

import envs
from envs import cartpole_rail
from envs.legacy_cartpole import LQR_Q, LQR_R, discrete_lqr
from envs.linearization import linearize_control_step
from envs.safety import violated_constraints

ENV_ID = "sim2real/CartPoleRail-v0"


def test_registered_with_documented_spaces_and_length():
    env = gym.make(ENV_ID)
    assert env.spec.max_episode_steps == 500
    assert env.observation_space.shape == (5,) and env.observation_space.dtype == np.float32
    assert env.action_space == gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.float32 and info["cost"] == 0.0 and info["domain"] == {}
    # The documented layout: obs = [x, theta, x_dot, theta_dot, x_ref] from qpos/qvel.
    data = env.unwrapped.data
    np.testing.assert_array_equal(obs[:4], np.float32([data.qpos[0], data.qpos[1], data.qvel[0], data.qvel[1]]))
    assert gym.make(ENV_ID, max_episode_steps=7).spec.max_episode_steps == 7


def test_action_scales_to_max_force():
    env = gym.make(ENV_ID)
    env.reset(seed=1)
    env.step(np.float32([0.5]))
    data = env.unwrapped.data
    assert data.qfrc_actuator[0] == pytest.approx(0.5 * cartpole_rail.MAX_FORCE)  # N on the slider
    env.step(np.float32([7.0]))  # out-of-range actions are clipped to full scale
    assert data.qfrc_actuator[0] == pytest.approx(cartpole_rail.MAX_FORCE)


def test_cost_is_band_violation_of_true_state_and_matches_safety():
    # Heavy observation noise must not change the cost: it is computed from the true state.
    env = gym.make(ENV_ID, randomization={"obs_noise_std": 0.5}, max_episode_steps=200)
    obs, _ = env.reset(seed=3)
    data = env.unwrapped.data
    costs = []
    for t in range(150):
        obs, _, terminated, _, info = env.step(np.float32([1.0 if t < 60 else -1.0]))
        true_obs = env.unwrapped._obs()
        expected = 1.0 if violated_constraints(cartpole_rail.SAFETY, true_obs) else 0.0
        assert info["cost"] == expected == (1.0 if abs(data.qpos[0]) > cartpole_rail.X_SAFE else 0.0)
        costs.append(info["cost"])
        data.qpos[1] = data.qvel[1] = 0.0  # hold the pole up by hand so the cart can reach the stops
    assert max(costs) == 1.0, "full force toward a stop must leave the safe band"


def test_pole_fall_terminates_beyond_documented_limit():
    env = gym.make(ENV_ID)
    env.reset(seed=4)
    for _ in range(500):
        obs, _, terminated, truncated, _ = env.step(np.float32([0.0]))
        if terminated:
            break
    assert terminated and abs(obs[1]) > cartpole_rail.THETA_LIMIT


def test_full_reverse_force_stops_cart_from_terminal_speed_within_documented_distance():
    env = gym.make(ENV_ID)
    env.reset(seed=0)
    data, model = env.unwrapped.data, env.unwrapped.model
    data.qpos[:] = 0.0
    data.qvel[:] = [3.0, 0.0]  # the documented terminal speed, m/s
    mujoco.mj_forward(model, data)
    for _ in range(50):
        env.unwrapped.step(np.float32([-1.0]))
        if data.qvel[0] <= 0.0:
            break
    assert data.qvel[0] <= 0.0
    assert data.qpos[0] < 0.17  # documented worst-case stopping distance, m


def test_setpoint_stays_in_range_and_ramps_at_documented_speed():
    env = gym.make(ENV_ID)
    obs, _ = env.reset(seed=5)
    refs = [obs[4]]
    for _ in range(500):
        obs, *_ = env.step(np.float32([0.0]))
        refs.append(obs[4])
        env.unwrapped.data.qpos[1] = 0.0  # keep the pole up so the episode runs on
    refs = np.array(refs, dtype=np.float64)
    assert np.all(np.abs(refs) <= cartpole_rail.SETPOINT_RANGE + 1e-6)
    step = cartpole_rail.SETPOINT_SPEED * cartpole_rail.CONTROL_PERIOD
    assert np.max(np.abs(np.diff(refs))) <= step + 1e-6
    assert np.ptp(refs) > 0.5, "the set-point must move along the rail"


def test_nominal_model_maps_obs_to_state():
    nominal = cartpole_rail.nominal_model()
    assert nominal.substeps * nominal.model.opt.timestep == pytest.approx(cartpole_rail.CONTROL_PERIOD)
    env = gym.make(ENV_ID)
    obs, _ = env.reset(seed=6)
    data = env.unwrapped.data
    for i, (field, j) in nominal.obs_to_state.items():
        assert obs[i] == np.float32(getattr(data, field)[j])
    spec = envs.safety_spec(ENV_ID)
    assert spec["model"] == "linear" and spec["dt"] == 0.02 and spec["action_scale"] == [30.0]
    assert spec["kinematics"] == {"position_index": [0], "velocity_index": [2]}


def test_riccati_iteration_matches_scipy():
    linalg = pytest.importorskip("scipy.linalg")
    a, b = linearize_control_step(cartpole_rail.nominal_model())
    k = discrete_lqr(a, b, LQR_Q, LQR_R)
    p = linalg.solve_discrete_are(a, b, LQR_Q, LQR_R)
    k_ref = np.linalg.solve(LQR_R + b.T @ p @ b, b.T @ p @ a)
    np.testing.assert_allclose(k, k_ref, rtol=1e-6)
    assert np.all(np.abs(np.linalg.eigvals(a - b @ k)) < 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_legacy_lqr_keeps_pole_up_and_cart_in_band_for_1000_steps(seed):
    env = gym.make(ENV_ID, max_episode_steps=1000)
    controller = envs.legacy_controller(ENV_ID)
    controller.reset()
    obs, _ = env.reset(seed=seed)
    total, steps = 0.0, 0
    while True:
        action = controller(obs[None, :])
        assert action.shape == (1, 1) and action.dtype == np.float32
        obs, reward, terminated, truncated, info = env.step(action[0])
        assert info["cost"] == 0.0, f"left the safe band at step {steps}: x={obs[0]:.3f} m"
        total += reward
        steps += 1
        if terminated or truncated:
            break
    assert not terminated and steps == 1000
    assert total > 850.0  # 1000 alive steps with small tracking error


def test_legacy_lqr_is_batched_and_tracks_the_setpoint():
    controller = envs.legacy_controller(ENV_ID)
    obs = np.zeros((4, 5), np.float32)
    obs[1, 4] = 0.5  # set-point 0.5 m ahead ...
    obs[2, 0] = -0.5  # ... acts like the cart 0.5 m behind a set-point at 0
    obs[3, 1] = 0.1  # pole leaning toward +x
    act = controller(obs)
    assert act.shape == (4, 1) and act.dtype == np.float32
    assert act[0, 0] == 0.0  # at the set-point, upright, at rest: no force
    assert act[1, 0] == act[2, 0] != 0.0
    assert act[3, 0] > 0.0  # move the cart under the falling pole
    rows = np.concatenate([controller(o[None, :]) for o in obs])
    np.testing.assert_array_equal(rows, act)
