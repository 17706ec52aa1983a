"""`sim2real eval`: a bundle or a reference policy on randomized domains, with or without the shield."""

from __future__ import annotations

import argparse

from pipeline.commands import UsageError, command, emit

_SUMMARY_KEYS = (
    "policy",
    "task",
    "domains",
    "shield",
    "episodes",
    "return_mean",
    "return_std",
    "terminated_episodes",
    "held_episodes",
    "violations",
    "violation_episodes",
    "intervention_rate",
    "fallbacks",
    "fallback_starts",
    "backup_rate",
    "envelope_rate",
    "shield_us_p50",
    "shield_us_p99",
)


@command("eval")
def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.evaluation.adversary import REFERENCE_POLICIES
    from pipeline.evaluation.episodes import constraint_lines, resolve_domains
    from pipeline.evaluation.evaluate import UNCERTIFIED_NOTE, evaluate, reference_policy
    from shield.spec import ShieldSpec

    cfg = load_config(args.config)
    if bool(args.bundle) == bool(args.policy):
        raise UsageError(f"give exactly one of BUNDLE or --policy {'|'.join(REFERENCE_POLICIES)}")
    if args.episodes < 1:
        raise UsageError(f"--episodes must be >= 1, got {args.episodes}")
    spec = None
    resolve_domains(cfg, args.domains)  # fail on a bad --domains before any episode runs
    use_shield = cfg.shield.enabled and not args.no_shield
    if args.bundle:
        from shield.runtime import EdgeRuntime

        policy = EdgeRuntime.load(args.bundle, shield=use_shield)  # the bundle's own shield.json, as `serve` runs it
    else:
        from pipeline.evaluation.monitor_bounds import bundle_spec
        from pipeline.safety.shield_spec import build_shield_spec

        # Shielded: the shield a bundle of this config carries (its monitor's bounds measured). Bare, the spec only
        # tells the adversary where the limits are and which way each action pushes, so a plant whose envelope the
        # shield cannot certify is still measured without it (which is how its owner sees what it was refused for).
        spec = ShieldSpec.from_dict(bundle_spec(cfg) if use_shield else build_shield_spec(cfg, bare=True))
        policy = reference_policy(args.policy, cfg, spec, seed=args.seed)
    result = evaluate(
        cfg,
        policy,
        domains=args.domains,
        episodes=args.episodes,
        seed=args.seed,
        shield=use_shield,
        spec=spec,
        progress=not args.json and args.episodes > 1,
        past_termination=args.past_termination,
    )
    result["policy"] = args.bundle or args.policy
    if spec is not None and use_shield:
        result["notes"].insert(0, UNCERTIFIED_NOTE)  # the config's shield, not a bundle's: nothing certified it
    emit(
        args,
        result,
        "\n".join(
            [
                *(f"note: {line}" for line in result["notes"]),
                # Solve times are wall clock: on a machine busy with other work they measure the machine (the
                # gate's latency check reads the thread's CPU time instead).
                *(f"{key:>20}: {result[key]}" + (" (wall clock)" if "_us_" in key else "") for key in _SUMMARY_KEYS),
                *constraint_lines(result.get("constraints", {})),
            ]
        ),
    )
    return 0
