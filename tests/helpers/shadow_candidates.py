"""Candidate bundles for the shadow/gate/report tests: a random-weight policy and an exact copy of the legacy LQR."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from pipeline.config import load_config
from shield.bundle import POLICY_FILE, SHIELD_FILE, make_manifest, write_bundle

REPO = Path(__file__).resolve().parents[2]
CARTPOLE_CONFIG = REPO / "configs" / "cartpole.yaml"
ENV_ID = "sim2real/CartPoleRail-v0"


def cartpole_config(episodes: int = 3, max_episode_steps: int = 200):
    """The shipped cart-pole config, shortened so a shadow run takes seconds."""
    cfg = load_config(CARTPOLE_CONFIG)
    cfg.shadow.episodes = episodes
    cfg.task.max_episode_steps = max_episode_steps
    return cfg


def cartpole_shield_spec(cfg) -> dict:
    """The task's shield.json, built the way export builds it."""
    try:
        from pipeline.safety.shield_spec import build_shield_spec
    except ImportError:
        return _stand_in_shield_spec()
    return build_shield_spec(cfg)


def _stand_in_shield_spec() -> dict:
    # Until pipeline/shield_spec.py lands: the nominal linearization and the rail band.
    import envs
    from envs.linearization import linearize_control_step

    a, b = linearize_control_step(envs.nominal_model(ENV_ID))
    return {
        "schema_version": 1,
        "task": "cartpole",
        "obs_dim": 5,
        "act_dim": 1,
        "dt": envs.task(ENV_ID).control_period,
        "action_low": [-1.0],
        "action_high": [1.0],
        "state_index": [0, 1, 2, 3],
        "model": {"type": "linear", "A": a.tolist(), "B": b.tolist(), "c": [0.0] * 4},
        "kinematics": {"position_index": [0], "velocity_index": [2], "brake_accel": [20.0]},
        "constraints": [{"name": "rail_band", "type": "box", "index": [0], "low": [-1.0], "high": [1.0], "gain": 0.3}],
        "latency_steps": 0,
        "margin": 0.01,
    }


def lqr_onnx(gain: np.ndarray, scale: float = 1.0, setpoint_scale: float = 1.0) -> bytes:
    """ONNX graph computing the legacy LQR exactly: clip(obs @ W, -1, 1), W from u = -K (s - [x_ref,0,0,0]).

    Made worse on purpose: `scale` < 1 weakens every gain (the action before clipping scaled down);
    `setpoint_scale` < 1 tracks that fraction of the set-point, so the cart stays (1 - setpoint_scale) |x_ref|
    short of it: the tracking term (0.5 per m per step) costs it on every step, never gains."""
    k = scale * np.asarray(gain, np.float64).reshape(4)
    w = np.zeros((5, 1), np.float32)
    w[:4, 0] = -k
    w[4, 0] = k[0] * setpoint_scale  # the set-point shifts the position error
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["obs", "W"], ["u"]), helper.make_node("Clip", ["u", "lo", "hi"], ["action"])],
        "legacy_lqr_copy",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            helper.make_tensor("W", TensorProto.FLOAT, [5, 1], w.ravel().tolist()),
            helper.make_tensor("lo", TensorProto.FLOAT, [], [-1.0]),
            helper.make_tensor("hi", TensorProto.FLOAT, [], [1.0]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def write_lqr_bundle(out_dir, cfg, scale: float = 1.0, setpoint_scale: float = 1.0) -> Path:
    """A bundle whose policy reproduces the cart-pole's legacy LQR, or a worse one (`lqr_onnx`)."""
    import envs

    onnx_bytes = lqr_onnx(envs.legacy_controller(ENV_ID).gain, scale, setpoint_scale)
    shield_bytes = json.dumps(cartpole_shield_spec(cfg), indent=2).encode()
    manifest = make_manifest(
        task="cartpole",
        env_id=ENV_ID,
        config_hash=cfg.config_hash(),
        files={POLICY_FILE: onnx_bytes, SHIELD_FILE: shield_bytes},
        obs_dim=5,
        act_dim=1,
    )
    return write_bundle(out_dir, policy_onnx=onnx_bytes, shield_spec=shield_bytes, manifest=manifest)


def write_random_bundle(out_dir, cfg, seed: int = 0) -> Path:
    """A bundle exported from a freshly initialised ActorCritic (random weights)."""
    import torch

    from pipeline.deployment.export import export_deterministic
    from pipeline.training.model import ActorCritic, DeterministicPolicy

    torch.manual_seed(seed)
    ac = ActorCritic(5, 1, cfg.train.hidden_sizes)
    meta = dict(task="cartpole", env_id=ENV_ID, updates=0, env_steps=0, **ac.spec())
    result = export_deterministic(
        DeterministicPolicy(ac), meta, cartpole_shield_spec(cfg), config_hash=cfg.config_hash(), out_dir=out_dir
    )
    return Path(result["bundle"])


# One shadow run per candidate per pytest session: the shadow, gate and report tests share them.
_RUNS: dict[str, tuple[Path, dict]] = {}
LOOSE_LATENCY_US = 1e6


# An exact copy of legacy is equal to legacy, which the default gate ("no worse than legacy" at 95 %) does not
# promote; the shared run states a 1 % margin, so the report and CLI tests see a passing candidate (and the
# report names the loosened key).
LQR_COPY_RATIO = 0.99
LOST_TOLERANCE_SHORT_RUNS = 0.2


SHADOW_EPISODE_STEPS = 100  # the length of shadow_result's episodes


def shadow_result(kind: str, base_dir: Path) -> tuple[Path, dict]:
    """(bundle dir, run_shadow result) for kind "lqr" or "random", run once per session under `base_dir`."""
    if kind not in _RUNS:
        from pipeline.evaluation.shadow import run_shadow

        cfg = cartpole_config(episodes=10, max_episode_steps=SHADOW_EPISODE_STEPS)
        # The gate's latency threshold is a property of the edge box, not of this shared 2-core test
        # machine; test_gate_decisions covers the latency rule with fixed numbers.
        cfg.gate.max_latency_p99_us = LOOSE_LATENCY_US
        # Short episodes and tens of them: with the shipped tolerance (0.02) a pass on lost episodes needs 270 (the
        # gate statistics tests cover it); these runs loosen it so a copy of legacy decides within 80 (looks at 10, 20,
        # 40 and 80: each bound at 1 - 0.05 / 4).
        cfg.gate.max_episodes = 80
        cfg.gate.max_lost_rate_increase = LOST_TOLERANCE_SHORT_RUNS
        if kind == "lqr":
            cfg.gate.min_return_ratio = LQR_COPY_RATIO
        writer = {"lqr": write_lqr_bundle, "random": write_random_bundle}[kind]
        bundle = writer(base_dir / f"{kind}-bundle", cfg)
        _RUNS[kind] = bundle, run_shadow(bundle, cfg, report_dir=base_dir / f"{kind}-report")
    return _RUNS[kind]


def write_estimating_bundle(out_dir, cfg, seed: int = 0, history_length: int = 8) -> Path:
    """A bundle shaped as an adaptive cart-pole student's (history, plant_estimate over the train set's parameters),
    freshly initialised: its estimates are not skilled, only where an adaptive policy's would be."""
    import torch

    from envs.wrappers import domain_encoding
    from pipeline.deployment.export import export_deterministic
    from pipeline.training.model import ActorCritic, DeterministicPolicy

    torch.manual_seed(seed)
    estimates = [list(e) for e in domain_encoding(cfg.randomization["train"])]
    ac = ActorCritic(5, 1, cfg.train.hidden_sizes, history_length=history_length, estimates=estimates)
    meta = dict(task="cartpole", env_id=ENV_ID, updates=0, env_steps=0, **ac.spec())
    result = export_deterministic(
        DeterministicPolicy(ac), meta, cartpole_shield_spec(cfg), config_hash=cfg.config_hash(), out_dir=out_dir
    )
    return Path(result["bundle"])
