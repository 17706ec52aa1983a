"""`EdgeRuntime`: a verified bundle's policy, and one `PlantSession` (shield + policy memory) per plant.

This is what the edge box runs: `EdgeRuntime.load(bundle_dir)` verifies every
hash, opens the ONNX policy with edge session settings and parses the bundle's
`shield.json`. What belongs to the bundle is shared (the ONNX session, the
spec); what belongs to one plant is not: `runtime.new_session()` gives a
`PlantSession` with its own `CbfShield` (the prediction through the control
latency, the assumption monitor) and its own policy memory
(`policy.new_memory()`). `sim2real serve` keeps one session per client; the
in-process interface (`act`, `note_sent`, `reset`, `__call__`) drives a default
session, as before. `resolve_production(models_root, task)` finds the bundle the
registry's production pointer names, so `serve --registry` needs nothing from
pipeline/.

Stdlib + numpy + onnxruntime + daqp only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shield.bundle import Bundle, BundleError, resolve_production
from shield.contract import estimate_names, observation_wraps
from shield.policy import OnnxPolicy, PolicyError
from shield.spec import same_spec

if TYPE_CHECKING:  # the CBF (and daqp) load only when a shielded runtime is built
    from shield.cbf import ShieldedPolicy

__all__ = ["EdgeRuntime", "PlantSession", "resolve_production", "BundleError"]


_BUILD = object()  # PlantSession default: build a fresh shield from the runtime's spec


class PlantSession:
    """One plant's state: its shield (latency prediction, monitor) and its policy memory.

    `act(obs)` computes (safe, raw, info) without committing anything to the policy's
    memory; `sent(obs, action, replaced)` records what the plant really got (the shield's
    action, or a fallback / shadow echo that `replaced` it).
    """

    __slots__ = (
        "runtime",
        "policy",
        "shield",
        "memory",
        "episode",
        "step",
        "seq",
        "seen_ns",
        "rate_start_ns",
        "rate_count",
        "rate_off",
        "silences",
    )

    def __init__(self, runtime: EdgeRuntime, shield=_BUILD):
        self.runtime, self.policy = runtime, runtime.policy
        self.shield = runtime.new_shield() if shield is _BUILD else shield
        self.memory = self.policy.new_memory()
        self.episode, self.step = 0, 0  # shadow-log bookkeeping (the server numbers its plants)
        self.seq, self.seen_ns = -1, 0  # the server's: last accepted seq, and when (shield.replay.PlantTable)
        # The server's request-rate window (Status.RATE): when it started, requests in it, the last verdict; and
        # how many requests in a row each came after a silence past the plant-live time.
        self.rate_start_ns, self.rate_count, self.rate_off, self.silences = 0, 0, False, 0

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """(safe action, raw policy action, info) for one observation float32[obs_dim]; only the shield's state moves"""
        t0 = time.perf_counter()
        raw = self.policy.act(obs, self.memory)
        t1 = time.perf_counter()
        shield = self.shield
        if shield is None:
            return (
                raw.copy(),
                raw,
                {"intervened": False, "fallback": False, "policy_us": (t1 - t0) * 1e6, "shield_us": 0.0},
            )
        safe, info = shield.filter(obs, raw)
        info["policy_us"], info["shield_us"] = (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6
        return safe, raw, info

    def act_blind(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """(safe action, raw, info) for a step whose observation is missing (the request's Flags.OBS_MISSING): the
        shield dead-reckons from the last good observation through the actions sent since.

        The policy does not run (`raw` is NaN) and its memory does not move (send with `sent(None, ...)`). On a
        non-finite observation the shield filters its own fallback action at the dead-reckoned state whatever
        the policy proposes (shield.cbf, points 5 and 6), so a policy action would be computed only to be thrown
        away; and the dead-reckoned state is not an observation, so nothing may enter a history policy's state
        as if it were one (a NaN there would reach its next H actions). Its state keeps the last observed step,
        and the next observation continues from it (a controller that wants the gap forgotten sets RESET_STATE).

        info: "intervened" and "bad_input" False (no policy action to change, and the missing observation was
        declared, not malformed); "blind" True when the shield's guarantee does not cover this step: past its
        blind horizon, or no good observation yet to dead-reckon from (then it sent its constant fallback).
        """
        t0 = time.perf_counter()
        raw = np.full(self.policy.act_dim, np.nan, np.float32)
        shield = self.shield
        if shield is None:  # nothing to dead-reckon with: the constant fallback, and no guarantee
            safe = self.runtime.fallback_action()
            return safe, raw, {"intervened": False, "fallback": True, "bad_input": False, "blind": True}
        safe, info = shield.filter(self.runtime.missing_obs, raw)
        info["intervened"] = info["bad_input"] = False
        if not info["blind_steps"]:  # not dead-reckoned: there was no state to predict from
            info["blind"] = True
        info["policy_us"], info["shield_us"] = 0.0, (time.perf_counter() - t0) * 1e6
        return safe, raw, info

    def fallback(self) -> np.ndarray:
        """float32[act_dim]: the fallback for this plant now: the constant, except that a set-point action
        (`fallback_hold`) holds the last action this plant was sent."""
        if self.shield is not None:
            return self.shield.fallback_action()
        return self.runtime.fallback_action()

    def sent(self, obs: np.ndarray | None, action: np.ndarray, replaced: bool) -> None:
        """The plant got `action` for `obs` (None: a blind step, `act_blind`, which the policy's memory skips);
        `replaced`: it is not the shield's output of the last `act`."""
        if replaced and self.shield is not None:
            self.shield.note_sent(action)
        if obs is not None:
            self.policy.remember(self.memory, obs, action)

    def estimate(self) -> tuple[np.ndarray | None, int]:
        """(the policy's latest plant estimate float32[P], or None when it has none yet or states none; the steps
        its state has seen since it last started)."""
        memory = self.memory
        if memory is None:
            return None, 0
        return getattr(memory, "estimate", None), getattr(memory, "steps", 0)

    def reset_policy_state(self) -> bool:
        """The policy's state back to its initial value (the shield keeps what it knows); False when memoryless."""
        if self.memory is None:
            return False
        self.memory.clear()
        return True

    def reset(self) -> None:
        """Episode start: forget pending actions, predicted state and the policy's history."""
        if self.shield is not None:
            self.shield.reset()
        self.memory = self.policy.new_memory()

    def moved_to(self, runtime: EdgeRuntime, shield=None) -> PlantSession:
        """This plant's session under a newly loaded runtime (hot reload): the actions already sent carry over.

        Same shield spec (by content): the shield object itself carries over (pending actions,
        predicted state, monitor). Otherwise `shield` (a fresh one for the new spec, built off
        the hot path) gets what this plant's shield knows that still holds (`carry_pending_actions`).
        """
        if same_spec(runtime.spec, self.runtime.spec) or self.shield is None:
            new_shield = self.shield if runtime.shielded else None
        else:
            new_shield = shield if shield is not None else runtime.new_shield()
            if new_shield is not None:
                carry_pending_actions(self.shield, new_shield)
        moved = PlantSession(runtime, shield=new_shield)
        moved.episode, moved.step, moved.seq, moved.seen_ns = self.episode, self.step, self.seq, self.seen_ns
        return moved


def carry_pending_actions(old, new) -> bool:
    """What one CbfShield knows about its plant that still holds under another spec (same action size): the
    actions sent but not yet applied, the newest min(old, new latency) of them (a longer new latency keeps the
    fallback, a fresh session's guess, in its older slots); the last action sent; and, where the state layout
    agrees (cases, states with internal ones such as an actuator lag), the state predicted for the next call.

    Reads the shields' `LatencyPredictor` buffers (same package): v = [states..., pending..., u, 1].
    Returns False (the new shield starts from its reset state) when the action sizes differ.
    """
    po, pn = getattr(old, "_predictor", None), getattr(new, "_predictor", None)
    if po is None or pn is None or po.inputs != pn.inputs:
        return False
    m = po.inputs
    span = min(po.latency, pn.latency) * m
    pn.v[pn._u0 - span : pn._u0] = po.v[po._u0 - span : po._u0]
    pn.v[pn._u0 : pn._u0 + m] = po.v[po._u0 : po._u0 + m]
    pn.committed = po.committed
    if po.has_state and (po.cases, po.states) == (pn.cases, pn.states):
        pn._next[:] = po._next
        pn.has_state = True
    return True


class EdgeRuntime:
    """Shared policy + spec of one verified bundle; `act(obs_1d) -> (safe, raw, info)` on a default plant."""

    def __init__(self, bundle: Bundle | None, policy: OnnxPolicy, shield=None, spec=None):
        self.bundle, self.policy = bundle, policy
        self.spec = spec if spec is not None else getattr(shield, "spec", None)
        self.obs_dim, self.act_dim = policy.obs_dim, policy.act_dim
        # What a plant session hands its shield on a blind step (`PlantSession.act_blind`): read, never written.
        self.missing_obs = np.full(self.obs_dim, np.nan, np.float32)
        self.missing_obs.flags.writeable = False
        self._default = PlantSession(self, shield=shield)
        self._batch: ShieldedPolicy | None = None  # for batch calls: one shield state per row

    @classmethod
    def load(cls, bundle_dir: str | Path, *, shield: bool = True, pinned: dict | None = None) -> EdgeRuntime:
        """Verify and load a bundle; `shield=False` serves the bare policy (for comparison only).

        `pinned`: the registry pointer's {file: sha256}; checked on the very bytes that are loaded.
        """
        bundle = Bundle.load(bundle_dir, pinned=pinned)
        try:
            # The verified bytes themselves, not a second read; the angles it was trained on wrapped, wrapped here.
            policy = OnnxPolicy(bundle.policy_onnx, wraps=observation_wraps(bundle.manifest.get("contract")))
        except PolicyError as err:
            raise BundleError(f"{err} (bundle {bundle_dir})") from None
        manifest = bundle.manifest
        for key, have in (("obs_dim", policy.obs_dim), ("act_dim", policy.act_dim)):
            if key in manifest and manifest[key] != have:
                raise BundleError(
                    f"policy.onnx: {key} {have} disagrees with manifest.json ({manifest[key]}) in {bundle_dir}"
                )
        _check_state_contract(manifest.get("contract"), policy, bundle_dir)
        if not shield:  # the bare policy: shield.json is not even parsed
            return cls(bundle, policy)
        runtime = cls(bundle, policy, spec=_parse_spec(bundle, policy))
        runtime._default.shield = runtime.new_shield()
        return runtime

    @property
    def shielded(self) -> bool:
        return self.spec is not None

    @property
    def shield(self):
        """The default plant's shield (None when loaded with shield=False)."""
        return self._default.shield

    def new_shield(self):
        """A fresh CbfShield for one plant (None without a spec), sharing the default plant's spec-derived matrices."""
        if self.spec is None:
            return None
        from shield.cbf import CbfShield

        default = getattr(self, "_default", None)
        return CbfShield(self.spec, template=default.shield if default is not None else None)

    def new_session(self) -> PlantSession:
        """A new plant: its own shield state and policy memory."""
        return PlantSession(self)

    def fallback_action(self) -> np.ndarray:
        """The constant safe action: the spec's `fallback_action`, else zeros clipped to the box, else zeros."""
        spec = self.spec
        if spec is None:
            return np.zeros(self.act_dim, np.float32)
        fallback = spec.fallback_action if spec.fallback_action is not None else np.zeros(spec.act_dim)
        return np.clip(np.asarray(fallback, np.float32), *spec.action_box32()).reshape(self.act_dim)

    def action_bounds(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(low, high) float32: the widest float32 box inside the declared action box (`spec.action_box32`: a
        float32 action within it is within the declared bounds in double precision too), or None without a spec."""
        spec = self.spec
        if spec is None:
            return None
        return spec.action_box32()

    # ---- the in-process interface (eval, shadow, benches): one default plant ---------------
    @property
    def verified_bundle(self) -> Bundle:
        """The bundle this runtime was loaded from (a runtime built from a bare policy has none)."""
        if self.bundle is None:
            raise ValueError("this runtime was built from a policy, not loaded from a bundle")
        return self.bundle

    def reset(self) -> None:
        """Start of an episode: clear the default plant's predicted states and policy history."""
        self._default.reset()
        if self._batch is not None:
            self._batch.reset()

    def act(self, obs: np.ndarray, sent: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
        """(safe action, raw policy action, info) for one observation `float32[obs_dim]` (default plant); a
        non-finite observation is a blind step (`PlantSession.act_blind`) with info["bad_input"] True.

        `sent`: what the plant gets instead of the safe action, known before the next step (shadow mode: the
        legacy controller's action). The shield predicts from it and a stateful policy's memory records it, as
        `serve --mode shadow` does; predicting from its own unsent outputs instead, the shield's monitor read
        the gap between the two as a plant outside the envelope."""
        obs = np.asarray(obs, dtype=np.float32).reshape(-1)
        if obs.shape[0] != self.obs_dim:
            raise ValueError(f"observation must have {self.obs_dim} entries, got {obs.shape[0]}")
        if not np.isfinite(obs).all():
            # A sensor that gave no number: the shield dead-reckons as on a declared blind step, and neither the
            # policy nor its memory sees the value (a NaN in a history policy's state would reach its next H
            # actions); the server refuses such a request outright (BAD_INPUT), which changes nothing.
            safe, raw, info = self._default.act_blind()
            info["bad_input"] = True
            seen = None
        else:
            safe, raw, info = self._default.act(obs)
            seen = obs
        if sent is None:
            self._default.sent(seen, safe, replaced=False)
        else:
            self._default.sent(seen, np.asarray(sent, dtype=np.float32).reshape(-1), replaced=True)
        return np.asarray(safe, dtype=np.float32), raw, info

    def estimate(self) -> tuple[np.ndarray | None, int]:
        """The default plant's latest plant estimate and the steps its state has seen (`PlantSession.estimate`)."""
        return self._default.estimate()

    def note_sent(self, action: np.ndarray) -> None:
        """Tell the default plant's shield it got `action` instead of the last `act` output (fallback, shadow echo)."""
        if self._default.shield is not None:
            self._default.shield.note_sent(action)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Batch policy interface: safe actions `float32[n, act_dim]` for `float32[n, obs_dim]`."""
        if self.spec is None:
            return self.policy(obs)
        if self._batch is None:
            from shield.cbf import ShieldedPolicy

            self._batch = ShieldedPolicy(self.policy, self.spec)
        return self._batch(np.asarray(obs, dtype=np.float32).reshape(-1, self.obs_dim))


def _check_state_contract(contract: dict | None, policy: OnnxPolicy, where) -> None:
    """The graph's state tensors are the ones the contract names (a schema-1 bundle states none)."""
    if not contract:
        return
    state = contract["policy_state"]
    if (state["kind"] != "none") != policy.stateful:
        raise BundleError(
            f"manifest.json: contract.policy_state.kind is {state['kind']!r}, policy.onnx "
            f"{'has' if policy.stateful else 'has no'} state input, in {where}"
        )
    if "input" in state and (state["input"], state["output"]) != (policy.history_name, policy.state_output_name):
        raise BundleError(
            f"manifest.json: contract.policy_state names {state['input']} -> {state['output']}, policy.onnx has "
            f"{policy.history_name} -> {policy.state_output_name}, in {where}"
        )
    stated = estimate_names(contract)
    if len(stated) != policy.estimate_dim:
        raise BundleError(
            f"manifest.json: contract.plant_estimate states {len(stated)} parameters, policy.onnx outputs "
            f"{policy.estimate_dim}, in {where}"
        )


def _parse_spec(bundle: Bundle, policy: OnnxPolicy):
    # Imported here so this module's import stays light.
    from shield.spec import ShieldSpec, ShieldSpecError

    try:
        spec = ShieldSpec.from_dict(bundle.shield_spec)
    except ShieldSpecError as err:
        raise BundleError(f"shield.json in {bundle.path}: {err}") from None
    if (spec.obs_dim, spec.act_dim) != (policy.obs_dim, policy.act_dim):
        raise BundleError(
            f"shield.json in {bundle.path}: sized for obs {spec.obs_dim}/act {spec.act_dim}, "
            f"policy.onnx is obs {policy.obs_dim}/act {policy.act_dim}"
        )
    return spec
