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
from typing import Any

import gymnasium as gym
import numpy as np
import yaml

from shield.cbf import CbfShield
from shield.spec import ShieldSpec

# The reference policies live in pipeline.evaluation.adversary (re-exported here for callers).
from pipeline.evaluation.adversary import AdversarialPolicy, RandomPolicy, reference_policy  # noqa: E402,F401


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
    interventions = fallbacks = bad_inputs = envelope_flags = 0
    min_h = float("inf")  # the shield's lowest barrier value seen (falsify's objective)
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
                    envelope_flags += info.get("envelope", False)
                    if len(info["h"]):
                        min_h = min(min_h, float(np.min(info["h"])))
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
        "envelope_rate": envelope_flags / max(n_steps, 1),  # share of steps the assumption monitor flagged
        "min_h": min_h if math.isfinite(min_h) else None,
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
