"""`sim2real envs`: the tasks with their sizes, constraints and legacy controller.

A plant declared outside the config folders is a task like the shipped ones: `--config FILE` (repeatable)
declares it for this listing, and tasks that have bundles in the registry are listed with their versions,
also when their YAML is not among the config folders (the listing then says how to declare it here).
"""

from __future__ import annotations

import argparse

from pipeline.commands import command, emit


def _registered(root: str) -> dict[str, dict]:
    """task -> {env_id, versions, production} for every task with a bundle in the registry at `root`."""
    from pipeline.deployment.registry import Registry, RegistryError

    registry, found = Registry(root), {}
    for name in registry.tasks():
        versions = registry.versions(name)
        if not versions:
            continue
        try:
            env_id = registry.show(name, versions[-1]).get("env_id")
        except (RegistryError, OSError, ValueError):
            env_id = None  # a damaged bundle is `registry verify`'s to report; the task is still listed
        found[name] = {"env_id": env_id, "versions": versions, "production": registry.production(name)}
    return found


@command("envs")
def run(args: argparse.Namespace) -> int:
    import envs
    from pipeline.config import load_config

    for path in args.config or []:
        load_config(path)  # declares (and checks) the plant: a ConfigError names the key
    tasks = envs.describe_tasks()
    registered = _registered(args.registry)
    by_name = {t["task"]: t for t in tasks}
    for name, reg in registered.items():
        if name in by_name:
            by_name[name]["registry"] = reg
        else:
            tasks.append({"task": name, "env_id": reg["env_id"], "registry": reg, "declared_here": False})
    lines = []
    for t in tasks:
        lines.append(f"{t['env_id']}  (task {t['task']})")
        reg = t.get("registry")
        if t.get("declared_here") is False:
            lines.append(
                f"  only in the registry ({args.registry}/): its YAML is not among the config folders; "
                f"`sim2real envs --config YOUR.yaml` declares it here"
            )
        else:
            lines.append(f"  obs {t['obs_dim']}  act {t['act_dim']}  control period {t['dt']} s  ({t['config']})")
            lines.append(f"  constraints: {', '.join(t['constraints'])}")
            lines.append(f"  legacy controller: {t['legacy']}")
        if reg:
            prod = f", production v{reg['production']}" if reg["production"] else ", no production version"
            lines.append(f"  registry: versions {', '.join(map(str, reg['versions']))}{prod}")
    emit(args, {"tasks": tasks}, "\n".join(lines))
    return 0
