"""Tiny verified bundles for the serve tests: an ONNX MLP built with onnx.helper (no torch) + a shield spec."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from shield.bundle import make_manifest, write_bundle
from tests.helpers.shield_specs import planar_double_integrator

OBS_DIM, ACT_DIM = 4, 2


def tiny_policy_onnx(seed: int, obs_dim: int = OBS_DIM, act_dim: int = ACT_DIM) -> bytes:
    """obs -> tanh(obs @ W1 + b1) @ W2 + b2, clipped to [-1, 1]; weights from `seed`."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 1.0, (obs_dim, 16)).astype(np.float32)
    b1 = rng.normal(0, 0.1, 16).astype(np.float32)
    w2 = rng.normal(0, 0.5, (16, act_dim)).astype(np.float32)
    b2 = rng.normal(0, 0.1, act_dim).astype(np.float32)
    inits = [
        numpy_helper.from_array(a, n)
        for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"), (np.float32(-1.0), "lo"), (np.float32(1.0), "hi"))
    ]
    nodes = [
        helper.make_node("MatMul", ["obs", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Tanh", ["a1"], ["t1"]),
        helper.make_node("MatMul", ["t1", "w2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["a2"]),
        helper.make_node("Clip", ["a2", "lo", "hi"], ["action"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_policy",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", obs_dim])],
        [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", act_dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def constant_policy_onnx(action: list[float], obs_dim: int) -> bytes:
    """obs -> the constant `action` (obs @ 0 + action): a policy that pushes the same way whatever it sees."""
    inits = [
        numpy_helper.from_array(np.zeros((obs_dim, len(action)), np.float32), "w"),
        numpy_helper.from_array(np.asarray(action, np.float32), "b"),
    ]
    nodes = [helper.make_node("MatMul", ["obs", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["action"])]
    graph = helper.make_graph(
        nodes,
        "constant_policy",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", obs_dim])],
        [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", len(action)])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_tiny_bundle(
    out_dir,
    seed: int = 0,
    version: int | None = None,
    latency_steps: int = 0,
    action_bound: float = 1.0,
    *,
    spec: dict | None = None,
    policy: bytes | None = None,
    control_period_s: float | None = None,
    observations: dict[int, dict] | None = None,
):
    """A complete, verifiable bundle for the planar double integrator (obs 4, act 2), actions in +-action_bound;
    or for `spec` (a shield.json's content) with `policy` (ONNX bytes of its obs_dim and act_dim). With
    `control_period_s`, a schema-2 bundle whose I/O contract states that period, its observation i's entry
    updated with `observations[i]` (an expected range, `wraps_around`); without, a schema-1 one."""
    if spec is None:
        spec = planar_double_integrator(latency_steps=latency_steps)
        spec["task"] = "planar"
        spec["action_low"], spec["action_high"] = [-action_bound] * 2, [action_bound] * 2
    if policy is None:
        policy = tiny_policy_onnx(seed, spec["obs_dim"], spec["act_dim"])
    shield_bytes = json.dumps(spec, indent=2, sort_keys=True).encode()
    manifest = make_manifest(
        task=spec["task"],
        env_id="test/Planar-v0",
        files={"policy.onnx": policy, "shield.json": shield_bytes},
        config_hash="0" * 64,
        version=version,
        obs_dim=spec["obs_dim"],
        act_dim=spec["act_dim"],
        contract=None if control_period_s is None else _contract(spec, control_period_s, observations or {}),
    )
    return write_bundle(out_dir, policy_onnx=policy, shield_spec=shield_bytes, manifest=manifest)


def _contract(spec: dict, control_period_s: float, observations: dict[int, dict]) -> dict:
    """The export's I/O contract for a bundle of `spec`'s sizes (an undeclared task: positional names), stating
    `control_period_s`, each observation i updated with `observations[i]`."""
    from pipeline.deployment.contract import io_contract
    from shield.contract import contract_sha256

    n, m = spec["obs_dim"], spec["act_dim"]
    contract = io_contract("test/Planar-v0", [0.0] * n, [1.0] * n, [-1.0] * m, [1.0] * m)
    contract["control_period_s"] = control_period_s
    for i, entry in observations.items():
        contract["observations"][i].update(entry)
    contract["names_sha256"] = contract_sha256(contract)
    return contract


def write_key_file(path, key: bytes):
    """A pre-shared key file as `serve --key-file` accepts it: mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.chmod(path, 0o600)
    return path


class ServerProcess:
    """`python -m shield.server ...` (or `command`) in a subprocess on a free port; waits for its 'listening' line."""

    def __init__(self, *args: str, cwd=None, command: tuple[str, ...] | None = None):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        command = command or (sys.executable, "-m", "shield.server")
        self.proc = subprocess.Popen(
            [*command, *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening udp://([\d.]+):(\d+) .*version=(\d+)", line)
            if m:
                self.host, self.port, self.version = m.group(1), int(m.group(2)), int(m.group(3))
                return
        self.proc.wait()
        raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def stop(self) -> str:
        """SIGTERM, wait, return everything it printed; asserts a clean exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=20)
        self.lines.append(out)
        text = "".join(self.lines)
        assert self.proc.returncode == 0, text
        return text

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
