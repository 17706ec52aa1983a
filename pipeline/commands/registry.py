"""`sim2real registry list|show|promote|rollback|verify`: the model registry in models/ (exit 1 when verify fails).

`list` says, for each version, why it was or was not promoted: the gate's verdict the retrain flow recorded
in its manifest ("kept v3: v4 not better (...)"), or how it got there otherwise."""

from __future__ import annotations

import argparse
import json

from pipeline.commands import CHECK_FAILED, OK, UsageError, command, emit


@command("registry")
def run(args: argparse.Namespace) -> int:
    from pipeline.deployment.registry import Registry

    registry = Registry(args.root)
    cmd, task, version = args.registry_cmd, getattr(args, "task", None), getattr(args, "version", None)
    if cmd == "list":
        rows = [{**r, "why": why(r)} if "error" not in r else r for r in registry.list(task)]
        out = {
            "versions": rows,
            "production": {t: registry.production(t) for t in ([task] if task else registry.tasks())},
        }
        emit(args, out, _format_list(rows))
    elif cmd == "show":
        info = registry.show(task, version)
        emit(args, info, json.dumps(info, indent=2, sort_keys=True))
    elif cmd == "promote":
        from shield.bundle import gate_failures

        found = gate_failures(registry.show(task, version))
        if found is not None and not getattr(args, "force", False):
            decision, failing = found
            what = f" ({', '.join(failing)} failed)" if failing else ""
            raise UsageError(
                f"{task} v{version}: its gate decision was {decision!r}{what}, so production would run a policy the "
                f"gate did not pass. `sim2real registry show {task} {version}` says why; --force promotes it anyway"
            )
        was = registry.promote(task, version)
        emit(
            args,
            {"task": task, "production": version, "previous": was},
            f"{task}: production -> {version} (was {was if was is not None else 'none'})",
        )
    elif cmd == "rollback":
        was = registry.production(task)
        now = registry.rollback(task)
        emit(args, {"task": task, "production": now, "previous": was}, f"{task}: production rolled back {was} -> {now}")
    elif cmd == "verify":
        return _verify(args, registry, task, version)
    else:
        raise UsageError(f"unknown registry command {cmd!r}")
    return OK


def _verify(args: argparse.Namespace, registry, task: str | None, version: int | None) -> int:
    """Every file hash of one version, a task's versions or every task's; a mismatch is named and exits 1."""
    from pipeline.deployment.registry import RegistryError
    from shield.bundle import BundleError

    results = []
    for name in [task] if task else registry.tasks():
        try:
            checked = registry.verify(name, version)
            results.append({"task": name, "ok": True, "versions": checked})
        except (BundleError, RegistryError) as err:  # the finding this command reports, not a usage error
            results.append({"task": name, "ok": False, "error": str(err)})
    lines = [
        f"{r['task']}: ok ({len(r['versions'])} version(s))" if r["ok"] else f"{r['task']}: FAILED\n  {r['error']}"
        for r in results
    ]
    ok = all(r["ok"] for r in results)
    emit(args, {"ok": ok, "tasks": results}, "\n".join(lines) or "registry is empty")
    return OK if ok else CHECK_FAILED


def _format_list(rows: list[dict]) -> str:
    if not rows:
        return "no versions registered"
    lines = [f"{'TASK':<12} {'VER':>4} {'PROD':<4} {'CREATED (UTC)':<20} {'PARENT':>6}  CONFIG"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['task']:<12} {r['version']:>4} {'*' if r['production'] else '':<4} ERROR: {r['error']}")
            continue
        lines.append(
            f"{r['task']:<12} {r['version']:>4} {'*' if r['production'] else '':<4} "
            f"{r['created_utc'][:19]:<20} {str(r['parent'] or '-'):>6}  {r['config_hash'][:12]}"
        )
        lines.append(f"{'':<17} why: {why(r)}")
    return "\n".join(lines)


def why(row: dict) -> str:
    """Why a listed version is or is not in production: the gate's recorded verdict, else what is known."""
    gate = (row.get("metrics") or {}).get("gate") or {}
    said = gate.get("verdict") or (f"gate {gate['decision']}" if gate.get("decision") else None)
    promoted_by_gate = gate.get("decision") == "pass"
    if said is None:
        said = "no gate verdict recorded (registered outside the retrain flow)"
    if row["production"] and not promoted_by_gate:
        said += "; in production by `sim2real registry promote` or `rollback`"
    return said
