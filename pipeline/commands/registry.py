"""`sim2real registry list|show|promote|rollback|verify`: the model registry in models/ (exit 1 when verify fails).

`list` says, for each version, why it was or was not promoted: the gate's verdict the retrain flow recorded
in its manifest ("kept v3: v4 not better (...)"), and the production pointer's logged move that put it in or
took it out where that was not the gate's own (a promotion by hand, --force, a rollback)."""

from __future__ import annotations

import argparse

from pipeline.commands import CHECK_FAILED, OK, UsageError, command, emit


@command("registry")
def run(args: argparse.Namespace) -> int:
    from pipeline.deployment.registry import Registry

    registry = Registry(args.root)
    cmd, task, version = args.registry_cmd, getattr(args, "task", None), getattr(args, "version", None)
    if cmd == "list":
        tasks = [task] if task else registry.tasks()
        logs = {t: (registry.pointer(t) or {}).get("log", []) for t in tasks}
        rows = [{**r, "why": why(r, logs[r["task"]])} if "error" not in r else r for r in registry.list(task)]
        out = {"versions": rows, "production": {t: registry.production(t) for t in tasks}, "pointer_log": logs}
        emit(args, out, _format_list(rows))
    elif cmd == "show":
        info = registry.show(task, version)
        log = (registry.pointer(task) or {}).get("log", [])
        emit(args, info, _format_show(info, why({**info, "version": version}, log)))
    elif cmd == "promote":
        from shield.bundle import gate_failures, gate_said

        manifest = registry.show(task, version)
        found = gate_failures(manifest)
        gated = ((manifest.get("metrics") or {}).get("gate") or {}).get("decision") is not None
        forced = None
        if registry.production(task) != version:  # promoting production again moves nothing: nothing to refuse
            if found is not None:
                forced = f"--force past its gate decision {found[0]!r}"
                why_not = (
                    f"its gate decision was {gate_said(found)}, so production would run a policy the gate did not pass"
                )
            elif (beat := _beaten_by_production(registry, task, version)) is not None:
                forced = f"--force past v{beat}'s gate, which beat it"
                why_not = (
                    f"production v{beat} was promoted over it: v{beat}'s gate showed it better than v{version} in the "
                    f"same episodes, so this would put back the version the gate replaced. Stepping back on purpose "
                    f"is `sim2real registry rollback {task}` (the log records it as one)"
                )
            elif not gated:
                forced = "--force: never gated"
                why_not = (
                    "it was never gated (registered by `sim2real export`, outside the retrain flow), so production "
                    "would run a policy nothing judged against legacy or production. `sim2real shadow "
                    f"{registry.bundle_dir(task, version)} --config CONFIG"
                    + (
                        f" --production {registry.bundle_dir(task, registry.production(task))}"
                        if registry.production(task) is not None
                        else ""
                    )
                    + "` shows what its gate says (it records nothing in the registry); a version the retrain "
                    "flow registers (`sim2real run`) carries its gate"
                )
            if forced is not None and not getattr(args, "force", False):
                raise UsageError(
                    f"{task} v{version}: {why_not}. `sim2real registry show {task} {version}` says why; --force "
                    "promotes it anyway (the production log records it)"
                )
        was = registry.promote(task, version, by="hand", note=forced)
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


def _beaten_by_production(registry, task: str, version: int) -> int | None:
    """The production version, where its own gate passed against `version` as the production it replaced."""
    production = registry.production(task)
    if production is None:
        return None
    gate = (registry.show(task, production).get("metrics") or {}).get("gate") or {}
    return production if gate.get("decision") == "pass" and gate.get("against_production") == version else None


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
        lines.append(f"{'':<17} why: {r['why']}")
    return "\n".join(lines)


def _format_show(m: dict, reason: str) -> str:
    """One version in a screenful: what it is, where it came from, its gate and why it is (not) in production, its
    I/O contract; --json prints the whole manifest."""
    from shield.contract import describe

    metrics, extra = m.get("metrics") or {}, m.get("extra") or {}
    gate, train = metrics.get("gate") or {}, metrics.get("train") or {}
    lines = [
        f"{m['task']} v{m['version']}{'  (production)' if m['production'] else ''}  {m['path']}",
        f"  created {m['created_utc'][:19]}  registered {str(m.get('registered_utc', '-'))[:19]}  "
        f"parent {m.get('parent') or '-'}  config {m['config_hash'][:12]}  git {str(m.get('git_commit'))[:12]}",
    ]
    if train:
        lines.append(
            f"  trained: {train.get('algorithm')}, {train.get('env_steps')} env steps, selected at update "
            f"{train.get('best_updates')} (validation return {train.get('best_validation_return')})"
        )
    if extra.get("prefect_flow_run_id"):
        lines.append(f"  flow run: {extra['prefect_flow_run_id']}")
    lines.append(f"  why: {reason}")
    if gate.get("decision"):
        lines.append(f"  gate: {gate['decision']}")
        lines += [f"    {r}" for r in gate.get("reasons", [])]
        lines += [f"    loosened: {k}" for k in gate.get("loosened", [])]
    lines += [f"  {line}" for line in describe(m.get("contract"))]
    lines += [f"  {name}: sha256 {digest[:16]}..." for name, digest in sorted(m["files"].items())]
    lines.append("  (--json prints the whole manifest)")
    return "\n".join(lines)


def why(row: dict, log: list[dict] = ()) -> str:
    """Why a listed version is or is not in production: the gate's recorded verdict (else what is known), and the
    pointer's last move to or away from it when that was not the gate's own promotion."""
    gate = (row.get("metrics") or {}).get("gate") or {}
    said = gate.get("verdict") or (f"gate {gate['decision']}" if gate.get("decision") else None)
    if said is None:
        said = "no gate verdict recorded (registered outside the retrain flow)"
    v = row["version"]
    moves = [m for m in log if v in (m.get("version"), m.get("previous"))]
    last = moves[-1] if moves else None
    if row["production"]:
        if last is not None and last.get("version") == v and not (last["action"] == "promote" and last["by"] == "gate"):
            said += f"; {_move(last)}"
        elif last is None and gate.get("decision") != "pass":
            said += "; in production by `sim2real registry promote` or `rollback`"
    elif last is not None and last.get("previous") == v:
        # The move that put it in too, where it was not the gate's (helper-55: a --force promotion later rolled
        # back left only the rollback in the listing).
        put = next((m for m in reversed(moves[:-1]) if m.get("version") == v), None)
        if put is not None and not (put["action"] == "promote" and put["by"] == "gate"):
            said += f"; entered production: {_move(put)}"
        said += f"; left production: {_move(last)}"
    return said


def _move(m: dict) -> str:
    """One logged move of the production pointer, in words."""
    when = m["utc"][:19]
    if m["action"] == "rollback":
        return f"rolled back to v{m['version']} from v{m['previous']} by hand {when}"
    how = "by the gate" if m["by"] == "gate" else "by hand (`sim2real registry promote`)"
    note = f", {m['note']}" if m.get("note") else ""
    return f"v{m['version']} promoted {how}{note} {when}"
