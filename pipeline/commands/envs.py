"""`sim2real envs`: the tasks with their sizes, constraints and legacy controller."""

from __future__ import annotations

import argparse

from pipeline.commands import command, emit


@command("envs")
def run(args: argparse.Namespace) -> int:
    import envs

    tasks = envs.describe_tasks()
    lines = []
    for t in tasks:
        lines.append(f"{t['env_id']}  (task {t['task']})")
        lines.append(f"  obs {t['obs_dim']}  act {t['act_dim']}  control period {t['dt']} s")
        lines.append(f"  constraints: {', '.join(t['constraints'])}")
        lines.append(f"  legacy controller: {t['legacy']}")
    emit(args, {"tasks": tasks}, "\n".join(lines))
    return 0
