"""`EdgeRuntime`: a verified bundle's policy wrapped in its CBF safety shield.

This is what the edge box runs: `EdgeRuntime.load(bundle_dir)` verifies every
hash, opens the ONNX policy with edge session settings and builds the shield
from the bundle's `shield.json`; `act(obs)` returns the safe action, the raw
policy action and what the shield did. `resolve_production(models_root, task)`
finds the bundle the registry's production pointer names, so `serve --registry`
needs nothing from pipeline/.

Stdlib + numpy + onnxruntime + daqp only.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from shield.bundle import Bundle, BundleError, resolve_production
from shield.policy import OnnxPolicy, PolicyError

__all__ = ["EdgeRuntime", "resolve_production", "BundleError"]


class EdgeRuntime:
    """Policy + shield from one verified bundle; `act(obs_1d) -> (safe_action, raw_action, info)`."""

    def __init__(self, bundle: Bundle, policy: OnnxPolicy, shield=None):
        self.bundle, self.policy, self.shield = bundle, policy, shield
        self.obs_dim, self.act_dim = policy.obs_dim, policy.act_dim
        self._batch = None  # ShieldedPolicy for batch calls: one shield state per row

    @classmethod
    def load(cls, bundle_dir: str | Path, *, shield: bool = True) -> "EdgeRuntime":
        """Verify and load a bundle; `shield=False` serves the bare policy (for comparison only)."""
        bundle = Bundle.load(bundle_dir)
        try:
            policy = OnnxPolicy(bundle.policy_onnx)
        except PolicyError as err:
            raise BundleError(f"{err} (bundle {bundle_dir})") from None
        manifest = bundle.manifest
        for key, have in (("obs_dim", policy.obs_dim), ("act_dim", policy.act_dim)):
            if key in manifest and manifest[key] != have:
                raise BundleError(f"policy.onnx: {key} {have} disagrees with manifest.json ({manifest[key]}) in {bundle_dir}")
        return cls(bundle, policy, _build_shield(bundle, policy) if shield else None)

    @property
    def shielded(self) -> bool:
        return self.shield is not None

    def reset(self) -> None:
        """Start of an episode: clear the shield's predicted internal states."""
        if self.shield is not None:
            self.shield.reset()
        if self._batch is not None:
            self._batch.reset()

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """(safe action, raw policy action, info) for one observation `float32[obs_dim]`."""
        obs = np.asarray(obs, dtype=np.float32).reshape(-1)
        if obs.shape[0] != self.obs_dim:
            raise ValueError(f"observation must have {self.obs_dim} entries, got {obs.shape[0]}")
        t0 = time.perf_counter()
        raw = self.policy(obs[None, :])[0]
        t1 = time.perf_counter()
        if self.shield is None:
            return raw.copy(), raw, {"intervened": False, "fallback": False, "policy_us": (t1 - t0) * 1e6, "shield_us": 0.0}
        safe, info = self.shield.filter(obs, raw)
        info = dict(info)
        info["policy_us"], info["shield_us"] = (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6
        return np.asarray(safe, dtype=np.float32), raw, info

    def note_sent(self, action: np.ndarray) -> None:
        """Tell the shield the plant got `action` instead of the last `act` output (fallback, shadow echo)."""
        if self.shield is not None:
            self.shield.note_sent(action)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Batch policy interface: safe actions `float32[n, act_dim]` for `float32[n, obs_dim]`."""
        if self.shield is None:
            return self.policy(obs)
        if self._batch is None:
            from shield.cbf import ShieldedPolicy
            self._batch = ShieldedPolicy(self.policy, self.shield.spec)
        return self._batch(np.asarray(obs, dtype=np.float32).reshape(-1, self.obs_dim))


def _build_shield(bundle: Bundle, policy: OnnxPolicy):
    # Imported here so a shield-free load (and this module's import) stays light.
    from shield.cbf import CbfShield
    from shield.spec import ShieldSpec, ShieldSpecError

    try:
        spec = ShieldSpec.from_dict(bundle.shield_spec)
    except ShieldSpecError as err:
        raise BundleError(f"shield.json in {bundle.path}: {err}") from None
    if (spec.obs_dim, spec.act_dim) != (policy.obs_dim, policy.act_dim):
        raise BundleError(f"shield.json in {bundle.path}: sized for obs {spec.obs_dim}/act {spec.act_dim}, "
                          f"policy.onnx is obs {policy.obs_dim}/act {policy.act_dim}")
    return CbfShield(spec)
