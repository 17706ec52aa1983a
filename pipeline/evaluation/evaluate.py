"""`sim2real eval`: run a policy (bundle, legacy, random or adversarial) on randomized domains, with or without the shield.

`evaluate(cfg, policy, ...)` is the reusable part (benches and tests call it);
`run_cli(args)` is the CLI handler. The episodes run in the one episode runner
(`pipeline.evaluation.episodes`), so eval, shadow and the benches measure the
same way: a violation is a step whose `info["cost"]` is 1.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# The reference policies live in pipeline.evaluation.adversary (re-exported here for callers).
from pipeline.evaluation.adversary import reference_policy  # noqa: F401
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
