"""`sim2real eval`: run a policy (bundle, legacy, random or adversarial) on randomized domains, with or without the shield.

`evaluate(cfg, policy, ...)` is the reusable part (benches and tests call it);
`run_cli(args)` is the CLI handler. The episodes run in the one episode runner
(`pipeline.evaluation.episodes`), so eval, shadow and the benches measure the
same way: a violation is a step whose `info["cost"]` is 1.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable

import numpy as np

from pipeline.evaluation.episodes import (
    PolicyDriver,
    RuntimeDriver,
    control_period_s,
    domains_label,
    make_env,
    resolve_domains,
    run_episodes,
)
from shield.cbf import CbfShield
from shield.spec import ShieldSpec

_OVERSHOOT = 0.6  # how far beyond the nearest boundary the steered adversary aims (constraint units)


class RandomPolicy:
    """Uniform random actions in the action box (batch policy interface)."""

    def __init__(self, low: np.ndarray, high: np.ndarray, seed: int = 0):
        self.low, self.high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.rng.uniform(self.low, self.high, (len(obs), len(self.low))).astype(np.float32)


class AdversarialPolicy:
    """Drives toward the nearest constraint at full action (or, for a task that would fall over, steers its legacy controller there)."""

    def __init__(self, spec: ShieldSpec, steer: tuple[Callable, int] | None = None):
        self.spec = spec
        model = spec.linear_model()
        cols = {o: j for j, o in enumerate(spec.state_index)}
        # Velocity change of each position per unit action over one period.
        self._dv = np.array([model.B[cols[v]] for v in spec.velocity_index]).reshape(len(spec.position_index), spec.act_dim)
        self._pos = list(spec.position_index)
        self._low, self._high = np.asarray(spec.action_low), np.asarray(spec.action_high)
        self._steer = steer

    def reset(self) -> None:
        """Clear the steered controller's state."""
        if self._steer is not None and hasattr(self._steer[0], "reset"):
            self._steer[0].reset()

    def _nearest(self, o: np.ndarray) -> tuple[float, np.ndarray]:
        """(distance, unit direction over the positions toward violation) of the nearest positional constraint."""
        best_d, best_n = math.inf, np.zeros(len(self._pos))
        where = {o_i: k for k, o_i in enumerate(self._pos)}
        for con in self.spec.constraints:
            rows = []
            if con["type"] == "halfspace":
                a = np.asarray(con["a"])
                if all(i in where for i in np.flatnonzero(a)):
                    n = np.zeros(len(self._pos))
                    for i in np.flatnonzero(a):
                        n[where[i]] = a[i]
                    norm = np.linalg.norm(n)
                    rows.append(((con["b"] - a @ o) / norm, n / norm))
            elif con["type"] == "box":
                for i, lo, hi in zip(con["index"], con["low"], con["high"]):
                    if i in where:
                        e = np.zeros(len(self._pos))
                        e[where[i]] = 1.0
                        rows += [(hi - o[i], e), (o[i] - lo, -e)]
            elif all(i in where for i in con["index"]):
                diff = np.array([o[i] - c for i, c in zip(con["index"], con["center"])])
                dist = float(np.linalg.norm(diff))
                n = np.zeros(len(self._pos))
                for i, v in zip(con["index"], diff / max(dist, 1e-9)):
                    n[where[i]] = -v  # toward the centre of the keep-out zone
                rows.append((dist - con["radius"], n))
            for d, n in rows:
                if math.isfinite(d) and d < best_d:
                    best_d, best_n = d, n
        return best_d, best_n

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, np.float64)
        out = np.empty((len(obs), self.spec.act_dim), np.float32)
        for k, o in enumerate(obs):
            d, n = self._nearest(o)
            if self._steer is not None:
                controller, setpoint = self._steer
                steered = o.astype(np.float32).copy()
                # One steered position (the set-point's): aim past the boundary.
                steered[setpoint] = o[self._pos[0]] + (d + _OVERSHOOT) * n[0]
                out[k] = controller(steered[None])[0]
            else:
                push = n @ self._dv  # closing acceleration per unit of each action
                out[k] = np.where(push > 0, self._high, np.where(push < 0, self._low, 0.0))
        return out


def reference_policy(name: str, cfg, spec: ShieldSpec, seed: int = 0):
    """The `--policy` choices: legacy (the task's controller), random, adversarial."""
    import envs

    task = envs.task(cfg.task.env_id)
    if name == "legacy":
        return task.make_legacy()
    if name == "random":
        return RandomPolicy(spec.action_low, spec.action_high, seed)
    if name == "adversarial":
        # A plant that would fall over under a plain full-action push (the cart-pole) declares a
        # set-point through which the adversary steers its legacy controller at the boundary instead.
        steer = None if task.steerable_setpoint is None else (task.make_legacy(), task.steerable_setpoint)
        return AdversarialPolicy(spec, steer)
    raise ValueError(f"unknown reference policy {name!r}; choose legacy, random or adversarial")


def evaluate(cfg, policy, *, domains: Any = "train", episodes: int = 20, seed: int = 0, shield: bool = True,
             spec: dict | ShieldSpec | None = None, max_episode_steps: int | None = None,
             progress: bool = False) -> dict:
    """Run `policy` for `episodes` seeded episodes (seeds seed, seed + 1, ...); returns returns, violations and
    shield figures. `policy` is a batch policy, shielded here by `spec` (default: built from the config), or an
    EdgeRuntime, which brings its own shield (shield.json) and is run exactly as `serve` runs it."""
    from shield.runtime import EdgeRuntime

    if isinstance(policy, EdgeRuntime):
        if shield != policy.shielded:  # the same bundle, with its shield.json's shield or bare
            own = CbfShield(ShieldSpec.from_dict(policy.bundle.shield_spec)) if shield else None
            policy = EdgeRuntime(policy.bundle, policy.policy, own)
        driver = RuntimeDriver(policy)
    else:
        if shield and spec is None:
            from pipeline.safety.shield_spec import build_shield_spec

            spec = build_shield_spec(cfg)
        if shield:
            spec = spec if isinstance(spec, ShieldSpec) else ShieldSpec.from_dict(spec)
        driver = PolicyDriver(policy, CbfShield(spec) if shield else None)
    env = make_env(cfg, resolve_domains(cfg, domains), max_episode_steps)
    try:
        totals = run_episodes(env, driver, list(range(seed, seed + episodes)), dt=control_period_s(cfg),
                              progress="eval" if progress else None)
    finally:
        env.close()
    return {"task": cfg.task.name, "domains": domains_label(domains), "shield": bool(shield), "seed": seed,
            **totals.summary()}


def run_cli(args) -> int:
    """Handler of `sim2real eval`: prints a summary (or one JSON object with --json); 0 on success, 2 on bad input."""
    from pipeline.config import ConfigError, load_config
    from shield.spec import ShieldSpecError

    try:
        cfg = load_config(args.config)
        if bool(args.bundle) == bool(args.policy):
            raise ValueError("give exactly one of BUNDLE or --policy legacy|random|adversarial")
        if args.episodes < 1:
            raise ValueError(f"--episodes must be >= 1, got {args.episodes}")
        spec = None
        resolve_domains(cfg, args.domains)  # fail on a bad --domains before any episode runs
        use_shield = cfg.shield.enabled and not args.no_shield
        if args.bundle:
            from shield.runtime import BundleError, EdgeRuntime

            try:  # the bundle's own shield.json, exactly as `serve` runs it
                policy = EdgeRuntime.load(args.bundle, shield=use_shield)
            except BundleError as err:
                raise ValueError(str(err)) from None
        else:
            from pipeline.safety.shield_spec import build_shield_spec

            spec = ShieldSpec.from_dict(build_shield_spec(cfg))
            policy = reference_policy(args.policy, cfg, spec, seed=args.seed)
        result = evaluate(cfg, policy, domains=args.domains, episodes=args.episodes, seed=args.seed,
                          shield=use_shield, spec=spec, progress=not args.json and args.episodes > 1)
    except (ConfigError, ShieldSpecError, ValueError) as err:  # DomainsError and UnknownTaskError are ValueErrors
        print(f"sim2real eval: error: {err}", file=sys.stderr)
        return 2
    result["policy"] = args.bundle or args.policy
    if args.json:
        print(json.dumps(result))
    else:
        for key in ("policy", "task", "domains", "shield", "episodes", "return_mean", "return_std", "violations",
                    "violation_episodes", "intervention_rate", "fallbacks", "shield_us_p50", "shield_us_p99"):
            print(f"{key:>20}: {result[key]}")
    return 0
