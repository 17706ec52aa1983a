"""CartPoleRail-v0, declared as data (configs/cartpole.yaml + configs/cartpole_rail.xml): spaces, true-state
cost, termination, braking authority, the legacy LQR, and bit-identity with the code env it replaced."""

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import mujoco
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs.linearization import discrete_lqr, linearize_control_step, unreachable_modes
from envs.safety import violated_constraints
from envs.tasks import read_declaration
from tests.helpers.repo_files import files_naming, tracked_files

REPO = Path(__file__).resolve().parents[2]
ENV_ID = "sim2real/CartPoleRail-v0"
PLANT = read_declaration(REPO / "configs" / "cartpole.yaml")[1]  # the declaration: the task's numbers live there
RAIL = PLANT.targets["rail"]
X_SAFE = PLANT.constraints[0].high[0]  # m, the safe band's half-width
THETA_LIMIT = PLANT.termination[0].abs_above  # rad
MAX_FORCE = PLANT.actuators[0].units_per_action  # N per unit action


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
    assert MAX_FORCE == 30.0 and data.qfrc_actuator[0] == pytest.approx(0.5 * MAX_FORCE)  # N on the slider
    env.step(np.float32([7.0]))  # out-of-range actions are clipped to full scale
    assert data.qfrc_actuator[0] == pytest.approx(MAX_FORCE)


def test_cost_is_band_violation_of_true_state_and_matches_safety():
    # Heavy observation noise must not change the cost: it is computed from the true state.
    env = gym.make(ENV_ID, randomization={"obs_noise_std": 0.5}, max_episode_steps=200)
    obs, _ = env.reset(seed=3)
    data = env.unwrapped.data
    costs = []
    for t in range(150):
        obs, _, terminated, _, info = env.step(np.float32([1.0 if t < 60 else -1.0]))
        true_obs = env.unwrapped._obs()
        expected = 1.0 if violated_constraints(envs.task(ENV_ID).safety, true_obs) else 0.0
        assert info["cost"] == expected == (1.0 if abs(data.qpos[0]) > X_SAFE else 0.0)
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
    assert terminated and THETA_LIMIT == 0.6 and abs(obs[1]) > THETA_LIMIT


def test_a_simulation_that_blew_up_ends_the_episode_though_mujoco_reset_it_to_a_finite_state():
    env = gym.make(ENV_ID)
    env.reset(seed=0)
    for _ in range(5):
        *_, terminated, _, info = env.step(np.float32([0.3]))
        assert not terminated and "diverged" not in info
    # A velocity past MuJoCo's limit: mj_step resets the simulation to qpos0 (finite, upright, at rest) and goes on.
    env.unwrapped.data.qvel[1] = 1e11
    obs, _, terminated, _, info = env.step(np.float32([0.3]))
    assert np.all(np.isfinite(obs)) and abs(obs[1]) < THETA_LIMIT  # nothing in the state itself says so
    assert terminated and info["diverged"]
    env.reset(seed=1)  # a new episode starts clean
    *_, terminated, _, info = env.step(np.float32([0.3]))
    assert not terminated and "diverged" not in info


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
    assert np.all(np.abs(refs) <= RAIL.high[0] + 1e-6) and RAIL.low[0] == -RAIL.high[0] == -0.85
    step = RAIL.speed * PLANT.control_period
    assert np.max(np.abs(np.diff(refs))) <= step + 1e-6
    assert np.ptp(refs) > 0.5, "the set-point must move along the rail"


def test_nominal_model_maps_obs_to_state():
    nominal = envs.nominal_model(ENV_ID)
    assert nominal.substeps * nominal.model.opt.timestep == pytest.approx(PLANT.control_period)
    env = gym.make(ENV_ID)
    obs, _ = env.reset(seed=6)
    data = env.unwrapped.data
    for i, (field, j) in nominal.obs_to_state.items():
        assert obs[i] == np.float32(getattr(data, field)[j])
    spec = envs.safety_spec(ENV_ID)
    assert spec["model"] == "linear" and spec["dt"] == 0.02 and spec["action_scale"] == [30.0]
    assert spec["kinematics"] == {"position_index": [0], "velocity_index": [2]}


# The declared LQR's gain, the Riccati solution to round-off. A value from LAPACK is compared to a tolerance, never
# bit for bit: numpy's OpenBLAS picks its kernels by CPU at run time. 1e-9 relative is far below anything a controller
# feels and still tells the solution from a fixed-point iteration stopped at its tolerance (1.5e-9 off here).
LQR_GAIN = [[-2.820116138787069, -10.15507949589389, -2.7456189124130677, -2.5575941948879404]]
LQR_RTOL = 1e-9


def _riccati_by_iteration(a, b, q, r):
    """The Riccati fixed point by plain iteration (numpy.linalg only), run to round-off: an independent kernel path."""
    p = q.copy()
    for _ in range(200_000):
        k = np.linalg.solve(r + b.T @ p @ b, b.T @ p @ a)
        p_next = q + a.T @ p @ (a - b @ k)
        p_next = 0.5 * (p_next + p_next.T)
        if np.max(np.abs(p_next - p)) <= 1e-15 * np.max(np.abs(p)):
            return p_next
        p = p_next
    return p


def _gain_with_generic_blas_kernels() -> np.ndarray:
    """The declared LQR's gain in a process whose OpenBLAS runs its generic kernels, as on another CPU.

    OpenBLAS picks kernels by CPU at run time; OPENBLAS_CORETYPE names one instead (in that process alone).
    """
    coretype = {"x86_64": "Prescott", "AMD64": "Prescott", "aarch64": "ARMV8", "arm64": "ARMV8"}.get(platform.machine())
    if coretype is None:
        pytest.skip(f"no generic OpenBLAS kernel known for {platform.machine()}")
    script = f"import envs, json; print(json.dumps(envs.legacy_controller({ENV_ID!r}).gain.tolist()))"
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "OPENBLAS_CORETYPE": coretype},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return np.array(json.loads(out.stdout.strip().splitlines()[-1]))


def test_lqr_gain_agrees_across_blas_threads_and_linear_algebra_paths():
    linalg = pytest.importorskip("scipy.linalg")
    threadpoolctl = pytest.importorskip("threadpoolctl")
    a, b = linearize_control_step(envs.nominal_model(ENV_ID))
    q, r = np.diag(PLANT.legacy.q), np.diag(PLANT.legacy.r)
    gains = {"default": discrete_lqr(a, b, q, r)}
    for threads in (1, 2):
        with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
            gains[f"blas threads {threads}"] = discrete_lqr(a, b, q, r)
    p = linalg.solve_discrete_are(a, b, q, r)
    gains["scipy.linalg.solve"] = linalg.solve(r + b.T @ p @ b, b.T @ p @ a)
    p_iter = _riccati_by_iteration(a, b, q, r)
    gains["numpy fixed point"] = np.linalg.solve(r + b.T @ p_iter @ b, b.T @ p_iter @ a)
    gains["declared LQR"] = envs.legacy_controller(ENV_ID).gain  # the legacy controller is this design
    gains["OpenBLAS generic kernels"] = _gain_with_generic_blas_kernels()
    for path, k in gains.items():
        np.testing.assert_allclose(k, LQR_GAIN, rtol=LQR_RTOL, err_msg=path)
    # P solves the Riccati equation to round-off, and the gain stabilizes the linearized plant.
    k = gains["default"]
    residual = q + a.T @ p @ (a - b @ k) - p
    assert np.max(np.abs(residual)) <= 1e-12 * np.max(np.abs(p))
    assert np.all(np.abs(np.linalg.eigvals(a - b @ k)) < 1.0)


def test_an_lqr_that_cannot_stabilize_the_plant_is_refused_naming_the_mode_no_input_reaches():
    a = np.array([[1.1, 0.0], [0.0, 0.5]])  # an unstable mode ...
    b = np.array([[0.0], [1.0]])  # ... that the input cannot reach
    with pytest.raises(ValueError, match=r"no input reaches the mode of theta \(eigenvalue 1\.1\)"):
        discrete_lqr(a, b, np.eye(2), np.eye(1), ["theta", "omega"])
    # A hovercraft's one thrust along a 45-degree heading: x and y move only together, x - y never.
    dt = 0.02
    a = np.block([[np.eye(2), dt * np.eye(2)], [np.zeros((2, 2)), 0.98 * np.eye(2)]])
    b = np.array([[0.0], [0.0], [0.07], [0.07]])
    with pytest.raises(ValueError, match=r"no input reaches the mode of x, y, vx, vy \(eigenvalue 1\)"):
        discrete_lqr(a, b, np.eye(4), np.eye(1), ["x", "y", "vx", "vy"])
    b = np.array([[0.0, 0.0], [0.0, 0.0], [0.07, 0.0], [0.07, 0.05]])  # and a lateral thruster: every mode reached
    assert unreachable_modes(a, b) == []
    assert np.all(np.abs(np.linalg.eigvals(a - b @ discrete_lqr(a, b, np.eye(4), np.eye(2)))) < 1.0)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_a_plant_every_state_of_which_an_input_drives_has_no_unreachable_mode(n, seed):
    """An input per state (B square and well conditioned): whatever A is, no mode is out of reach."""
    rng = np.random.default_rng(seed)
    a = rng.normal(0.0, 1.0, (n, n))
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    b = q @ np.diag(rng.uniform(0.1, 2.0, n))
    assert unreachable_modes(a, b) == []


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


def test_registered_from_its_declaration_with_the_code_tasks_settings():
    spec = envs.task(ENV_ID)
    assert spec.declared and spec.config_path == REPO / "configs" / "cartpole.yaml"
    assert spec.steerable_setpoint == 4 and spec.legacy_name == "lqr" and spec.action_scale == [30.0]
    assert spec.safety == {
        "kinematics": {"position_index": [0], "velocity_index": [2]},
        "constraints": [{"name": "rail_band", "type": "box", "index": [0], "low": [-1.0], "high": [1.0]}],
    }
    nominal = envs.nominal_model(ENV_ID)
    assert nominal.obs_to_state == {0: ("qpos", 0), 1: ("qpos", 1), 2: ("qvel", 0), 3: ("qvel", 1)}
    assert not nominal.qpos.any() and not nominal.qvel.any() and nominal.substeps == 4


def test_no_python_names_the_cartpole():
    """The cart-pole is data: no module of its own, and no project file outside configs/ knows its code names."""
    modules = [
        rel
        for rel in tracked_files()
        if "cartpole" in Path(rel).name.lower() and not rel.startswith(("configs/", "tests/"))
    ]
    assert not modules, modules
    offenders = files_naming(("cartpole_rail", "legacy_cartpole", "CartPoleLqr", "CartPoleRailEnv"))
    assert not offenders, offenders


# -- bit-identity with the code env the declaration replaced --------------------------------------------
#
# Recorded from the code env (envs/cartpole_rail.py and envs/legacy_cartpole.py at commit 4d920dc, MuJoCo
# 4.0.0, numpy 2.4.6) just before the cart-pole became a declaration; the declaration reproduced every
# value bit for bit then (and a side-by-side run: 20 seeds x 500 steps x {nominal, train, validation,
# reality} x {random actions, the LQR, the LQR steered past the band}). A MuJoCo or numpy upgrade may
# move the physics' last bits: re-record only after checking the old code env (git show 4d920dc) agrees.

# Sets the shipped config has changed since the recording, as they were then (the env is what is compared).
RECORDED_SETS = {
    "train": {"push": {"body": "pole", "max_force": 0.5, "probability": 0.01, "duration_steps": 5, "axes": ["x"]}}
}


def _as_recorded(name: str | None):
    """The randomization set `name` of the shipped config as it was when the digests were recorded."""
    if name not in RECORDED_SETS:
        return name
    from pipeline.config import load_config

    rset = load_config(Path(__file__).resolve().parents[2] / "configs" / "cartpole.yaml").randomization[name]
    return {**rset.model_dump(mode="json"), **RECORDED_SETS[name]}


# The LQR gain the digests were recorded with. The digests check the env's physics, so the controller
# that drives them carries this gain as data: a solved gain differs in its last bits between LAPACK
# builds and CPUs, and one float32 action rounding the other way changes every byte after it.
RECORDED_LQR_GAIN = [[-2.8201161346908807, -10.155079488988148, -2.745618909850008, -2.5575941930883377]]


def _digest(randomization, policy: str, seeds=(0, 1, 2), steps: int = 300) -> str:
    """sha256 over reset observations and domains, then every step's action, obs, reward, flags and cost."""
    h = hashlib.sha256()
    lqr = envs.legacy_controller(ENV_ID)
    np.testing.assert_allclose(lqr.gain, RECORDED_LQR_GAIN, rtol=1e-8)  # the same design (another solver)
    lqr.gain = np.array(RECORDED_LQR_GAIN)
    for seed in seeds:
        env = gym.make(ENV_ID, randomization=_as_recorded(randomization))
        obs, info = env.reset(seed=seed)
        h.update(obs.tobytes() + repr(sorted(info["domain"].items())).encode() + np.float64(info["cost"]).tobytes())
        rng = np.random.default_rng(1000 + seed)
        for _ in range(steps):
            action = rng.uniform(-1.2, 1.2, 1).astype(np.float32) if policy == "random" else lqr(obs[None])[0]
            obs, reward, terminated, truncated, info = env.step(action)
            h.update(
                obs.tobytes()
                + np.float64(reward).tobytes()
                + bytes([terminated, truncated])
                + np.float64(info["cost"]).tobytes()
                + np.float32(action).tobytes()
            )
            if terminated or truncated:
                obs, info = env.reset()
                h.update(obs.tobytes())
        env.close()
    return h.hexdigest()


CODE_ENV_DIGESTS = {
    (None, "random"): "b638d88b6c98cae0f2e2862d80eee441ffd3cfca5a73d842e8e0aadb25e68fcd",
    (None, "lqr"): "0903137f678eca1aa5938f2448dc51693660c311342a0f96e07900451fcdc593",
    ("train", "random"): "078da7b7c865c882db42a3c398cfb4b13ef042e236bbfb017be0ca68f7073320",
    ("validation", "random"): "50201388f36c2a7a3f36713a49fb70564dde80896d9bccef02803715a8141162",
    ("reality", "random"): "b84304d9d4906342a00cc055fb39e4b333aae2c86adbde0bd7c168d690dc7c97",
    ("reality", "lqr"): "8bdd5e23d9eb872431d911fe20acd50369a42710e52d224455ee66709360dd90",
}


@pytest.mark.parametrize("randomization,policy", list(CODE_ENV_DIGESTS))
def test_trajectories_are_bit_identical_to_the_code_env(randomization, policy):
    assert _digest(randomization, policy) == CODE_ENV_DIGESTS[(randomization, policy)]


def test_first_steps_and_lqr_gain_are_the_code_envs_values():
    env = gym.make(ENV_ID)
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    rewards = []
    for _ in range(25):
        obs, reward, *_ = env.step(rng.uniform(-1.0, 1.0, 1).astype(np.float32))
        rewards.append(reward)
    # MuJoCo's arithmetic is the project's promise of identity for a seed: bit for bit.
    assert obs.tolist() == [0.042978640645742416, -0.12703949213027954, -0.10394185036420822, -0.4256168007850647, 0.25]
    assert rewards[-1] == 0.895956770468693 and sum(rewards) == 23.862606065147304
    # The gain goes through LAPACK, whose last bits follow the CPU: equal to the Riccati solution's round-off.
    np.testing.assert_allclose(envs.legacy_controller(ENV_ID).gain, LQR_GAIN, rtol=LQR_RTOL)
