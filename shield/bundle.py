"""The policy bundle format: the one module that reads, writes and verifies it.

A bundle is a directory::

    policy.onnx     the deterministic policy (normalization and clipping inside)
    shield.json     the safety spec + nominal model (schema owned by shield/spec.py)
    manifest.json   who/what/when, and the sha256 of every other file

Integrity has two layers:

* ``manifest["files"]`` holds the sha256 of ``policy.onnx`` and ``shield.json``;
  a changed byte in either is refused, naming the file.
* ``manifest["manifest_sha256"]`` is the sha256 of the canonical JSON of the
  manifest without that key, so an edited manifest (a swapped hash, a changed
  version) is refused too. This catches corruption and careless edits, not an
  attacker who recomputes the digest; the registry's production pointer also
  pins the payload hashes it promoted (see ``read_production``), and signing
  is left to the transport that ships bundles to the edge.

Loading reads each file once into memory, hashes those bytes and hands the same
bytes on (onnxruntime takes bytes), so a file swapped after verification is
never the one that runs. Nothing is unpickled: JSON + ONNX only.

Stdlib only: this runs on the edge box.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shield.contract import ContractError, check_contract

# Schema 2 adds the I/O contract (shield.contract); schema 1 bundles, which lack it, still load and serve.
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
POLICY_FILE = "policy.onnx"
SHIELD_FILE = "shield.json"
MANIFEST_FILE = "manifest.json"
PAYLOAD_FILES = (POLICY_FILE, SHIELD_FILE)
# The registry's per-task production pointer (written by pipeline/registry.py).
PRODUCTION_FILE = "production"

_REQUIRED_KEYS = (
    "schema_version",
    "task",
    "env_id",
    "version",
    "parent",
    "config_hash",
    "git_commit",
    "created_utc",
    "files",
    "metrics",
    "manifest_sha256",
)


class BundleError(RuntimeError):
    """A bundle is missing, malformed or fails verification; the message names the file."""


# --------------------------------------------------------------------------- atomic files


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so renames inside it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def process_umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else by setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` via temp file + fsync + rename + directory fsync (mode 0666 minus the umask)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~process_umask())  # mkstemp makes 0600 whatever the umask says
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace, no NaN) used for digests."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON, excluding the `manifest_sha256` key itself."""
    return sha256_bytes(canonical_json({k: v for k, v in manifest.items() if k != "manifest_sha256"}))


def json_safe(obj: Any) -> Any:
    """Plain-JSON copy of metrics: numpy scalars/arrays to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return json_safe(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def utc_now() -> str:
    """Current UTC time, ISO 8601 with a Z suffix."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- manifest


def make_manifest(
    *,
    task: str,
    env_id: str,
    files: dict[str, bytes],
    config_hash: str,
    git_commit: str = "unknown",
    version: int | None = None,
    parent: int | None = None,
    metrics: dict | None = None,
    extra: dict | None = None,
    contract: dict | None = None,
    **info: Any,
) -> dict:
    """A sealed manifest for payload `files` ({name: bytes}); `info` adds plain fields (obs_dim...). With an I/O
    `contract` it is schema 2; without one it is a schema-1 manifest, as bundles were before contracts."""
    if contract is not None:
        info["contract"] = contract
    schema = SCHEMA_VERSION if contract is not None else 1
    manifest = dict(
        schema_version=schema,
        task=task,
        env_id=env_id,
        version=version,
        parent=parent,
        config_hash=config_hash,
        git_commit=git_commit,
        created_utc=utc_now(),
        files={name: sha256_bytes(data) for name, data in sorted(files.items())},
        metrics=json_safe(metrics or {}),
        extra=json_safe(extra or {}),
        **json_safe(info),
    )
    return seal_manifest(manifest)


def seal_manifest(manifest: dict) -> dict:
    """Return a copy of `manifest` with `manifest_sha256` recomputed (after an intended change)."""
    out = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    out["manifest_sha256"] = manifest_digest(out)
    return out


def parse_manifest(data: bytes, where: str = MANIFEST_FILE) -> dict:
    """Parse and check a manifest's bytes: JSON, schema version, required keys, own digest."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: top level must be an object")
    schema = manifest.get("schema_version")
    if schema not in READABLE_SCHEMAS or isinstance(schema, bool):
        raise BundleError(f"{where}: unsupported schema_version {schema!r} (this runtime reads {READABLE_SCHEMAS})")
    missing = [k for k in _REQUIRED_KEYS + (("contract",) if schema >= 2 else ()) if k not in manifest]
    if missing:
        raise BundleError(f"{where}: missing key(s) {missing}")
    if not isinstance(manifest["files"], dict) or sorted(manifest["files"]) != sorted(PAYLOAD_FILES):
        raise BundleError(f"{where}: 'files' must list exactly {list(PAYLOAD_FILES)}")
    if manifest_digest(manifest) != manifest["manifest_sha256"]:
        raise BundleError(f"{where}: manifest_sha256 mismatch (the manifest was modified after it was sealed)")
    if schema >= 2:
        try:
            check_contract(manifest["contract"], manifest.get("obs_dim"), manifest.get("act_dim"))
        except ContractError as err:
            raise BundleError(f"{where}: {err}") from None
    return manifest


# --------------------------------------------------------------------------- bundle


@dataclass(frozen=True)
class Bundle:
    """A verified bundle held in memory: the manifest, the ONNX bytes and the shield spec."""

    path: Path
    manifest: dict
    policy_onnx: bytes = field(repr=False)
    shield_json: bytes = field(repr=False)
    shield_spec: dict = field(repr=False)

    @property
    def task(self) -> str:
        return self.manifest["task"]

    @property
    def version(self) -> int | None:
        return self.manifest["version"]

    @classmethod
    def load(cls, bundle_dir: str | Path, pinned: dict | None = None) -> Bundle:
        """Read and verify a bundle directory; BundleError naming the file on any mismatch.

        `pinned` ({file: sha256}, the registry pointer's `files`) is checked against the hashes
        of the bytes read here, the same bytes the runtime is built from: a bundle rewritten
        after the pointer was read is refused, never served.
        """
        files, manifest = _read_verified(Path(bundle_dir))
        if pinned is not None:
            check_pinned(bundle_dir, manifest, {"files": pinned})
        try:
            shield_spec = json.loads(files[SHIELD_FILE])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BundleError(f"{SHIELD_FILE}: not valid JSON ({err}) in {bundle_dir}") from None
        return cls(Path(bundle_dir), manifest, files[POLICY_FILE], files[SHIELD_FILE], shield_spec)


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{path.name}: missing from bundle {path.parent}") from None
    except OSError as err:
        raise BundleError(f"{path.name}: cannot read ({err.strerror}) in bundle {path.parent}") from None


def _read_verified(bundle_dir: Path) -> tuple[dict[str, bytes], dict]:
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir}: not a bundle directory (it does not exist or is a file)")
    manifest = parse_manifest(_read_file(bundle_dir / MANIFEST_FILE), f"{MANIFEST_FILE} in {bundle_dir}")
    files: dict[str, bytes] = {}
    for name in PAYLOAD_FILES:
        data = _read_file(bundle_dir / name)
        actual, expected = sha256_bytes(data), manifest["files"][name]
        if actual != expected:
            raise BundleError(
                f"{name}: sha256 mismatch in {bundle_dir} (manifest {expected[:12]}..., "
                f"file {actual[:12]}...); the file was modified or corrupted"
            )
        files[name] = data
    return files, manifest


def verify_bundle(bundle_dir: str | Path) -> dict:
    """Check every hash of a bundle; return its manifest or raise BundleError naming the file."""
    return _read_verified(Path(bundle_dir))[1]


def shield_json_bytes(spec: dict) -> bytes:
    """A shield spec as a bundle's shield.json holds it (and as `shield synthesize` writes the one it certifies): one
    serialization, so the file a certificate names and the file a bundle ships compare byte for byte."""
    return json.dumps(spec, indent=2, sort_keys=True).encode()


def write_bundle(out_dir: str | Path, *, policy_onnx: bytes, shield_spec: dict | bytes, manifest: dict) -> Path:
    """Write a complete bundle at `out_dir` atomically (staged in a sibling temp dir, then renamed).

    `manifest` comes from `make_manifest`; its file hashes must match the payload.
    `out_dir` must not exist yet, or be an empty directory.
    """
    out_dir = Path(out_dir)
    if isinstance(shield_spec, bytes):
        shield_bytes = shield_spec
    else:
        shield_bytes = shield_json_bytes(shield_spec)
    payload = {POLICY_FILE: policy_onnx, SHIELD_FILE: shield_bytes}
    for name, data in payload.items():
        if manifest["files"].get(name) != sha256_bytes(data):
            raise BundleError(f"{name}: the manifest's sha256 does not match the data being written")
    sealed = manifest_bytes(parse_manifest(canonical_json(manifest), "manifest to write"))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BundleError(f"{out_dir}: already exists and is not an empty directory; refusing to overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        os.chmod(staging, 0o777 & ~process_umask())  # mkdtemp makes 0700 whatever the umask says
        for name, data in {**payload, MANIFEST_FILE: sealed}.items():
            with open(staging / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(staging)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename onto a non-empty dir would fail anyway
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(out_dir.parent)
    return out_dir


def manifest_bytes(manifest: dict) -> bytes:
    """The on-disk bytes of a (sealed) manifest."""
    return json.dumps(manifest, indent=2, sort_keys=True).encode()


# --------------------------------------------------------------------------- production pointer


def read_production(task_dir: str | Path) -> dict | None:
    """The registry's production pointer of a task dir: {"version", "files", "history", ...} or None.

    `files` pins the payload hashes that were promoted, so a bundle whose files
    and manifest were both rewritten after promotion is still refused; metrics
    added to the manifest later do not disturb the pin.
    """
    path = Path(task_dir) / PRODUCTION_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise BundleError(f"{path}: cannot read production pointer ({err.strerror})") from None
    try:
        pointer = json.loads(data)
        version = pointer["version"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"version {version!r} is not a positive integer")
        if not isinstance(pointer.get("history", []), list):
            raise ValueError("history is not a list")
        if not isinstance(pointer.get("log", []), list):
            raise ValueError("log is not a list")
        if not isinstance(pointer.get("files", {}), dict):
            raise ValueError("files is not a mapping")
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: malformed production pointer ({err})") from None
    return pointer


def gate_failures(manifest: dict | None) -> tuple[str, list[str]] | None:
    """(decision, the config keys of the checks that failed) where the bundle's own record says its gate did not
    pass; None where it passed or was never gated (a bundle exported by hand)."""
    gate = ((manifest or {}).get("metrics") or {}).get("gate")
    if not isinstance(gate, dict) or gate.get("decision") in (None, "pass"):
        return None
    failing = gate.get("failing")
    if not isinstance(failing, list):  # a bundle registered before the flow recorded the keys: read its reasons
        failing = [r.split(":", 1)[0].split(" ", 1)[1] for r in gate.get("reasons", []) if str(r).startswith("FAIL ")]
    return str(gate["decision"]), [str(k) for k in failing]


def gate_said(found: tuple[str, list[str]]) -> str:
    """`gate_failures`' finding in words: the decision and the config keys that failed."""
    decision, failing = found
    return f"{decision!r}" + (f" ({', '.join(failing)} failed)" if failing else "")


def gate_note(manifest: dict | None, models_root: str | Path | None = None) -> str | None:
    """What the bundle's own record says about its gate when it did not pass or was never gated (None when it
    passed, or the bundle has no manifest metrics at all): a bundle served by path, or promoted by hand, is served
    whatever its gate said, and the operator should know which. `models_root`: the registry it came from, named in
    the command when it is not the default."""
    found = gate_failures(manifest)
    m = manifest or {}
    if found is None:
        if isinstance(m.get("metrics"), dict) and "gate" not in m["metrics"]:
            return (
                "this bundle carries no gate decision (exported, or made by hand: only `sim2real run` records one "
                "in the registry's copy): nothing judged it against the legacy controller; it is served as asked. "
                "`sim2real shadow BUNDLE` gates it"
            )
        return None
    where = f" --models {models_root}" if models_root is not None and Path(models_root) != Path("models") else ""
    return (
        f"this bundle's gate decision was {gate_said(found)}; it is served as asked. `sim2real registry "
        f"show {m.get('task')} {m.get('version')}{where}` says why"
    )


def production_target(models_root: str | Path, task: str) -> tuple[Path, dict]:
    """(bundle dir, pinned {file: sha256}) the registry's production pointer names for `task`; nothing loaded.

    Load it with `Bundle.load(dir, pinned=...)` (or `EdgeRuntime.load`): the pins are then
    checked on the bytes that are loaded.
    """
    task_dir = Path(models_root) / task
    pointer = read_production(task_dir)
    if pointer is None:
        raise BundleError(
            f"{task_dir / PRODUCTION_FILE}: no production version for task {task!r} "
            f"(promote one with `sim2real registry promote {task} VERSION`)"
        )
    return task_dir / str(pointer["version"]), dict(pointer.get("files", {}))


def resolve_production(models_root: str | Path, task: str) -> Path:
    """The bundle dir the registry's production pointer names for `task`, verified and its pins checked (one read)."""
    bundle_dir, pinned = production_target(models_root, task)
    Bundle.load(bundle_dir, pinned=pinned)
    return bundle_dir


def check_pinned(bundle_dir: str | Path, manifest: dict, pointer: dict) -> None:
    """BundleError naming the file if a bundle's payload hashes differ from those its pointer pinned."""
    for name, pinned in sorted(pointer.get("files", {}).items()):
        found = manifest["files"].get(name)
        if found != pinned:
            raise BundleError(
                f"{name}: differs from the file that was promoted in {bundle_dir} "
                f"(pointer pins sha256 {str(pinned)[:12]}..., manifest has {str(found)[:12]}...)"
            )
