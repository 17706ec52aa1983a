"""`OnnxPolicy`: the exported policy in an onnxruntime session tuned for the edge.

Edge settings, and why: one intra-op and one inter-op thread, sequential
execution and no spinning. A 64x64 MLP at batch 1 runs in a few microseconds;
a thread pool cannot speed that up, and onnxruntime's default worker threads
busy-wait after every call, burning a core the control loop and the shield
need (bench/bench_policy_latency.py measures both effects).

Stdlib + numpy + onnxruntime only: this runs on the edge box.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


class PolicyError(RuntimeError):
    """The ONNX model cannot be loaded or has the wrong interface."""


def edge_session_options() -> ort.SessionOptions:
    """Session options for a control loop: 1 thread each, sequential, no spinning."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    opts.log_severity_level = 3  # warnings about unused initializers are noise on the edge
    return opts


class OnnxPolicy:
    """Batch policy `obs float32[n, obs_dim] -> action float32[n, act_dim]` backed by onnxruntime."""

    def __init__(self, model: bytes | str | Path, *, edge: bool = True,
                 session_options: ort.SessionOptions | None = None):
        opts = session_options if session_options is not None else (edge_session_options() if edge else None)
        source = model if isinstance(model, bytes) else str(model)
        try:
            self.session = ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own exception types for bad models
            where = "policy.onnx" if isinstance(model, bytes) else str(model)
            raise PolicyError(f"{where}: onnxruntime cannot load the model ({err})") from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise PolicyError(f"policy.onnx: expected 1 input and 1 output, got {len(inputs)} and {len(outputs)}")
        self.input_name, self.output_name = inputs[0].name, outputs[0].name
        in_shape, out_shape = inputs[0].shape, outputs[0].shape
        if len(in_shape) != 2 or not isinstance(in_shape[1], int) or len(out_shape) != 2 or not isinstance(out_shape[1], int):
            raise PolicyError(f"policy.onnx: expected [batch, obs_dim] -> [batch, act_dim], got {in_shape} -> {out_shape}")
        self.obs_dim, self.act_dim = int(in_shape[1]), int(out_shape[1])
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self._outputs = [self.output_name]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions for a batch of raw observations; a 1-D observation is treated as batch 1."""
        obs = np.asarray(obs, dtype=np.float32)
        if obs.ndim == 1:
            obs = obs[None, :]
        if obs.ndim != 2 or obs.shape[1] != self.obs_dim:
            raise ValueError(f"observation batch must be [n, {self.obs_dim}], got shape {obs.shape}")
        return self.session.run(self._outputs, {self.input_name: np.ascontiguousarray(obs)})[0]

    def reset(self) -> None:
        """Stateless policy: nothing to clear (part of the policy interface)."""

    # ---- per-plant memory ---------------------------------------------------------------
    # A policy with an observation/action history keeps that history per plant: the server,
    # eval and both shadow passes hold one memory per plant (per client in `serve`) and pass
    # it in. A memoryless policy's memory is None and these calls cost nothing.
    def new_memory(self) -> object | None:
        """A fresh per-plant memory (observation/action history); None for a memoryless policy."""
        return None

    def act(self, obs: np.ndarray, memory: object | None = None) -> np.ndarray:
        """Raw action float32[act_dim] for one plant's observation float32[obs_dim], given its memory."""
        return self(obs)[0]

    def remember(self, memory: object | None, obs: np.ndarray, sent_action: np.ndarray) -> None:
        """Record what the plant observed and the action it was really sent (after the shield)."""
