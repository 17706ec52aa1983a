"""Synthesis results kept on disk between processes, keyed on everything they are computed from.

A declared plant's measurement and predictive filter take seconds to tens of seconds (a crane ~20 s), and every
command that builds its shield (`config --check`, `export`, `eval`, a nightly flow's steps, each its own process)
would pay that again for the same numbers. An entry's key is the config's hash (the MJCF by content), the compiled
model's bytes (what the MJCF includes: meshes, other files), the source of the packages that compute it (pipeline,
envs, shield: any edit is a miss) and the versions of the libraries that simulate and solve. Entries are JSON (no
pickle), written atomically; an entry that does not read back whole, or whose stated key is not the one asked for,
is a miss and is rewritten. The spec built from an entry is checked exactly as a fresh one (`ShieldSpec.from_dict`,
the envelope, the overrides), and `sim2real shield synthesize` always measures the envelope afresh (the predictive
section, keyed on that measurement too, is read back where the same one was computed).

An entry states the code identity it was computed by, and its file name carries a tag of it
(`{kind}-{tag}-{key}.json`). Writing one removes the entries another identity wrote (an older or newer sim2real,
an edited checkout) once they are STALE_AFTER_S old: no key made by this code can match them, and without this the
folder grew by every upgrade's entries, for good. The age spares a second checkout in use beside this one (each
would otherwise remove the other's entries on every write). The tag lets that sweep pass this code's own entries
by name, and look at no file's contents at all.

Where: $SIM2REAL_CACHE_DIR, else $XDG_CACHE_HOME/sim2real, else ~/.cache/sim2real; SIM2REAL_CACHE_DIR set to an
empty string turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
# Of an entry; bumping it orphans every old entry (2: entries state their code identity; 3: and their file names
# carry a tag of it, so eviction reads names, not files).
FORMAT = 3
STALE_AFTER_S = 7 * 24 * 3600.0  # another code identity's entry is removed once its file is this old


def cache_dir() -> Path | None:
    """The synthesis cache folder, or None when $SIM2REAL_CACHE_DIR turns it off."""
    configured = os.environ.get("SIM2REAL_CACHE_DIR")
    if configured is not None:
        return Path(configured).expanduser() / "synthesis" if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sim2real" / "synthesis"


@functools.cache
def code_identity() -> str:
    """sha256 of every file of the packages that compute a synthesis result, and of the libraries' versions."""
    import mujoco
    import numpy
    import scipy

    import envs
    import pipeline
    import shield

    h = hashlib.sha256(f"mujoco {mujoco.__version__} numpy {numpy.__version__} scipy {scipy.__version__}".encode())
    for package in (envs, pipeline, shield):
        root = Path(package.__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f"\0{package.__name__}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def identity_tag(code: str) -> str:
    """The 16 hex digits of a code identity an entry's file name carries."""
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def model_identity(cfg) -> str | None:
    """sha256 of a declared plant's compiled model (MJB bytes: its includes and assets too); '' for a task whose
    model ships in the envs package (`code_identity` holds it); None when MuJoCo cannot compile it (the build
    then says why, uncached)."""
    mjcf = (cfg.plant or {}).get("mjcf")  # the path load_config resolved
    if not isinstance(mjcf, str):
        return ""
    import mujoco
    import numpy as np

    try:
        model = mujoco.MjModel.from_xml_path(mjcf)
    except (ValueError, OSError):
        return None
    buffer = np.empty(mujoco.mj_sizeModel(model), np.uint8)
    mujoco.mj_saveModel(model, None, buffer)
    return hashlib.sha256(buffer.tobytes()).hexdigest()


def entry_key(kind: str, cfg, extra: Any = None) -> str | None:
    """The key of `kind`'s result for `cfg` (and `extra`, JSON: whatever else the result is computed from); None
    when the plant's model cannot be read (nothing is cached for it)."""
    model = model_identity(cfg)
    if model is None:
        return None
    parts = [FORMAT, kind, cfg.config_hash(), model, code_identity(), extra]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cached(
    kind: str, cfg, compute: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T], extra=None
) -> T:
    """`compute()`, or the entry a process computed before from the same inputs. `encode` turns the result into
    JSON values and `decode` back; a result that does not come back equal through them is served but not kept, so
    an entry is never anything but what computing afresh gives. Processes that need the same entry at once compute
    it once: the others wait on its lock file."""
    folder = cache_dir()
    key = entry_key(kind, cfg, extra) if folder is not None else None
    if folder is None or key is None:
        return compute()
    path = folder / f"{kind}-{identity_tag(code_identity())}-{key}.json"
    found = _read(path, key, decode)
    if found is not None:
        return found[0]
    with _locked(folder, path.with_suffix(".lock")):
        found = _read(path, key, decode)  # another process may have written it while this one waited
        if found is not None:
            return found[0]
        value = compute()
        try:
            from shield.bundle import atomic_write_bytes

            text = json.dumps({"key": key, "kind": kind, "code": code_identity(), "value": encode(value)})
            if decode(json.loads(text)["value"]) == value:
                atomic_write_bytes(path, text.encode())
                evict_stale(folder)
        except (OSError, TypeError, ValueError):
            pass  # a full disk, or a value JSON cannot hold: the result stands, only uncached
    return value


def evict_stale(folder: Path) -> list[Path]:
    """Remove the entries (and their lock files) at least STALE_AFTER_S old whose names carry another code identity's
    tag, or none (an older format): this code can never read them. Returns what it removed; a file another process
    holds or removed first is left to it."""
    import time

    mine = f"-{identity_tag(code_identity())}-"
    removed = []
    for path in folder.glob("*.json"):
        if mine in path.name:
            continue
        try:
            if time.time() - path.stat().st_mtime < STALE_AFTER_S:
                continue
        except OSError:
            continue  # removed meanwhile
        for stale in (path, path.with_suffix(".lock")):
            with contextlib.suppress(OSError):
                stale.unlink()
        removed.append(path)
    return removed


def _read(path: Path, key: str, decode: Callable[[Any], T]) -> tuple[T] | None:
    """(the entry's value,), or None when it is absent, torn, or states another key."""
    try:
        entry = json.loads(path.read_text())
        return (decode(entry["value"]),) if entry["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _locked(folder: Path, lock: Path) -> Iterator[None]:
    """An exclusive lock on `lock` (POSIX flock; released when the holder exits, even killed); none where the
    folder cannot be written or the platform has no flock: the entry may then be computed twice, never torn."""
    try:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
