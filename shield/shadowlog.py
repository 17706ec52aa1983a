"""Shadow logs: candidate vs legacy, one row per control step, in NPZ files.

The schema (docs/reference/contracts.md) is shared by `sim2real serve --mode shadow`
(field logs) and the in-sim shadow pass, so `sim2real shadow --from-log`
reads both the same way:

    t f64[N] (s)  episode i32[N]  step i32[N]  obs f32[N,obs_dim]
    legacy_action f32[N,act_dim]  candidate_raw f32[N,act_dim]
    candidate_action f32[N,act_dim] (shielded)  intervened bool[N]  fallback bool[N]
    h f32[N,n_constraints]  latency_us f32[N]  reward f32[N] (NaN if unknown)
    cost f32[N] (NaN if unknown)  meta: JSON string (task, bundle_version,
    control_period_s, constraint_names, ...)

A long field run is written as numbered parts (`shadow-<stamp>-0000.npz`, ...)
so a crash loses at most one flush interval; `read_shadow_log` accepts one
file or a directory and concatenates the parts in name order. Files are
written to a temp name and renamed, so a reader never sees half a file.
Loading never unpickles (`allow_pickle=False`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

COLUMNS: dict[str, str] = {
    "t": "f8",
    "episode": "i4",
    "step": "i4",
    "obs": "f4",
    "legacy_action": "f4",
    "candidate_raw": "f4",
    "candidate_action": "f4",
    "intervened": "?",
    "fallback": "?",
    "h": "f4",
    "latency_us": "f4",
    "reward": "f4",
    "cost": "f4",
}
_MATRIX_COLUMNS = ("obs", "legacy_action", "candidate_raw", "candidate_action", "h")


class ShadowLogError(ValueError):
    """A file that is not a shadow log of this schema."""


def _as_columns(rows: dict[str, Any]) -> dict[str, np.ndarray]:
    """Columns cast to the schema's dtypes, with shapes checked."""
    missing = [c for c in COLUMNS if c not in rows]
    if missing:
        raise ShadowLogError(
            f"shadow log is missing column(s) {missing}: every column is in the schema; a log recorded for "
            f"calibration may hold NaN or zeros in the ones it does not read (docs/reference/contracts.md)"
        )
    out = {c: np.asarray(rows[c], dtype=COLUMNS[c]) for c in COLUMNS}
    n = len(out["t"])
    for c, arr in out.items():
        want_ndim = 2 if c in _MATRIX_COLUMNS else 1
        if arr.ndim != want_ndim or arr.shape[0] != n:
            raise ShadowLogError(f"column {c!r} has shape {arr.shape}, expected {n} rows and {want_ndim} dims")
    return out


def write_shadow_log(path: str | Path, rows: dict[str, Any], meta: dict) -> Path:
    """Write one NPZ shadow log atomically (temp file + rename)."""
    path = Path(path)
    cols = _as_columns(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        arrays: dict[str, Any] = {"meta": np.array(json.dumps(meta, sort_keys=True)), **cols}
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _read_one(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (OSError, ValueError) as err:
        raise ShadowLogError(f"{path}: not a readable NPZ shadow log ({err})") from None
    if "meta" not in data:
        raise ShadowLogError(f"{path}: no 'meta' entry")
    try:
        meta = json.loads(str(data.pop("meta")))
    except json.JSONDecodeError as err:
        raise ShadowLogError(f"{path}: 'meta' is not JSON ({err})") from None
    try:
        return _as_columns(data), meta
    except ShadowLogError as err:
        raise ShadowLogError(f"{path}: {err}") from None


def shadow_log_files(path: str | Path) -> list[Path]:
    """The NPZ parts a path names: itself, or a directory's `*.npz` in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.npz") if not p.name.startswith("."))
        if not files:
            raise ShadowLogError(f"{path}: no .npz shadow logs in this directory")
        return files
    if not path.exists():
        raise ShadowLogError(f"{path}: no such shadow log")
    return [path]


def read_shadow_log(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """Read a shadow log file or directory of parts; returns (columns, meta).

    With several parts, columns are concatenated and `meta` is the first part's,
    with `bundle_versions` listing every version seen (a hot reload starts a new part).
    """
    return join_shadow_logs([_read_one(p) for p in shadow_log_files(path)], path)


def join_shadow_logs(parts: list[tuple[dict, dict]], path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """The (columns, meta) of parts read in order, joined as read_shadow_log joins a directory's (`path` names it
    in an error)."""
    if len(parts) == 1:
        return parts[0]
    shapes = {(c["obs"].shape[1], c["legacy_action"].shape[1], c["h"].shape[1]) for c, _ in parts}
    if len(shapes) > 1:
        raise ShadowLogError(f"{path}: parts disagree on (obs_dim, act_dim, n_constraints): {sorted(shapes)}")
    cols = {c: np.concatenate([p[0][c] for p in parts]) for c in COLUMNS}
    meta = dict(parts[0][1])
    meta["bundle_versions"] = sorted({p[1].get("bundle_version") for p in parts}, key=str)
    return cols, meta


class ShadowLogWriter:
    """Buffers rows from a serving loop and writes NPZ parts off the hot path.

    `append` only appends to Python lists (a few µs); `flush` hands the buffer
    to a background thread that stacks and writes it. A change of `meta`
    (a hot reload to a new bundle version) closes the current part first.
    """

    def __init__(self, log_dir: str | Path, *, flush_rows: int = 20000, flush_s: float = 5.0):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.flush_rows, self.flush_s = flush_rows, flush_s
        self._stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
        self._part = 0
        self._meta: dict | None = None
        self._rows: list[tuple] = []
        self._last_flush = time.monotonic()
        self._wall0, self._mono0 = time.time(), self._last_flush
        self._lock = threading.Lock()  # serialises writers; append never takes it
        self._threads: list[threading.Thread] = []
        self.written: list[Path] = []
        self.errors: list[str] = []

    def clock(self) -> float:
        """Wall-clock seconds for a row's t that never run backwards: the wall time at start plus the monotonic
        time since. A time.time() stepped back by NTP mid-recording made a log calibrate refuses (rows stamped
        before the row above them)."""
        return self._wall0 + (time.monotonic() - self._mono0)

    def append(
        self,
        meta: dict,
        t: float,
        episode: int,
        step: int,
        obs,
        legacy,
        raw,
        safe,
        intervened: bool,
        fallback: bool,
        h,
        latency_us: float,
        reward: float = float("nan"),
        cost: float = float("nan"),
    ) -> None:
        """Buffer one row (arrays are copied by the caller or immutable)."""
        if meta is not self._meta and meta != self._meta:
            self.flush()
            self._meta = meta
        self._rows.append((t, episode, step, obs, legacy, raw, safe, intervened, fallback, h, latency_us, reward, cost))
        if len(self._rows) >= self.flush_rows:
            self.flush()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        """Flush when `flush_s` has passed since the last flush (the server also calls this when idle)."""
        if self._rows and time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Write buffered rows as the next part (in a background thread unless `wait`)."""
        rows, self._rows = self._rows, []
        self._last_flush = time.monotonic()
        if rows and self._meta is not None:
            path = self.dir / f"shadow-{self._stamp}-{self._part:04d}.npz"
            self._part += 1
            worker = threading.Thread(target=self._write, args=(path, rows, self._meta), daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [worker]
            worker.start()
        if wait:
            for t in self._threads:
                t.join()

    def close(self) -> None:
        """Flush everything and wait until it is on disk."""
        self.flush(wait=True)

    def _write(self, path: Path, rows: list[tuple], meta: dict) -> None:
        names = list(COLUMNS)
        lists = {name: [r[i] for r in rows] for i, name in enumerate(names)}
        cols = {k: (np.stack(v) if k in _MATRIX_COLUMNS else np.asarray(v)) for k, v in lists.items()}
        try:
            with self._lock:
                self.written.append(write_shadow_log(path, cols, meta))
        except (OSError, ShadowLogError) as err:  # a full disk must not take the server down
            self.errors.append(f"{path}: {err}")
