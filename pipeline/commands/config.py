"""`sim2real config`: document every config key, or validate a file (`--check FILE`)."""

from __future__ import annotations

import argparse

from pipeline.commands import command, emit


@command("config")
def run(args: argparse.Namespace) -> int:
    from pipeline.config import describe_fields, load_config

    if args.check:
        cfg = load_config(args.check)
        if cfg.shield.enabled:  # every randomization set must lie inside the shield's assumptions
            from pipeline.safety.shield_spec import build_shield_spec

            build_shield_spec(cfg)  # EnvelopeError (a ConfigError) names set, parameter, range and limit
        from pipeline.training.rollout import preflight

        preflight(cfg)  # every set runs the env once, the legacy controller answers: or the key to change
        emit(
            args,
            {"ok": True, "task": cfg.task.name, "config_hash": cfg.config_hash()},
            f"{args.check}: ok (task {cfg.task.name}, hash {cfg.config_hash()[:12]})",
        )
        return 0
    rows = describe_fields()
    width = max(len(k) for k, *_ in rows)
    human = "\n".join(f"{k:<{width}}  {d}" + (f"  ({t}, default {v})" if v else f"  ({t})") for k, t, v, d in rows)
    emit(args, {"fields": [{"key": k, "type": t, "default": v, "description": d} for k, t, v, d in rows]}, human)
    return 0
