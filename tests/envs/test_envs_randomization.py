"""Domain randomization: determinism, ranges, no drift, exact latency, validation, any MuJoCo env by name."""

import copy

import gymnasium as gym
import mujoco
import numpy as np
import pytest

import envs
from envs.randomization import (
    SCALE_GROUPS,
    RandomizationError,
    RandomizationSet,
    load_randomization_sets,
    parse_randomization,
    sample_domain,
)

CARTPOLE = "sim2real/CartPoleRail-v0"
QUADROTOR = "sim2real/QuadrotorGeofence-v0"
TASKS = [CARTPOLE, QUADROTOR]


def _rollout(env, seed, steps=1000):
    """Observations over `steps` steps of seeded random actions, continuing across resets."""
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    out, domains = [obs], [info["domain"]]
    for _ in range(steps):
        action = rng.uniform(-1, 1, env.action_space.shape).astype(np.float32)
        obs, _, terminated, truncated, _ = env.step(action)
        out.append(obs)
        if terminated or truncated:
            obs, info = env.reset()
            out.append(obs)
            domains.append(info["domain"])
    return np.stack(out), domains


def _train_set(env_id):
    return load_randomization_sets(envs.task_config_path(env_id))["train"]


@pytest.mark.parametrize("env_id", TASKS)
def test_train_set_has_latency_and_noise(env_id):
    rset = _train_set(env_id)
    assert rset.latency_steps is not None and rset.latency_steps.high >= 1
    assert any(rset.obs_noise_std) and any(rset.action_noise_std)
    reality = load_randomization_sets(envs.task_config_path(env_id))["reality"]
    assert reality.latency_steps is not None and reality.latency_steps.high >= 1  # held-out plants are late too


@pytest.mark.parametrize("env_id", TASKS)
def test_same_seed_gives_bitwise_identical_observations(env_id):
    a, domains_a = _rollout(gym.make(env_id, randomization="train"), seed=11)
    b, domains_b = _rollout(gym.make(env_id, randomization="train"), seed=11)
    assert len(a) > 1000
    assert a.tobytes() == b.tobytes()
    assert domains_a == domains_b
    c, domains_c = _rollout(gym.make(env_id, randomization="train"), seed=12, steps=50)
    assert domains_c[0] != domains_a[0]


@pytest.mark.parametrize("env_id", TASKS)
def test_sampled_parameters_differ_by_seed_and_stay_in_range(env_id):
    rset = _train_set(env_id)
    env = gym.make(env_id, randomization="train")
    seen = []
    for seed in range(20):
        _, info = env.reset(seed=seed)
        domain = info["domain"]
        assert all(isinstance(v, float) for v in domain.values())
        for group in SCALE_GROUPS:
            for name, rng in getattr(rset, group).items():
                assert rng.low <= domain[f"{group}.{name}"] <= rng.high
        if rset.latency_steps is not None:
            assert rset.latency_steps.low <= domain["latency_steps"] <= rset.latency_steps.high
            assert domain["latency_steps"].is_integer()
        seen.append(tuple(domain.values()))
    assert len(set(seen)) == 20
    # The live model carries the sampled values.
    model = env.unwrapped.model
    for name, scale in ((k.split(".", 1)[1], v) for k, v in domain.items() if k.startswith("body_mass.")):
        pristine = gym.make(env_id).unwrapped.model  # a fresh, unrandomized plant
        bid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, name)
        assert model.body_mass[bid] == pytest.approx(pristine.body_mass[bid] * scale)


def _model_arrays(model):
    arrays = {}
    for name in dir(model):
        if name.startswith("_"):
            continue
        value = getattr(model, name)
        if isinstance(value, np.ndarray):
            arrays[name] = value.copy()
    for name in dir(model.opt):
        value = getattr(model.opt, name)
        if isinstance(value, (np.ndarray, float, int)) and not name.startswith("_"):
            arrays[f"opt.{name}"] = np.array(value, copy=True)
    return arrays


@pytest.mark.parametrize("env_id", TASKS)
def test_nominal_model_unchanged_after_100_randomized_resets(env_id):
    env = gym.make(env_id, randomization="train")
    pristine = _model_arrays(env.unwrapped.model)
    wrapper = env
    while not hasattr(wrapper, "randomizer"):
        wrapper = wrapper.env
    nominal_copies = copy.deepcopy(wrapper.randomizer.nominal)
    for seed in range(100):
        env.reset(seed=seed)
        env.step(env.action_space.sample())
    assert _model_arrays(env.unwrapped.model)["body_mass"].tobytes() != pristine["body_mass"].tobytes()
    for key, value in nominal_copies.items():
        assert wrapper.randomizer.nominal[key].tobytes() == value.tobytes(), key
    wrapper.randomizer.apply({})  # back to nominal: every model array must equal the pristine one
    after = _model_arrays(env.unwrapped.model)
    changed = [k for k in pristine if pristine[k].tobytes() != after[k].tobytes()]
    assert changed == []


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_latency_delays_applied_control_by_exactly_the_sampled_steps(delay):
    rset = {"latency_steps": {"low": delay, "high": delay}}
    env = gym.make(CARTPOLE, randomization=rset)
    _, info = env.reset(seed=0)
    assert info["domain"]["latency_steps"] == float(delay)
    rng = np.random.default_rng(0)
    commanded, applied = [], []
    data = env.unwrapped.data
    for _ in range(30):
        action = rng.uniform(-0.2, 0.2, 1).astype(np.float32)
        commanded.append(float(action[0]))
        env.step(action)
        applied.append(float(data.ctrl[0]))
        data.qpos[1] = data.qvel[1] = 0.0  # keep the pole up so the episode runs on
    expected = [0.0] * delay + commanded[: len(commanded) - delay]
    assert applied == expected


def test_sampled_latency_varies_and_is_applied():
    env = gym.make(CARTPOLE, randomization={"latency_steps": {"low": 0, "high": 2}})
    delays = set()
    for seed in range(12):
        _, info = env.reset(seed=seed)
        delay = int(info["domain"]["latency_steps"])
        delays.add(delay)
        data = env.unwrapped.data
        applied = []
        for t in range(4):
            env.step(np.float32([0.1 * (t + 1)]))
            applied.append(round(float(data.ctrl[0]), 6))
        assert applied == ([0.0] * delay + [0.1, 0.2, 0.3, 0.4])[:4]
    assert delays == {0, 1, 2}


@pytest.mark.parametrize(
    ("raw", "path", "words"),
    [
        ({"body_mass": {"cart": {"low": 1.2, "high": 0.8}}}, "randomization.train.body_mass.cart.high", "low"),
        (
            {"body_mass": {"cart": {"low": -1.0, "high": 1.2}}},
            "randomization.train.body_mass.cart.low",
            "greater than 0",
        ),
        (
            {"joint_damping": {"hinge": {"dist": "loguniform", "low": 0.0, "high": 2.0}}},
            "randomization.train.joint_damping.hinge.low",
            "greater than 0",
        ),
        ({"body_mas": {"cart": {"low": 0.8, "high": 1.2}}}, "randomization.train.body_mas", "Extra inputs"),
        (
            {"body_mass": {"cart": {"low": 0.8, "high": 1.2, "mean": 1}}},
            "randomization.train.body_mass.cart.mean",
            "Extra",
        ),
        (
            {"body_mass": {"cart": {"dist": "normal", "low": 0.8, "high": 1.2}}},
            "randomization.train.body_mass.cart.dist",
            "uniform",
        ),
        ({"latency_steps": {"low": 3, "high": 1}}, "randomization.train.latency_steps.high", "low"),
        ({"obs_noise_std": [0.1, -0.1]}, "randomization.train.obs_noise_std.1", "greater than or equal"),
    ],
)
def test_bad_values_are_rejected_with_the_key_path(raw, path, words):
    with pytest.raises(RandomizationError) as err:
        parse_randomization(raw, "randomization.train")
    assert path in str(err.value) and words in str(err.value)


def test_bad_set_in_task_yaml_names_the_key_at_make(tmp_path, monkeypatch):
    # The code task's YAML is looked up in $SIM2REAL_CONFIG_DIR when a set is asked for (a declared
    # task's is the file that declares it).
    quadrotor = "sim2real/QuadrotorGeofence-v0"
    (tmp_path / "quadrotor.yaml").write_text(
        "randomization:\n  train:\n    body_mass:\n      quad: {dist: uniform, low: 1.5, high: 1.1}\n"
    )
    monkeypatch.setenv("SIM2REAL_CONFIG_DIR", str(tmp_path))
    with pytest.raises(RandomizationError, match=r"randomization\.train\.body_mass\.quad\.high"):
        gym.make(quadrotor, randomization="train")
    (tmp_path / "quadrotor.yaml").write_text("randomization:\n  train: {gravity_scale: {low: 0.9, high: 1}}\n")
    with pytest.raises(RandomizationError, match="'reality' is not in"):
        gym.make(quadrotor, randomization="reality")


def test_unknown_element_in_a_task_is_an_error_naming_it():
    with pytest.raises(RandomizationError, match="no joint named 'slidr'.*slider"):
        gym.make(CARTPOLE, randomization={"joint_damping": {"slidr": {"low": 0.5, "high": 2}}})


CHEETAH_SET = {
    "body_mass": {"torso": {"low": 0.8, "high": 1.2}, "bthigh": {"dist": "loguniform", "low": 0.5, "high": 2.0}},
    "geom_friction": {"floor": {"low": 0.5, "high": 1.5}},
    "joint_damping": {"bthigh": {"low": 0.5, "high": 1.5}},
    "actuator_gain": {"fthigh": {"low": 0.8, "high": 1.0}},
    "gravity_scale": {"low": 0.95, "high": 1.05},
    "latency_steps": {"low": 0, "high": 1},
    "obs_noise_std": 0.01,
    "action_noise_std": 0.05,
    "push": {"body": "torso", "max_force": 20.0, "probability": 0.05, "duration_steps": 2},
}


def _cheetah(rset=CHEETAH_SET):
    return envs.randomize(gym.make("HalfCheetah-v5", max_episode_steps=200), rset)


def test_halfcheetah_randomized_by_element_name_is_deterministic():
    env_a, env_b = _cheetah(), _cheetah()
    a, dom_a = _rollout(env_a, seed=3, steps=300)
    b, dom_b = _rollout(env_b, seed=3, steps=300)
    assert a.tobytes() == b.tobytes() and dom_a == dom_b
    assert set(dom_a[0]) == {
        "body_mass.torso",
        "body_mass.bthigh",
        "geom_friction.floor",
        "joint_damping.bthigh",
        "actuator_gain.fthigh",
        "gravity_scale",
        "latency_steps",
    }
    _, info = env_a.reset(seed=4)
    model, pristine = env_a.unwrapped.model, gym.make("HalfCheetah-v5").unwrapped.model
    torso = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "torso")
    assert model.body_mass[torso] == pytest.approx(pristine.body_mass[torso] * info["domain"]["body_mass.torso"])
    fthigh = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_ACTUATOR, "fthigh")
    assert model.actuator_gainprm[fthigh, 0] == pytest.approx(
        pristine.actuator_gainprm[fthigh, 0] * info["domain"]["actuator_gain.fthigh"]
    )
    np.testing.assert_allclose(model.opt.gravity, pristine.opt.gravity * info["domain"]["gravity_scale"])
    c, dom_c = _rollout(_cheetah(), seed=5, steps=50)
    assert dom_c[0] != dom_a[0]


@pytest.mark.parametrize(
    ("rset", "message"),
    [
        ({"body_mass": {"torsoo": {"low": 0.8, "high": 1.2}}}, "no body named 'torsoo'.*torso"),
        ({"actuator_gain": {"knee": {"low": 0.8, "high": 1.2}}}, "no actuator named 'knee'.*bthigh"),
        ({"push": {"body": "head", "max_force": 1, "probability": 0.1}}, "push.body: no body named 'head'"),
    ],
)
def test_halfcheetah_unknown_element_is_a_clear_error(rset, message):
    with pytest.raises(RandomizationError, match=message):
        _cheetah(rset)


def test_randomization_set_object_and_empty_set_accepted():
    rset = RandomizationSet.model_validate({"gravity_scale": {"low": 0.9, "high": 0.9}})
    env = gym.make(CARTPOLE, randomization=rset)
    _, info = env.reset(seed=0)
    assert info["domain"] == {"gravity_scale": pytest.approx(0.9)}
    assert env.unwrapped.model.opt.gravity[2] == pytest.approx(-9.81 * 0.9)
    assert RandomizationSet().is_empty()


def test_spring_stiffness_of_a_joint_and_a_tendon_is_randomized_by_name():
    """A flexible plant's spring is a parameter like a mass: `joint_stiffness` (a joint's spring) and
    `tendon_stiffness` (a tendon's) scale the model's value and return it to nominal; an unknown name is refused
    naming the group and the elements there are."""
    from envs.domain import DomainRandomizer

    xml = """<mujoco><worldbody>
      <body name="a"><joint name="slide" type="slide" axis="1 0 0" stiffness="50"/><geom size="0.1" mass="1"/>
      </body>
      <body name="b" pos="0 1 0"><joint name="other" type="slide" axis="1 0 0"/><geom size="0.1" mass="1"/></body>
    </worldbody>
    <tendon><fixed name="spring" stiffness="20"><joint joint="slide" coef="1"/><joint joint="other" coef="-1"/></fixed>
    </tendon></mujoco>"""
    model = mujoco.MjModel.from_xml_string(xml)
    rset = parse_randomization(
        {
            "joint_stiffness": {"slide": {"dist": "uniform", "low": 0.8, "high": 1.2}},
            "tendon_stiffness": {"spring": {"dist": "uniform", "low": 0.5, "high": 0.6}},
        }
    )
    randomizer = DomainRandomizer(model, rset)
    domain = sample_domain(rset, np.random.default_rng(0))
    assert 0.8 <= domain["joint_stiffness.slide"] <= 1.2 and 0.5 <= domain["tendon_stiffness.spring"] <= 0.6
    randomizer.apply(domain)
    assert model.jnt_stiffness[0] == pytest.approx(50 * domain["joint_stiffness.slide"])
    assert model.tendon_stiffness[0] == pytest.approx(20 * domain["tendon_stiffness.spring"])
    randomizer.apply({})
    assert model.jnt_stiffness[0] == 50 and model.tendon_stiffness[0] == 20
    with pytest.raises(RandomizationError, match=r"tendon_stiffness: no tendon named 'spirng'.*\['spring'\]"):
        DomainRandomizer(model, parse_randomization({"tendon_stiffness": {"spirng": {"low": 0.9, "high": 1.1}}}))


def test_a_motors_reflected_inertia_is_randomized_on_its_own_by_joint_name():
    """A geared motor's rotor inertia is the joint's armature, which `body_mass` does not scale (helper-70's reaction
    wheel could not randomize the wheel's inertia apart from its mass): `joint_armature` scales it and returns it to
    nominal, and the plant answers with it (the same torque spins up a heavier rotor less). A joint without armature
    is refused by name: a scale of 0 is 0, and the range would change no plant."""
    from envs.domain import DomainRandomizer

    xml = """<mujoco><option timestep="0.01"/><worldbody>
      <body name="wheel"><joint name="spin" type="hinge" axis="0 0 1" armature="0.02"/>
        <geom type="cylinder" size="0.1 0.01" mass="0.5"/></body>
      <body name="other" pos="1 0 0"><joint name="free_spin" type="hinge" axis="0 0 1"/>
        <geom type="cylinder" size="0.1 0.01" mass="0.5"/></body>
    </worldbody><actuator><motor name="m" joint="spin"/></actuator></mujoco>"""
    model = mujoco.MjModel.from_xml_string(xml)
    rset = parse_randomization({"joint_armature": {"spin": {"dist": "uniform", "low": 1.5, "high": 2.0}}})
    randomizer = DomainRandomizer(model, rset)
    domain = sample_domain(rset, np.random.default_rng(0))
    assert 1.5 <= domain["joint_armature.spin"] <= 2.0

    def spun_up() -> float:
        data = mujoco.MjData(model)
        data.ctrl[0] = 1.0
        mujoco.mj_step(model, data)
        return float(data.qvel[0])

    nominal = spun_up()
    randomizer.apply(domain)
    assert model.dof_armature[0] == pytest.approx(0.02 * domain["joint_armature.spin"])
    assert model.body_mass[1] == 0.5  # the mass is the MJCF's: only the rotor's inertia moved
    inertia = float(model.body_inertia[1, 2])
    assert spun_up() == pytest.approx(nominal * (inertia + 0.02) / (inertia + 0.02 * domain["joint_armature.spin"]))
    randomizer.apply({})
    assert model.dof_armature[0] == 0.02 and spun_up() == nominal
    with pytest.raises(RandomizationError, match=r"joint_armature.free_spin: joint 'free_spin' has no armature"):
        DomainRandomizer(model, parse_randomization({"joint_armature": {"free_spin": {"low": 0.9, "high": 1.1}}}))
