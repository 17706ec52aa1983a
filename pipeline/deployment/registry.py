"""The model registry on disk: `models/<task>/<version>/` bundles and a production pointer.

Layout (documented for users in models/README.md)::

    models/<task>/1/ 2/ 3/ ...   bundles (policy.onnx, shield.json, manifest.json)
    models/<task>/production     JSON pointer: version, pinned file hashes, history
    models/<task>/.lock          advisory lock held while writing

Crash safety: every write is a temp file/dir + fsync + rename + directory fsync,
made under an exclusive `flock` on the task's `.lock` (released by the kernel
if the writer dies). A version dir therefore appears whole or not at all, and
the pointer is replaced in one rename, only after the bundle it names has been
verified. Half-written leftovers (`.*.staging-*`, `.production.*.tmp`) of a
killed writer are invisible to readers and removed by the next writer.

Versions are integers that only increase. The pointer's `history` is the stack
of previously promoted versions, which `rollback` pops; its `log` lists every
move of the pointer (promote or rollback, when, by the gate or by hand).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from shield.bundle import (
    MANIFEST_FILE,
    PRODUCTION_FILE,
    Bundle,
    BundleError,
    atomic_write_bytes,
    check_pinned,
    json_safe,
    manifest_bytes,
    parse_manifest,
    read_production,
    seal_manifest,
    utc_now,
    verify_bundle,
    write_bundle,
)

_TASK = re.compile(r"^[a-z][a-z0-9_-]*$")


class RegistryError(RuntimeError):
    """A registry operation cannot be done (unknown task or version, nothing to roll back to)."""


class ProductionMoved(RegistryError):
    """A promotion conditional on the production version it was judged against found another one there."""


_UNCHECKED = object()


class Registry:
    """Bundles of every task under one root directory, with a production pointer per task."""

    def __init__(self, root: str | Path = "models"):
        self.root = Path(root)

    # ------------------------------------------------------------------ reading
    def task_dir(self, task: str) -> Path:
        """Directory of a task's versions (the name is checked: no path tricks)."""
        if not isinstance(task, str) or not _TASK.match(task):
            raise RegistryError(f"invalid task name {task!r} (lowercase letters, digits, - and _)")
        return self.root / task

    def tasks(self) -> list[str]:
        """Tasks that have a directory in the registry."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _TASK.match(p.name))

    def versions(self, task: str) -> list[int]:
        """Registered versions of `task`, ascending (staging leftovers are not versions)."""
        task_dir = self.task_dir(task)
        if not task_dir.is_dir():
            return []
        return sorted(int(p.name) for p in task_dir.iterdir() if p.name.isdigit() and p.is_dir())

    def next_version(self, task: str) -> int:
        """The version `register` would give the task's next bundle now (a registration in between takes it)."""
        return max(self.versions(task), default=0) + 1

    def bundle_dir(self, task: str, version: int) -> Path:
        """Directory of one registered version; RegistryError if it does not exist."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise RegistryError(f"{task}: version must be a positive integer, got {version!r}")
        path = self.task_dir(task) / str(version)
        if not path.is_dir():
            known = ", ".join(map(str, self.versions(task))) or "none"
            raise RegistryError(f"{task}: version {version} does not exist (registered: {known})")
        return path

    def production(self, task: str) -> int | None:
        """The version production points to, or None."""
        pointer = read_production(self.task_dir(task))
        return None if pointer is None else pointer["version"]

    def pointer(self, task: str) -> dict | None:
        """The whole production pointer (version, pinned hashes, history), or None."""
        return read_production(self.task_dir(task))

    def show(self, task: str, version: int) -> dict:
        """One version's manifest (digest-checked), plus its path and whether it is in production."""
        path = self.bundle_dir(task, version)
        manifest = parse_manifest((path / MANIFEST_FILE).read_bytes(), f"{MANIFEST_FILE} in {path}")
        return {**manifest, "path": str(path), "production": self.production(task) == version}

    def list(self, task: str | None = None) -> list[dict]:
        """A row per version (task, version, production, created, parent, config hash, metrics)."""
        rows = []
        for name in [task] if task else self.tasks():
            prod = self.production(name)
            for version in self.versions(name):
                row = {"task": name, "version": version, "production": version == prod}
                try:
                    m = self.show(name, version)
                    row.update(
                        created_utc=m["created_utc"],
                        parent=m["parent"],
                        config_hash=m["config_hash"],
                        git_commit=m["git_commit"],
                        metrics=m["metrics"],
                    )
                except (BundleError, OSError) as err:
                    row["error"] = str(err)
                rows.append(row)
        return rows

    def verify(self, task: str, version: int | None = None) -> list[int]:
        """Check every hash of one version (or all, and the pointer); BundleError naming each bad file."""
        if not self.task_dir(task).is_dir():
            raise RegistryError(f"unknown task {task!r}: no {self.task_dir(task)}")
        versions = [version] if version is not None else self.versions(task)
        failures = []
        for v in versions:
            try:
                verify_bundle(self.bundle_dir(task, v))
            except BundleError as err:
                failures.append(f"{task} v{v}: {err}")
        if version is None:
            try:
                self._check_pointer(task)
            except (BundleError, RegistryError) as err:
                failures.append(f"{task} production: {err}")
        if failures:
            raise BundleError("\n".join(failures))
        return versions

    def _check_pointer(self, task: str) -> None:
        pointer = self.pointer(task)
        if pointer is not None:
            path = self.bundle_dir(task, pointer["version"])
            check_pinned(path, verify_bundle(path), pointer)

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def _locked(self, task: str, create: bool = False) -> Iterator[Path]:
        task_dir = self.task_dir(task)
        if create:
            task_dir.mkdir(parents=True, exist_ok=True)
        elif not task_dir.is_dir():
            raise RegistryError(
                f"unknown task {task!r}: no {task_dir} (registered tasks: {', '.join(self.tasks()) or 'none'})"
            )
        with open(task_dir / ".lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                _remove_leftovers(task_dir)
                yield task_dir
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def register(self, bundle_dir: str | Path, metrics: dict | None = None, extra: dict | None = None) -> int:
        """Copy a verified bundle in as the task's next version (not promoted); return the version."""
        source = Bundle.load(bundle_dir)
        manifest = dict(source.manifest)
        manifest["metrics"] = {**manifest.get("metrics", {}), **json_safe(metrics or {})}
        manifest["extra"] = {**manifest.get("extra", {}), **json_safe(extra or {})}
        with self._locked(source.task, create=True) as task_dir:
            version = self.next_version(source.task)
            manifest.update(version=version, registered_utc=utc_now())
            write_bundle(
                task_dir / str(version),
                policy_onnx=source.policy_onnx,
                shield_spec=source.shield_json,
                manifest=seal_manifest(manifest),
            )
            verify_bundle(task_dir / str(version))
        return version

    def annotate(self, task: str, version: int, metrics: dict | None = None, extra: dict | None = None) -> dict:
        """Merge metrics (e.g. shadow/gate results, a flow-run id) into a version's manifest, atomically."""
        with self._locked(task):
            path = self.bundle_dir(task, version)
            manifest = verify_bundle(path)
            manifest["metrics"] = {**manifest["metrics"], **json_safe(metrics or {})}
            manifest["extra"] = {**manifest.get("extra", {}), **json_safe(extra or {})}
            sealed = seal_manifest(manifest)
            atomic_write_bytes(path / MANIFEST_FILE, manifest_bytes(sealed))
        return sealed

    def promote(
        self, task: str, version: int, *, by: str = "hand", note: str | None = None, expected_production=_UNCHECKED
    ) -> int | None:
        """Point production at `version` (verified first); return the version it replaced. `by` (the retrain
        flow's gate, or a hand) and `note` go into the pointer's log, which `registry list` reads back.
        `expected_production` (a version, or None for none): the production the candidate was judged against;
        another one there (a night that ran beside this one promoted first) raises ProductionMoved, and nothing
        moves: the candidate was never compared with it."""
        with self._locked(task) as task_dir:
            path = self.bundle_dir(task, version)
            manifest = verify_bundle(path)
            old = read_production(task_dir)
            if old and old["version"] == version:
                return version  # already there (a retried flow step): no move to log
            now = old["version"] if old else None
            if expected_production is not _UNCHECKED and now != expected_production:
                judged = f"v{expected_production}" if expected_production is not None else "no production"
                raise ProductionMoved(
                    f"{task}: production is v{now}, but v{version} was judged against {judged}; it was never "
                    f"compared with v{now}, so it is not promoted (`sim2real shadow` with --production, or the "
                    f"next night, judges it against v{now})"
                )
            history = [*old.get("history", []), old["version"]] if old else []
            self._write_pointer(task_dir, version, manifest, history, old, "promote", by, note)
        return old["version"] if old else None

    def rollback(self, task: str) -> int:
        """Move production back to the previously promoted version; return that version."""
        with self._locked(task) as task_dir:
            old = read_production(task_dir)
            if old is None:
                raise RegistryError(f"{task}: nothing to roll back, no version is in production")
            history = [v for v in old["history"] if v != old["version"]]
            if not history:
                raise RegistryError(
                    f"{task}: nothing to roll back to from v{old['version']}: no promotion before it is left to step "
                    f"back to (each rollback steps back once and uses that step up; the production log in "
                    f"`sim2real registry list {task}` keeps every move). `sim2real registry promote {task} VERSION` "
                    f"points it at any version"
                )
            previous = history.pop()
            manifest = verify_bundle(self.bundle_dir(task, previous))
            self._write_pointer(task_dir, previous, manifest, history, old, "rollback", "hand", None)
        return previous

    @staticmethod
    def _write_pointer(
        task_dir: Path,
        version: int,
        manifest: dict,
        history: list[int],
        old: dict | None,
        action: str,
        by: str,
        note: str | None,
    ) -> None:
        """The new pointer, its log the old one's plus this move (a pointer written before the log had none)."""
        now = utc_now()
        move = {"utc": now, "action": action, "version": version, "previous": old["version"] if old else None}
        move.update(by=by, **({"note": note} if note else {}))
        pointer = {
            "task": task_dir.name,
            "version": version,
            "files": manifest["files"],
            "history": history,
            "log": [*(old or {}).get("log", []), move],
            "updated_utc": now,
        }
        atomic_write_bytes(task_dir / PRODUCTION_FILE, json.dumps(pointer, indent=2).encode())


def _remove_leftovers(task_dir: Path) -> None:
    # Called under the lock: any staging dir or temp file here belongs to a dead writer
    # (in the task dir: registers and pointer writes; in a version dir: manifest annotations).
    for p in [*task_dir.iterdir(), *task_dir.glob("[0-9]*/.*.tmp")]:
        if p.name.startswith(".") and (".staging-" in p.name or p.name.endswith(".tmp")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
