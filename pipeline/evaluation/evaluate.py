"""`sim2real eval`: run a policy (bundle, legacy, random or adversarial) on randomized domains, with or without the shield.

`evaluate(cfg, policy, ...)` is the reusable part (shadow mode and tests call
it); `run_cli(args)` is the CLI handler. Safety is measured the same way
everywhere: a violation is a step whose `info["cost"]` is 1.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import yaml

from shield.cbf import CbfShield
from shield.spec import ShieldSpec

# Tasks whose plant falls over under a full-action push (ending the episode
# before any constraint is reached): the adversary there is the legacy
# controller steered to a set-point beyond the nearest constraint, so it keeps
# the plant up while driving it at the boundary. Value: the set-point's obs index.
_STEERED_SETPOINT = {"sim2real/CartPoleRail-v0": 4}
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

    env_id = cfg.task.env_id
    if name == "legacy":
        return envs.legacy_controller(env_id)
    if name == "random":
        return RandomPolicy(spec.action_low, spec.action_high, seed)
    if name == "adversarial":
        steer = (envs.legacy_controller(env_id), _STEERED_SETPOINT[env_id]) if env_id in _STEERED_SETPOINT else None
        return AdversarialPolicy(spec, steer)
    raise ValueError(f"unknown reference policy {name!r}; choose legacy, random or adversarial")


def resolve_domains(cfg, domains: Any):
    """A set name from the config, `nominal` (no randomization), a RandomizationSet, or a YAML file holding one set."""
    from envs.randomization import RandomizationSet, parse_randomization

    if domains is None or domains == "nominal":
        return None
    if isinstance(domains, RandomizationSet):
        return domains
    if domains in cfg.randomization:
        return cfg.randomization[domains]
    path = Path(str(domains))
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"--domains {domains!r}: not a set in the config ({sorted(cfg.randomization)}) nor a .yaml file")
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ValueError(f"--domains {path}: cannot read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--domains {path}: not valid YAML: {err}") from None
    return parse_randomization(doc, where=str(path))


def evaluate(cfg, policy, *, domains: Any = "train", episodes: int = 20, seed: int = 0, shield: bool = True,
             spec: dict | ShieldSpec | None = None, max_episode_steps: int | None = None,
             progress: bool = False) -> dict:
    """Run `policy` (batch interface) for `episodes` seeded episodes; returns returns, violations and shield figures."""
    import envs  # noqa: F401  (registers the task ids)

    if spec is None:
        from pipeline.safety.shield_spec import build_shield_spec

        spec = build_shield_spec(cfg)
    spec = spec if isinstance(spec, ShieldSpec) else ShieldSpec.from_dict(spec)
    rset = resolve_domains(cfg, domains)
    steps_cap = max_episode_steps or cfg.task.max_episode_steps
    kwargs = {"max_episode_steps": steps_cap} if steps_cap else {}
    env = gym.make(cfg.task.env_id, randomization=rset, **kwargs)
    cbf = CbfShield(spec) if shield else None
    returns, lengths, violation_steps, solve_us = [], [], [], []
    interventions = fallbacks = bad_inputs = 0
    bar = _progress(episodes, progress)
    try:
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            if hasattr(policy, "reset"):
                policy.reset()
            if cbf is not None:
                cbf.reset()
            total, violations, steps, done = 0.0, 0, 0, False
            while not done:
                action = np.asarray(policy(np.asarray(obs, np.float32)[None]), np.float32).reshape(-1)
                if cbf is not None:
                    action, info = cbf.filter(np.asarray(obs, np.float32), action)
                    interventions += info["intervened"]
                    fallbacks += info["fallback"]
                    bad_inputs += info["bad_input"]
                    solve_us.append(info["solve_us"])
                obs, reward, terminated, truncated, step_info = env.step(action)
                total += float(reward)
                violations += int(step_info.get("cost", 0.0) > 0.0)
                steps += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(steps)
            violation_steps.append(violations)
            if bar is not None:
                bar.update(1)
    finally:
        env.close()
        if bar is not None:
            bar.close()
    n_steps = int(sum(lengths))
    us = np.asarray(solve_us) if solve_us else np.zeros(1)
    return {
        "task": cfg.task.name, "domains": domains if isinstance(domains, str) else "custom",
        "shield": bool(shield), "episodes": episodes, "seed": seed, "steps": n_steps,
        "return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)),
        "episode_length_mean": float(np.mean(lengths)),
        "violations": int(sum(violation_steps)),
        "violation_episodes": int(sum(v > 0 for v in violation_steps)),
        "intervention_rate": interventions / max(n_steps, 1),
        "fallbacks": int(fallbacks), "bad_inputs": int(bad_inputs),
        "shield_us_p50": float(np.percentile(us, 50)) if shield else 0.0,
        "shield_us_p99": float(np.percentile(us, 99)) if shield else 0.0,
        "returns": [float(r) for r in returns],
    }


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="ep", file=sys.stderr, desc="eval")


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
        if args.bundle:
            from shield.runtime import BundleError, EdgeRuntime

            try:
                runtime = EdgeRuntime.load(args.bundle, shield=False)  # the shield is applied here, from shield.json
            except BundleError as err:
                raise ValueError(str(err)) from None
            spec = ShieldSpec.from_dict(runtime.bundle.shield_spec)
            policy = runtime
        else:
            from pipeline.safety.shield_spec import build_shield_spec

            spec = ShieldSpec.from_dict(build_shield_spec(cfg))
            policy = reference_policy(args.policy, cfg, spec, seed=args.seed)
        resolve_domains(cfg, args.domains)  # fail on a bad --domains before any episode runs
        use_shield = cfg.shield.enabled and not args.no_shield
        result = evaluate(cfg, policy, domains=args.domains, episodes=args.episodes, seed=args.seed,
                          shield=use_shield, spec=spec, progress=not args.json and args.episodes > 1)
    except (ConfigError, ShieldSpecError, ValueError) as err:
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
