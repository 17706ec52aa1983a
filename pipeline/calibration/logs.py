"""Field logs for calibration: read `sim2real serve --mode shadow` logs and refuse what cannot be used.

A shadow log (shield/shadowlog.py, docs/reference/contracts.md) records, per control
step, the observation the plant sent and the legacy action it applied. For
system identification that is a (state, input) trajectory, usable only if it
is the right task, finite, contiguous (no missing control steps), moving and
long enough. A late sample (the step counter continues, the clock shows one
period stretched on a loaded box) is not a missing step: the log is used and the
late rows are counted; the fit leaves out the windows they fall in, whose
replay would assume one period where the plant had more. Every refusal is a
`CalibrationError` whose message names the file and the problem, so `sim2real calibrate` prints one line and exits 2.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# A row later than this many control periods after the previous one is late (the step counter says whether one is
# missing).
GAP_PERIODS = 1.5
# A real-time clock whose median step is off the control period by more than this share: the rig ran at another
# period, and the twin would replay each step as one control period (a 0.021 s rig against a 0.02 s config biased
# the force-over-mass fit by 4 %, with no warning).
CLOCK_TOLERANCE = 0.02
# A state observation that spreads less than this many times its configured noise std over the whole log: the fit
# would take noise for dynamics (a quiet log of the nominal plant read as a misfit, intervals missing it by 10-15 %).
QUIET_SPREAD = 3.0


class CalibrationError(ValueError):
    """Logs or settings that calibration cannot use; the message names the culprit.

    Named `...Error` with ValueError so the CLI reports it as a user error (exit 2).
    """


# What a damaged NPZ (a crash mid-write, a partial copy) raises inside numpy's reader.
_UNREADABLE = (zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError, KeyError)


@dataclass(frozen=True)
class FieldLog:
    """A validated log: contiguous runs of (observation, applied action) at one control period."""

    obs: np.ndarray  # float64[N, obs_dim], as the plant sent them
    action: np.ndarray  # float64[N, act_dim], the legacy action the plant applied (normalized)
    runs: list[tuple[int, int]]  # [start, stop) row ranges without a missing step
    dt: float  # control period, s
    source: str
    late: tuple[int, ...] = ()  # rows that arrived later than GAP_PERIODS control periods after the previous one
    clock_note: str | None = None  # why the log's clock was not read (far from real time), for the summary
    # In a directory of parts from more than one recording (recording_of): (label, first row, row past the last).
    recordings: tuple[tuple[str, int, int], ...] = ()
    meta: dict = field(default_factory=dict)  # the (first) part's meta
    ends: tuple[tuple[int, int], tuple[int, int]] | None = None  # (episode, step) of its first row and of its last

    @property
    def seconds(self) -> float:
        """Total logged control time, s."""
        return len(self.obs) * self.dt


def _gaps(episode: np.ndarray, step: np.ndarray, t: np.ndarray, dt: float) -> tuple[list[int], list[int], list[int]]:
    """Row indices where a new run starts (a new episode), where a step is missing inside one, and late rows.

    The step counter alone says whether a step is missing: a row whose counter
    follows the previous one is the next step, however late its timestamp. The
    clock only marks such a row late, and only when the log ran in real time
    (median row interval within 25 % of dt): a simulated plant stepping faster
    than real time has a meaningless clock.
    """
    same_episode = episode[1:] == episode[:-1]
    skipped = step[1:] != step[:-1] + 1
    intervals = np.diff(t)
    late = np.zeros_like(skipped)
    inside = intervals[same_episode]
    if len(inside) and abs(float(np.median(inside)) / dt - 1.0) < 0.25:
        late = intervals > GAP_PERIODS * dt
    starts = [0] + [int(i) + 1 for i in np.flatnonzero(~same_episode)]
    missing = [int(i) + 1 for i in np.flatnonzero(same_episode & skipped)]
    late_rows = [int(i) + 1 for i in np.flatnonzero(same_episode & ~skipped & late)]
    return starts, missing, late_rows


def _check_clock(episode: np.ndarray, step: np.ndarray, t: np.ndarray, dt: float, where: str) -> str | None:
    """Refuse a clock that says the rig did not run at the task's control period: in real time (its median step
    within 25 % of dt) but off it by more than CLOCK_TOLERANCE, or about 1000x it (timestamps in milliseconds).
    A clock far from both (a simulated plant stepped faster or slower than real time) is not read: the note
    returned says so, for the summary (a rig that really ran at that period would be fitted at the wrong one)."""
    follows = (episode[1:] == episode[:-1]) & (step[1:] == step[:-1] + 1)
    if not follows.any():
        return None
    period = float(np.median(np.diff(t)[follows]))
    ratio = period / dt
    if abs(ratio - 1.0) < 0.25 and abs(ratio - 1.0) > CLOCK_TOLERANCE:
        raise CalibrationError(
            f"{where}: the log's clock advances {period:.4g} s per step (median), {100 * (ratio - 1):+.1f} % off "
            f"the task's control period {dt} s: the twin would replay every step {dt} s long. Calibrate with a "
            f"config whose plant.control_period is the rig's, or fix the clock if the rig ran at {dt} s"
        )
    if abs(ratio / 1000.0 - 1.0) < 0.25:
        raise CalibrationError(
            f"{where}: the log's clock advances {period:.4g} per step (median), about 1000x the control period "
            f"{dt} s: timestamps in milliseconds? The log's t is in seconds (docs/reference/contracts.md)"
        )
    if abs(ratio - 1.0) < 0.25:
        return None
    return (
        f"the log's clock advances {period:.4g} s per step (median), {ratio:.2g}x the control period {dt} s: not "
        f"read, as a simulated plant's stepped off real time. If the rig really ran at {period:.4g} s, calibrate "
        f"with a config whose plant.control_period is that: the fit replays every step {dt} s long"
    )


def quiet_channels(obs: np.ndarray, noise_std: np.ndarray, names: list[str]) -> list[str]:
    """The state observations a log barely moves: spread under QUIET_SPREAD x their configured noise std (a
    noise-free channel is never quiet). `obs`: the log's state columns; `names`: one per column."""
    spread = obs.std(axis=0)
    return [
        f"{name} spreads {s / n:.1f}x its noise std ({n:g})"
        for name, s, n in zip(names, spread, noise_std)
        if n > 0.0 and s < QUIET_SPREAD * n
    ]


def _read(path: str | Path) -> list[tuple[Path, dict, dict]]:
    """(part, columns, meta) of each part a path names (shield.shadowlog.shadow_log_files), a damaged file named in
    a one-line CalibrationError."""
    from shield.shadowlog import ShadowLogError, read_shadow_log, shadow_log_files

    try:
        files = shadow_log_files(path)
    except ShadowLogError as err:
        raise CalibrationError(f"--from-log {err}") from None
    parts = []
    for part in files:
        try:
            parts.append((part, *read_shadow_log(part)))
        except ShadowLogError as err:
            raise CalibrationError(f"--from-log {err}") from None
        except _UNREADABLE as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CalibrationError(
                f"--from-log {part}: damaged or truncated NPZ ({type(err).__name__}: {reason}); "
                f"a partial copy or a crash while writing: copy it again or leave it out"
            ) from None
    return parts


# Where a column in other units is refused, what the log's obs must be in (the refusals here and calibrate's).
OBS_UNITS = "The log's obs are in the units plant.observations reads (SI: m, rad, m/s, rad/s)"


def _check_units(parts, where: str, obs, action, action_box, position_limits, names) -> None:
    """Refuse actions beyond the box the plant applies and positions a whole range beyond their joint's: values in
    other units (N for a normalized action, mm for m) would be fitted as a plant 10 or 1000 times off, or crash."""
    if action_box is not None:
        low, high = (np.asarray(b, np.float64) for b in action_box)
        slack = 0.01 * (high - low)
        beyond = (action < low - slack) | (action > high + slack)
        if beyond.any():
            rows, k = np.flatnonzero(beyond.any(axis=1)), int(np.flatnonzero(beyond.any(axis=0))[0])
            raise CalibrationError(
                f"{where}: legacy_action[{k}] reaches {float(np.abs(action[:, k]).max()):.4g} on {len(rows)} row(s) "
                f"(first at {_row(parts, int(rows[0]))}), beyond the action box [{low[k]:g}, {high[k]:g}] the plant "
                f"applies: the log holds the action the plant got, in the policy's normalized units "
                f"(docs/reference/contracts.md). Logged in N or N m? Divide by the actuator's units_per_action; "
                f"a controller's output before its clip? Log what the plant got"
            )
    for o, (lo, hi, joint) in (position_limits or {}).items():
        width = hi - lo
        far = (obs[:, o] < lo - width) | (obs[:, o] > hi + width)
        if far.any():
            rows = np.flatnonzero(far)
            name = names[o] if names else f"obs[{o}]"
            raise CalibrationError(
                f"{where}: {name} (obs[{o}]) reaches {float(np.abs(obs[:, o]).max()):.4g} on {len(rows)} row(s) "
                f"(first at {_row(parts, int(rows[0]))}), a whole range beyond joint {joint!r}'s {lo:g}..{hi:g}: "
                f"in other units (mm for m, degrees for rad)? {OBS_UNITS}, in the order the plant declares them"
            )


MOVES_WITH = 0.8  # a velocity column's correlation with its position's change, per step, that says "this one"
MOVES_APART = 0.3  # and below which it is not its position's, where another column clearly is (or it is reversed)
# A velocity that follows its position's change but spreads this many times more (or less) than that change per
# second is in other units (deg/s: 57x, rpm: 9.5x, mm/s: 1000x). A mid-step velocity against a one-step difference
# differs by tan(x)/x, x = pi/(steps per period): 1.16 for a 5-step oscillation, far inside this.
SPEED_UNITS = 3.0


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = float(a.std()), float(b.std())
    return float(np.mean((a - a.mean()) * (b - b.mean())) / (sa * sb)) if sa > 0 and sb > 0 else 0.0


INTEGRATES_BETTER = 10.0  # another column pairing that leaves this many times less unexplained: another order
SPEED_SPANS = (1, 2, 4, 8, 16)  # steps a position's change is taken over, for the scale of its velocity


def _speed_scale(cols: dict, obs: np.ndarray, p: int, v: int, dt: float) -> tuple[float, float]:
    """(correlation, spread ratio) of velocity column v against the change of position column p per second, over
    the span in SPEED_SPANS where they agree best: over one step a position's sensor noise can swamp its change (a
    cart-pole's pole: 0.49 over one step, 0.99 over sixteen), over many the change is the mean velocity (trapezoid)."""
    best = (0.0, 1.0)
    total = np.concatenate([[0.0], np.cumsum(obs[:, v])])
    for span in SPEED_SPANS:
        if len(obs) <= span + 10:
            break
        inside = (cols["episode"][span:] == cols["episode"][:-span]) & (
            cols["step"][span:] == cols["step"][:-span] + span
        )
        if inside.sum() < 10:
            break
        change = ((obs[span:, p] - obs[:-span, p]) / (span * dt))[inside]
        mean = ((total[span + 1 :] - total[: -span - 1] - 0.5 * (obs[:-span, v] + obs[span:, v])) / span)[inside]
        r = _corr(change, mean)
        if r > best[0]:
            best = (r, float(mean.std()) / max(float(change.std()), 1e-300))
    return best


def _check_kinematics(where: str, cols: dict, obs: np.ndarray, pairs, names, dt: float) -> None:
    """Refuse velocities that do not move as their positions do: each logged velocity is correlated with the change
    of every observed position from one step to the next (inside an episode). A velocity that follows another
    position's change clearly better than its own, or its own reversed, means columns in another order or sign
    than plant.observations declares, which the fit would take for a plant that does not exist. A velocity that
    follows its own position's change at another scale is in other units (SPEED_UNITS). A velocity that does not
    integrate to its position's change over 1-16 steps, where two other columns do, means columns moved onto
    others' places (a position onto its set-point's column)."""
    if not pairs:
        return
    same = (np.diff(cols["episode"]) == 0) & (np.diff(cols["step"]) == 1)
    if same.sum() < 10:
        return
    change = (np.diff(obs, axis=0) / dt)[same]
    mid = (0.5 * (obs[1:] + obs[:-1]))[same]

    label = (lambda o: f"{names[o]} (obs[{o}])") if names else (lambda o: f"obs[{o}]")

    def integrates(p: int, v: int, joint: str, fit: float) -> None:
        # The checks below compare declared positions and velocities with each other. A column moved onto another
        # kind (a position onto its set-point's column, a velocity onto a position's) escaped them, and the fit
        # then read the column as "barely moves the plant". Over 1-16 steps a joint's velocity integrates to its
        # position's change (a right pair: 0.96-0.9998 on the shipped declared plants); where some other columns
        # pair up so and it does not, or it leaves INTEGRATES_BETTER times their unexplained share (a position on
        # its set-point's column still integrates at 0.85-0.90 on the arm, which tracks its set-points closely;
        # its true column at 0.9996: 330x), the columns are in another order. On the right order the best other
        # pairing left 12x the declared one's unexplained share or more (the two-mass spring's two masses), where
        # the refusal needs it to leave a tenth: over two orders of magnitude apart.
        alt, a, b = max(
            [(_speed_scale(cols, obs, a, v, dt)[0], a, v) for a in range(obs.shape[1]) if a not in (p, v)]
            + [(_speed_scale(cols, obs, p, b, dt)[0], p, b) for b in range(obs.shape[1]) if b not in (p, v)]
            + [(_speed_scale(cols, obs, v, p, dt)[0], v, p)]  # the two the other way round
        )
        if alt >= MOVES_WITH and (fit < MOVES_WITH or 1.0 - fit > INTEGRATES_BETTER * (1.0 - alt)):
            raise CalibrationError(
                f"{where}: {label(v)} does not integrate to the change of {label(p)} (correlation {fit:.3f} over "
                f"1-16 steps), as joint {joint!r}'s velocity and position would, where {label(b)} integrates to "
                f"the change of {label(a)} ({alt:.4f}): the log's columns are in another order than "
                f"plant.observations declares them. Reorder the columns, not the config"
            )

    for p, v, joint in pairs:
        own = _corr(change[:, p], mid[:, v])
        fit, spread = _speed_scale(cols, obs, p, v, dt)
        if own >= MOVES_APART and fit >= MOVES_WITH and not 1.0 / SPEED_UNITS <= spread <= SPEED_UNITS:
            factor = f"{spread:.0f}" if spread >= 100 else f"{spread:.3g}"
            raise CalibrationError(
                f"{where}: {label(v)}, joint {joint!r}'s velocity, moves as {label(p)} changes (correlation "
                f"{fit:.2f}) but {factor}x as fast as that change per second: in other units than "
                f"its position (deg/s for rad/s: 57.3x; rpm: 9.55x; mm/s for m/s: 1000x)? {OBS_UNITS}. "
                "Convert the column, not the config"
            )
        if own >= MOVES_APART:
            integrates(p, v, joint, fit)
            continue
        if own <= -MOVES_WITH:
            raise CalibrationError(
                f"{where}: {label(v)}, joint {joint!r}'s velocity, moves against the change of {label(p)} "
                f"(correlation {own:.2f} per step): logged with the other sign, or in another order than "
                f"plant.observations declares? Fix the columns, not the config"
            )
        swapped = _corr(change[:, v], mid[:, p])
        if swapped >= MOVES_WITH:
            raise CalibrationError(
                f"{where}: {label(v)} changes as {label(p)} reads (correlation {swapped:.2f} per step), not the "
                f"other way round ({own:.2f}): joint {joint!r}'s position and velocity columns are swapped against "
                f"plant.observations. Reorder the columns, not the config"
            )
        others = [(_corr(change[:, q], mid[:, v]), q) for q, _, _ in pairs if q != p]
        best, q = max(others, default=(0.0, -1))
        if best >= MOVES_WITH:
            raise CalibrationError(
                f"{where}: {label(v)}, joint {joint!r}'s velocity, follows the change of {label(q)} (correlation "
                f"{best:.2f} per step), not of {label(p)} ({own:.2f}): the log's columns are in another order than "
                f"plant.observations declares them. Reorder the columns, not the config"
            )
        integrates(p, v, joint, fit)


def recording_of(part: Path, meta: dict) -> str:
    """The recording a log part belongs to by its name: one `serve` process writes parts named
    shadow-<start>-<pid>-<seq>.npz, all of one bundle version; any other name is a recording of its own unless it
    continues the part before (load_field_log). Parts of two recordings can come from two
    plants (a payload changed between nights), which one fit would average into neither."""
    stem = part.stem
    head, _, seq = stem.rpartition("-")
    name = head if head.startswith("shadow-") and seq.isdigit() else stem
    version = meta.get("bundle_version")
    return name if version is None else f"{name} (bundle version {version})"


def _row(parts: list[tuple[Path, dict, dict]], row: int) -> str:
    """Row `row` of the concatenated log, and in a directory of parts the part holding it and its row there:
    a refusal should name the file to cut or copy again."""
    start = 0
    for part, cols, _ in parts if len(parts) > 1 else []:
        n = len(cols["t"])
        if row < start + n:
            return f"row {row} ({part.name}, its row {row - start})"
        start += n
    return f"row {row}"


def load_field_log(
    path: str | Path,
    *,
    task: str,
    obs_dim: int,
    act_dim: int,
    dt: float,
    min_seconds: float = 10.0,
    action_box: tuple[np.ndarray, np.ndarray] | None = None,
    position_limits: dict[int, tuple[float, float, str]] | None = None,
    names: list[str] | None = None,
    velocity_pairs: list[tuple[int, int, str]] | None = None,
    angles: list[int] | None = None,
) -> FieldLog:
    """Read and validate shadow logs (a file or a directory of parts) for calibrating `task`.

    Refuses (CalibrationError) a damaged file, another task's log, other
    dimensions or control period, NaN/inf rows, a log that never moves, a
    missing step inside an episode, and less than `min_seconds` of control;
    with `action_box` an action beyond it (the action the plant got cannot
    be: logged in N or N m?), with `position_limits` (obs index -> the
    joint's range and name) a position a whole range beyond its joint's
    (logged in mm?), with `velocity_pairs` (position obs, velocity obs,
    joint) a velocity that does not move as its position does (columns in
    another order or sign). In a directory each part is checked alone first, so a
    bad part among good ones is refused by its name. Late rows (counter
    contiguous, clock late) are kept and listed. dt in s.
    `angles`: obs indices of angles of hinges that turn without limit: unwrapped along each episode before
    anything reads them (a plant observed wrapped into half a turn either way, as the declared env observes it,
    jumps a whole turn where it crosses; the twin's prediction does not), a multi-turn encoder's count as it is.
    """
    from shield.shadowlog import ShadowLogError, join_shadow_logs

    checks = dict(
        task=task,
        obs_dim=obs_dim,
        act_dim=act_dim,
        dt=dt,
        action_box=action_box,
        position_limits=position_limits,
        names=names,
        velocity_pairs=velocity_pairs,
        angles=angles,
    )
    parts = _read(path)
    recordings: list[tuple[str, int, int]] = []
    previous = None
    for part, part_cols, part_meta in parts if len(parts) > 1 else []:
        alone = _field_log(part, [(part, part_cols, part_meta)], part_cols, part_meta, (), min_seconds=0.0, **checks)
        label, start = recording_of(part, alone.meta), recordings[-1][2] if recordings else 0
        # A part that continues the one before (same bundle version, its first row the next step of the last
        # one's episode) is the same recording whatever its name: one recorder's session cut into files.
        if recordings and previous is not None and alone.ends is not None:
            (episode, step), (last_episode, last_step) = alone.ends[0], previous.ends[1]
            if (episode, step) == (last_episode, last_step + 1) and alone.meta.get(
                "bundle_version"
            ) == previous.meta.get("bundle_version"):
                label = recordings[-1][0]
        previous = alone
        if recordings and recordings[-1][0] == label:
            recordings[-1] = (label, recordings[-1][1], start + len(alone.obs))
        else:
            recordings.append((label, start, start + len(alone.obs)))
    try:
        cols, meta = join_shadow_logs([(c, m) for _, c, m in parts], path)
    except ShadowLogError as err:
        raise CalibrationError(f"--from-log {err}") from None
    if len(recordings) > 1:
        # Each recording numbers its own episodes (a server restarted, another night): a recording's first row
        # starts a run even where its episode number and step counter would read as the last one's, continued.
        which = np.zeros(len(cols["episode"]), np.int64)
        for _, first, _ in recordings[1:]:
            which[first:] += 1
        cols = {**cols, "episode": np.asarray(cols["episode"], np.int64) + which * (int(np.max(cols["episode"])) + 1)}
    return _field_log(
        path, parts, cols, meta, tuple(recordings) if len(recordings) > 1 else (), min_seconds=min_seconds, **checks
    )


def _field_log(
    path: str | Path,
    parts: list[tuple[Path, dict, dict]],
    cols: dict,
    meta: dict,
    recordings: tuple,
    *,
    task: str,
    obs_dim: int,
    act_dim: int,
    dt: float,
    min_seconds: float,
    action_box,
    position_limits,
    names,
    velocity_pairs,
    angles,
) -> FieldLog:
    """load_field_log's checks on one part's or the joined parts' columns (`parts` as read, to name a row's part)."""
    where = f"--from-log {path}"
    logged_task = meta.get("task")
    if logged_task not in (None, "", task):
        raise CalibrationError(f"{where}: logged for task {logged_task!r}, the config is {task!r}")
    obs, action = cols["obs"].astype(np.float64), cols["legacy_action"].astype(np.float64)
    if obs.shape[1] != obs_dim or action.shape[1] != act_dim:
        raise CalibrationError(
            f"{where}: observations x actions are {obs.shape[1]} x {action.shape[1]}, "
            f"task {task} has {obs_dim} x {act_dim}"
        )
    logged_dt = meta.get("control_period_s")
    if isinstance(logged_dt, (int, float)) and math.isfinite(logged_dt) and abs(logged_dt - dt) > 1e-6 * dt:
        raise CalibrationError(f"{where}: control period {logged_dt} s, task {task} runs at {dt} s")
    bad = ~(np.isfinite(obs).all(axis=1) & np.isfinite(action).all(axis=1) & np.isfinite(cols["t"]))
    if bad.any():
        rows = np.flatnonzero(bad)
        raise CalibrationError(
            f"{where}: {len(rows)} row(s) with NaN or inf in obs/legacy_action/t "
            f"(first at {_row(parts, int(rows[0]))}); drop them and start a new episode after them (a dropped row "
            f"inside an episode is a gap), or cut the log there"
        )
    if angles:
        same = (np.diff(cols["episode"]) == 0) & (np.diff(cols["step"]) == 1)
        bounds = [0, *(np.flatnonzero(~same) + 1).tolist(), len(obs)]
        for a, b in zip(bounds, bounds[1:]):
            obs[a:b, angles] = np.unwrap(obs[a:b, angles], axis=0)
    _check_units(parts, where, obs, action, action_box, position_limits, names)
    _check_kinematics(where, cols, obs, velocity_pairs, names, dt)
    sensed = np.ptp(obs, axis=0).max(initial=0.0) > 0
    moving = sensed or np.ptp(action, axis=0).max(initial=0.0) > 0
    if moving and not sensed:
        raise CalibrationError(
            f"{where}: every observation is the same value in all {len(obs)} rows while the actions move: the "
            f"sensors recorded nothing (a dead or unplugged channel, a zero-filled file); leave it out"
        )
    if not moving:
        raise CalibrationError(
            f"{where}: every observation and action is the same value in all {len(obs)} rows "
            f"(e.g. all zero): a recording of a plant that never moved or a zero-filled file, "
            f"nothing to fit"
        )
    t = cols["t"]
    # A clock that runs backwards inside an episode (a clock reset, rows written out of order) was read as one
    # late row and fitted; a clock that stands still (a coarse one) is only coarse.
    back = np.flatnonzero((cols["episode"][1:] == cols["episode"][:-1]) & (np.diff(t) < 0.0))
    if len(back):
        i = int(back[0]) + 1
        raise CalibrationError(
            f"{where}: {len(back)} row(s) stamped before the row above them, first at {_row(parts, i)} "
            f"(t {t[i - 1]:.6f} -> {t[i]:.6f} s): the clock ran backwards or the rows are out of order; fix t "
            f"(rows in the order they were applied), or start a new episode where the clock was reset"
        )
    clock_note = _check_clock(cols["episode"], cols["step"], t, dt, where)
    starts, missing, late = _gaps(cols["episode"], cols["step"], t, dt)
    if missing:
        i = missing[0]
        raise CalibrationError(
            f"{where}: {len(missing)} gap(s) longer than a control period ({dt} s), first at {_row(parts, i)} "
            f"(episode {cols['episode'][i]}, step {cols['step'][i - 1]} -> {cols['step'][i]}, "
            f"{cols['t'][i] - cols['t'][i - 1]:.3f} s); a replay across a gap would be wrong: where the recorder lost "
            f"rows, start a new episode (docs/reference/contracts.md)"
        )
    seconds = len(obs) * dt
    if seconds < min_seconds:
        raise CalibrationError(
            f"{where}: only {seconds:.1f} s of control ({len(obs)} steps); "
            f"calibration needs at least {min_seconds:.0f} s"
        )
    runs = list(zip(starts, starts[1:] + [len(obs)]))
    return FieldLog(
        obs=obs,
        action=action,
        runs=runs,
        dt=dt,
        source=str(path),
        late=tuple(late),
        clock_note=clock_note,
        recordings=recordings,
        meta=meta,
        ends=(
            (int(cols["episode"][0]), int(cols["step"][0])),
            (int(cols["episode"][-1]), int(cols["step"][-1])),
        ),
    )
