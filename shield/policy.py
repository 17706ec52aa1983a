"""`OnnxPolicy`: the exported policy in an onnxruntime session tuned for the edge.

Edge settings, and why: one intra-op and one inter-op thread, sequential
execution and no spinning. A 64x64 MLP at batch 1 runs in a few microseconds;
a thread pool cannot speed that up, and onnxruntime's default worker threads
busy-wait after every call, burning a core the control loop and the shield
need (bench/bench_policy_latency.py measures both effects).

History policies (`train.history_length` > 0) take a second input, `history`
float32[n, H, obs_dim + act_dim]: the plant's last H (observation, sent action)
pairs, newest first, zeros before the episode's first step. `HistoryBuffer`
is the one implementation of that layout; training builds the same inputs
with it (pipeline/training/rollout.py). Bundles exported since the state
became explicit also output `next_history` (the same layout one step on, the
policy's own action newest): the per-plant memory then takes the graph's
state, and only the newest action is overwritten with the one really sent.
Older history graphs (no state output) keep working: the memory is pushed here.
An adaptive policy's graph also outputs `plant_estimate` float32[n, P] (the
domain parameters it believes the plant has; the contract names them): each
plant's latest is kept in its memory (`PlantMemory.estimate`).

Stdlib + numpy + onnxruntime only: this runs on the edge box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shield.constraints import wrap_angle

ESTIMATE_OUTPUT = "plant_estimate"  # the graph output an adaptive policy states its plant estimate in


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


class HistoryBuffer:
    """Last H (observation, sent action) pairs of n plants, newest first: `array` float32[n, H, obs_dim + act_dim]."""

    def __init__(self, rows: int, length: int, obs_dim: int, act_dim: int):
        self.obs_dim, self.act_dim = int(obs_dim), int(act_dim)
        self.array = np.zeros((int(rows), int(length), self.obs_dim + self.act_dim), np.float32)

    def clear(self, index: int | None = None) -> None:
        """Forget everything (index None) or one row's plant (a new episode on that row)."""
        if index is None:
            self.array[:] = 0.0
        else:
            self.array[index] = 0.0

    def push(self, obs: np.ndarray, action: np.ndarray) -> None:
        """Append one step for every row: obs float32[n, obs_dim], the action really sent float32[n, act_dim]."""
        if self.array.shape[1] == 0:
            return
        self.array[:, 1:] = self.array[:, :-1]
        self.array[:, 0, : self.obs_dim] = np.asarray(obs, np.float32).reshape(-1, self.obs_dim)
        self.array[:, 0, self.obs_dim :] = np.asarray(action, np.float32).reshape(-1, self.act_dim)

    def adopt(self, state: np.ndarray) -> None:
        """Take the graph's `next_history` output as this memory (then `note_sent` the action really sent)."""
        self.array[...] = state

    def note_sent(self, action: np.ndarray) -> None:
        """Replace the newest recorded actions with what the plants really got (e.g. after the shield)."""
        if self.array.shape[1]:
            self.array[:, 0, self.obs_dim :] = np.asarray(action, np.float32).reshape(-1, self.act_dim)


class OnnxPolicy:
    """Batch policy `obs float32[n, obs_dim] -> action float32[n, act_dim]` backed by onnxruntime.

    A history policy keeps one history per batch row when called as a batch
    policy: row i of every call is the same plant until `reset(i)` (new
    episode on that row) or `reset()`; the action recorded is the policy's own
    unless `note_sent(actions)` says what was really sent. Per-plant callers
    (server, edge runtime) use `new_memory` / `act` / `remember` instead.
    """

    def __init__(
        self,
        model: bytes | str | Path,
        *,
        edge: bool = True,
        session_options: ort.SessionOptions | None = None,
        wraps: Sequence[tuple[int, float]] = (),
    ):
        # (observation index, centre) of each angle the policy was trained on wrapped into (c - pi, c + pi] (the
        # contract's `wraps_around`, `shield.contract.observation_wraps`): a plant's multi-turn reading of it is
        # wrapped so before the policy and its history see it. The graph itself (`run`, `step`) takes what it is given.
        self.wraps = [(int(i), float(c)) for i, c in wraps]
        opts = session_options if session_options is not None else (edge_session_options() if edge else None)
        source = model if isinstance(model, bytes) else str(model)
        try:
            self.session = ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own exception types for bad models
            where = "policy.onnx" if isinstance(model, bytes) else str(model)
            raise PolicyError(f"{where}: onnxruntime cannot load the model ({err})") from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        estimate = [o for o in outputs if o.name == ESTIMATE_OUTPUT]
        outputs = [o for o in outputs if o.name != ESTIMATE_OUTPUT]
        if len(inputs) not in (1, 2) or len(outputs) not in (1, len(inputs)):
            raise PolicyError(
                "policy.onnx: expected 1 input (+ optional history) and 1 output (+ optional next history), "
                f"got {len(inputs)} and {len(outputs)}"
            )
        self.input_name, self.output_name = inputs[0].name, outputs[0].name
        in_shape, out_shape = inputs[0].shape, outputs[0].shape
        if (
            len(in_shape) != 2
            or not isinstance(in_shape[1], int)
            or len(out_shape) != 2
            or not isinstance(out_shape[1], int)
        ):
            raise PolicyError(
                f"policy.onnx: expected [batch, obs_dim] -> [batch, act_dim], got {in_shape} -> {out_shape}"
            )
        self.obs_dim, self.act_dim = int(in_shape[1]), int(out_shape[1])
        self.history_name, self.history_length = None, 0
        if len(inputs) == 2:
            h_shape = inputs[1].shape
            if (
                len(h_shape) != 3
                or not all(isinstance(d, int) for d in h_shape[1:])
                or h_shape[2] != self.obs_dim + self.act_dim
            ):
                raise PolicyError(
                    f"policy.onnx: history input must be [batch, H, {self.obs_dim + self.act_dim}], got {h_shape}"
                )
            self.history_name, self.history_length = inputs[1].name, int(h_shape[1])
        # The explicit state output: `next_history`, shaped as the history input.
        self.state_output_name: str | None = None
        if len(outputs) == 2:
            if list(outputs[1].shape[1:]) != list(inputs[1].shape[1:]):
                raise PolicyError(
                    f"policy.onnx: state output {outputs[1].name} is {outputs[1].shape}, "
                    f"its input {inputs[1].name} is {inputs[1].shape}"
                )
            self.state_output_name = outputs[1].name
        self.estimate_name, self.estimate_dim = None, 0
        if estimate:
            e_shape = estimate[0].shape
            if self.state_output_name is None:
                raise PolicyError(
                    f"policy.onnx: outputs {ESTIMATE_OUTPUT} but no next state: a graph that estimates the plant "
                    f"must output its next history too (only a graph without an estimate may leave the history to "
                    f"the runtime)"
                )
            if len(e_shape) != 2 or not isinstance(e_shape[1], int):
                raise PolicyError(f"policy.onnx: {ESTIMATE_OUTPUT} must be [batch, P], got {e_shape}")
            self.estimate_name, self.estimate_dim = ESTIMATE_OUTPUT, int(e_shape[1])
            outputs.append(estimate[0])
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self._outputs = [self.output_name] + [n for n in (self.state_output_name, self.estimate_name) if n]
        self._rows: HistoryBuffer | None = None  # batch-interface histories, one per row
        self._binding = None
        if all(arg.type == "tensor(float)" for arg in (*inputs, *outputs)):
            self._bind_one_plant()

    def _bind_one_plant(self) -> None:
        """One plant's call (`act`) runs through an IOBinding over buffers allocated here, shared with
        onnxruntime (no copies): no feed dict and no output array per call. A 64x64 MLP: p50 4.7 -> 3.1 us;
        beside the shield, its safe-step p99 about 5 us lower (fewer allocations, warmer caches).
        Like any preallocated buffer, not for concurrent `act` calls on one policy."""
        self._obs1 = np.zeros((1, self.obs_dim), np.float32)
        self._act1 = np.zeros((1, self.act_dim), np.float32)
        inputs = {self.input_name: self._obs1}
        if self.history_name is not None:
            self._hist1 = inputs[self.history_name] = np.zeros(
                (1, self.history_length, self.obs_dim + self.act_dim), np.float32
            )
        binding = self.session.io_binding()
        self._bound = []  # the OrtValues over the buffers, alive as long as the binding
        for name, array in inputs.items():
            self._bound.append(ort.OrtValue.ortvalue_from_numpy(array))
            binding.bind_ortvalue_input(name, self._bound[-1])
        self._bound.append(ort.OrtValue.ortvalue_from_numpy(self._act1))
        binding.bind_ortvalue_output(self.output_name, self._bound[-1])
        if self.state_output_name is not None:
            self._next1 = np.zeros_like(self._hist1)
            self._bound.append(ort.OrtValue.ortvalue_from_numpy(self._next1))
            binding.bind_ortvalue_output(self.state_output_name, self._bound[-1])
        if self.estimate_name is not None:
            self._est1 = np.zeros((1, self.estimate_dim), np.float32)
            self._bound.append(ort.OrtValue.ortvalue_from_numpy(self._est1))
            binding.bind_ortvalue_output(self.estimate_name, self._bound[-1])
        self._binding = binding

    @property
    def stateful(self) -> bool:
        """True when the policy carries a per-plant state (its history)."""
        return self.history_name is not None

    def run(self, obs: np.ndarray, history: np.ndarray | None = None) -> np.ndarray:
        """The graph itself, stateless: obs float32[n, obs_dim] (+ history float32[n, H, obs_dim + act_dim])."""
        return self.step(obs, history)[0]

    def step(self, obs: np.ndarray, history: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """(action, next state or None) of the graph: its state output where it has one, else None."""
        out = self.outputs(obs, history)
        return out[0], (out[1] if self.state_output_name is not None else None)

    def outputs(self, obs: np.ndarray, history: np.ndarray | None = None) -> list[np.ndarray]:
        """Every output of the graph, stateless: action, then the next state and the plant estimate where it has
        them (in that order)."""
        feeds = {self.input_name: np.ascontiguousarray(obs, dtype=np.float32)}
        if self.history_name is not None:
            if history is None:
                raise ValueError(
                    f"this policy takes a history input [n, {self.history_length}, {self.obs_dim + self.act_dim}]"
                )
            feeds[self.history_name] = np.ascontiguousarray(history, dtype=np.float32)
        return self.session.run(self._outputs, feeds)

    def wrapped(self, obs: np.ndarray) -> np.ndarray:
        """`obs` (float32[n, obs_dim]) with each of `wraps`' angles wrapped into (c - pi, c + pi]: the array itself
        where every one already is (bitwise, as the env observed it), else a copy."""
        out = obs
        for i, c in self.wraps:
            col = obs[:, i]
            outside = ~((col > c - math.pi) & (col <= c + math.pi)) & np.isfinite(col)
            if outside.any():
                if out is obs:
                    out = obs.copy()
                for r in np.flatnonzero(outside):
                    out[r, i] = wrap_angle(float(col[r]), c)
        return out

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions for a batch of raw observations; a 1-D observation is treated as batch 1."""
        obs = np.asarray(obs, dtype=np.float32)
        if obs.ndim == 1:
            obs = obs[None, :]
        if obs.ndim != 2 or obs.shape[1] != self.obs_dim:
            raise ValueError(f"observation batch must be [n, {self.obs_dim}], got shape {obs.shape}")
        if self.wraps:
            obs = self.wrapped(obs)
        if self.history_name is None:
            return self.run(obs)
        if self._rows is None or self._rows.array.shape[0] != obs.shape[0]:
            # A new batch size is a new set of plants: their histories start empty.
            self._rows = HistoryBuffer(obs.shape[0], self.history_length, self.obs_dim, self.act_dim)
        action, state = self.step(obs, self._rows.array)
        if state is None:
            self._rows.push(obs, action)
        else:
            self._rows.adopt(state)
        return action

    def reset(self, index: int | None = None) -> None:
        """New episode: clear every row's history (index None) or row `index`'s; memoryless: nothing to clear."""
        if self._rows is not None:
            self._rows.clear(index)

    def note_sent(self, actions: np.ndarray) -> None:
        """Batch interface: the actions float32[n, act_dim] really sent after the last call (e.g. shielded)."""
        if self._rows is not None:
            self._rows.note_sent(actions)

    # ---- per-plant memory ---------------------------------------------------------------
    # A policy with an observation/action history keeps that history per plant: the server,
    # eval and both shadow passes hold one memory per plant (per client in `serve`) and pass
    # it in. A memoryless policy's memory is None and these calls cost nothing.
    def new_memory(self) -> PlantMemory | None:
        """A fresh per-plant memory (observation/action history, its initial value: zeros); None when memoryless."""
        if self.history_name is None:
            return None
        return PlantMemory(self.history_length, self.obs_dim, self.act_dim)

    def act(self, obs: np.ndarray, memory: HistoryBuffer | None = None) -> np.ndarray:
        """Raw action float32[act_dim] for one plant's observation float32[obs_dim], given its memory."""
        obs = np.asarray(obs, dtype=np.float32).reshape(1, -1)
        if self.wraps and obs.shape[1] == self.obs_dim:
            obs = self.wrapped(obs)
        if self.history_name is not None and not isinstance(memory, HistoryBuffer):
            raise ValueError("a history policy needs the plant's memory: pass policy.new_memory()'s object")
        if self._binding is None or obs.shape[1] != self.obs_dim:  # a wrong size: onnxruntime's own error
            out = self.outputs(obs, None if memory is None else memory.array)
            if self.state_output_name is not None and isinstance(memory, PlantMemory):
                memory.pending = out[1]
                if self.estimate_name is not None:
                    memory.estimate = out[2][0].copy()
            return out[0][0]
        self._obs1[...] = obs
        if self.history_name is not None:
            self._hist1[...] = memory.array
        self.session.run_with_iobinding(self._binding)
        if self.state_output_name is not None and isinstance(memory, PlantMemory):
            memory.pending = self._next1.copy()  # the buffer is the next call's, maybe another plant's
            if self.estimate_name is not None:
                memory.estimate = self._est1[0].copy()
        return self._act1[0].copy()  # the buffer is the next call's

    def remember(self, memory: HistoryBuffer | None, obs: np.ndarray, sent_action: np.ndarray) -> None:
        """Record what the plant observed and the action it was really sent (after the shield)."""
        if memory is None:
            return
        sent = np.asarray(sent_action, np.float32).reshape(1, -1)
        if isinstance(memory, PlantMemory) and memory.pending is not None:
            memory.adopt(memory.pending)
            memory.note_sent(sent)
            memory.pending = None
        else:  # a graph without a state output (or no `act` since the last step): the history is pushed here
            seen = np.asarray(obs, np.float32).reshape(1, -1)
            memory.push(self.wrapped(seen) if self.wraps else seen, sent)


class PlantMemory(HistoryBuffer):
    """One plant's policy state: the history (`array`, float32[1, H, obs_dim + act_dim]) and the graph's
    `next_history` of the last `act` (`pending`), which becomes the state only once the plant was sent
    an action (`OnnxPolicy.remember`), so an `act` whose reply is never sent changes nothing.

    `estimate`: an adaptive policy's `plant_estimate` at its last `act` (None before the first, or after a
    reset); `steps`: the steps its state has seen since it was last (re)started, so an operator can tell an
    estimate made from a full history from one made from a few steps of zeros."""

    def __init__(self, length: int, obs_dim: int, act_dim: int):
        super().__init__(1, length, obs_dim, act_dim)
        self.pending: np.ndarray | None = None
        self.estimate: np.ndarray | None = None
        self.steps = 0

    def clear(self, index: int | None = None) -> None:
        """Back to the initial value (zeros), forgetting a pending step and the estimate too."""
        super().clear(index)
        self.pending, self.estimate, self.steps = None, None, 0

    def push(self, obs: np.ndarray, action: np.ndarray) -> None:
        super().push(obs, action)
        self.steps += 1

    def adopt(self, state: np.ndarray) -> None:
        super().adopt(state)
        self.steps += 1
