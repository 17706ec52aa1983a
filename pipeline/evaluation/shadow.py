"""Shadow-mode evaluation of a candidate bundle beside the legacy controller, then the promotion gate.

Passes over the same seeds and domains (common random numbers, so returns pair episode by episode):

1. *shadow*: the legacy controller drives; the candidate (bundle through the
   edge runtime, shield on) computes its action every step from a copy of the
   observation, and that action is never applied. Every step is logged in the
   shadow-log schema (`shield.shadowlog`), the same one `serve --mode shadow`
   writes in the field.
2. *counterfactual*: the shielded candidate drives the same seeds.
3. *production* (when there is a production version): it drives the same seeds too.

The gate's run is sequential: the passes run in batches of `shadow.episodes`
new seeds, and after each batch the gate looks at its bounds; it stops as soon
as they decide, or when `gate.max_episodes` / `gate.max_seconds` is spent
(the bounds are valid at any look: pipeline/evaluation/gate_statistics.py).
The retrain flow gives each night its own block of seeds (`night_seed`), so a
night's bounds hold for plants no earlier candidate was chosen on.

`--from-log` replaces the passes with logs: the shadow metrics come out the
same (one function computes them). A log the shadow pass itself recorded in
simulation names its domains and seeds, so the candidate's counterfactual runs
on them and pairs with the logged legacy returns; a log from a plant cannot be
replayed, its counterfactual metrics are None and the gate says which checks
it skipped (inconclusive).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from pipeline.evaluation.episodes import (
    PolicyDriver,
    RuntimeDriver,
    RunTotals,
    Step,
    check_bundle_task,
    control_period_s,
    make_env,
    resolve_domains,
    run_episodes,
    timed,
)
from pipeline.evaluation.gate import GateDecision, decide
from pipeline.evaluation.gate_statistics import look_sizes
from pipeline.evaluation.shadow_metrics import (
    compute_p99,
    counterfactual_metrics,
    empty_counterfactual,
    failure_metrics,
    log_metrics,
    production_metrics,
)

ANIMATION_FRAMES = 100  # frames of the counterfactual episode kept for the report's animation


class ShadowResult(TypedDict):
    """What `run_shadow` returns: the gate's decision with every reason, the metrics it decided on, the report."""

    decision: str  # pass, fail, kept (production stays) or inconclusive
    reasons: list[str]  # one line per check: PASS/FAIL/UNDECIDED/SKIPPED, its key, value and threshold
    failing: list[str]  # config keys of the failed checks
    loosened: list[str]  # config keys that allow a margin below "no worse than"
    next_steps: list[str]  # what to do about each check that failed or did not decide
    metrics: dict[str, Any]  # shadow_metrics' names: both passes, the paired bounds, the rates and their bounds
    report: str  # the HTML report's path
    log: str | None  # the shadow pass's log (shadow-log NPZ), when simulated
    notes: list[str]  # what the user should know about the inputs (a config other than the one trained under)


class ShadowError(ValueError):
    """Bad shadow input a user can cause (domains, episodes, legacy name, log); the message names it."""


@dataclass
class ShadowRun:
    """One shadow pass: the step log in shadow-log columns, plus what the report plots."""

    columns: dict[str, np.ndarray]
    meta: dict


@dataclass
class CounterfactualRun:
    """The pass where the shielded candidate drives: its run totals and the first episode's trace."""

    totals: RunTotals
    trace: dict[str, np.ndarray] = field(default_factory=dict)  # episode 0: t, action, raw, h, intervened
    states: dict[str, np.ndarray] = field(default_factory=dict)  # episode 0: qpos, qvel, mocap_pos (animation)


def night_seed(cfg, version: int) -> int:
    """The first episode seed of the gate's run for the candidate registered as `version` (night `version`): night 1
    starts at shadow.seed, as `sim2real shadow` does, and every later night at a fresh block of NIGHT_SEED_STRIDE
    seeds. The seeds are in the version's metrics (`shadow.seeds`), so `sim2real shadow --seed` replays a night."""
    from pipeline.config import NIGHT_SEED_STRIDE

    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"a night is a registry version >= 1, got {version!r}")
    return cfg.shadow.seed + (version - 1) * NIGHT_SEED_STRIDE


def load_legacy(env_id: str, name: str | None):
    """The task's legacy controller; `name`, when given, must be the one the task ships."""
    import envs

    task = envs.task(env_id)
    if name is not None and name != task.legacy_name:
        raise ShadowError(f"--legacy {name!r}: task {env_id} has legacy controller {task.legacy_name!r}")
    return task.make_legacy()


# ----------------------------------------------------------------------------- observers of the one runner


class ShadowLog:
    """Observer of the shadow pass: computes the candidate on a copy of each observation (never applied) and
    keeps every step in the shadow-log columns (`shield.shadowlog`)."""

    KEYS = (
        "t",
        "episode",
        "step",
        "obs",
        "legacy_action",
        "candidate_raw",
        "candidate_action",
        "intervened",
        "fallback",
        "h",
        "latency_us",
        "reward",
        "cost",
    )

    def __init__(self, candidate, n_h: int, act_dim: int):
        self.candidate, self.n_h, self.act_dim = candidate, n_h, act_dim
        self.rows: dict[str, list] = {k: [] for k in self.KEYS}
        self.episode_offset = 0  # episodes of earlier batches, so episode ids stay unique over a sequential run
        self.compute_us: list[float] = []  # per step: the candidate's CPU time (`timed`)

    def on_reset(self, env, episode: int, seed: int) -> None:
        if self.candidate is not None:
            self.candidate.reset()

    def on_step(self, s: Step) -> None:
        if self.candidate is not None:
            obs_copy = s.obs.copy()  # the candidate never gets (or mutates) what legacy sees
            # The plant gets legacy's action, and the candidate's shield and memory follow it, as on the edge.
            (safe, raw, info), latency, compute = timed(partial(self.candidate.act, sent=s.action), obs_copy)
            self.compute_us.append(compute)  # not a log column: an edge log has only its wall clock
            h = np.asarray(info.get("h", np.full(self.n_h, np.nan)), np.float32).reshape(-1)
            cand = (
                np.asarray(raw, np.float32),
                np.asarray(safe, np.float32),
                bool(info.get("intervened")),
                bool(info.get("fallback")),
                h,
                latency,
            )
        else:
            nan = np.full(self.act_dim, np.nan, np.float32)
            cand = (nan, nan, False, False, np.full(self.n_h, np.nan, np.float32), np.nan)
        values = (s.t, s.episode + self.episode_offset, s.step, s.obs, s.action) + cand + (s.reward, s.cost)
        for key, value in zip(self.KEYS, values):
            self.rows[key].append(value)

    def columns(self) -> dict[str, np.ndarray]:
        """The log's columns in the schema's dtypes, so metrics of this run equal those of its log read back."""
        from shield.shadowlog import COLUMNS

        matrix = ("obs", "legacy_action", "candidate_raw", "candidate_action", "h")
        cols = {k: (np.stack(v) if k in matrix else np.asarray(v)) for k, v in self.rows.items()}
        if cols["h"].ndim == 1:  # no constraints: keep the [N, 0] shape
            cols["h"] = cols["h"].reshape(len(cols["t"]), -1)
        return {k: np.asarray(v, dtype=COLUMNS[k]) for k, v in cols.items()}


class CounterfactualTrace:
    """Observer of the counterfactual pass: episode 0's actions, barrier values and (for the animation) states."""

    def __init__(self, frames: int = ANIMATION_FRAMES):
        self.frames = frames
        self.trace: dict[str, list] = {"t": [], "action": [], "raw": [], "h": [], "intervened": []}
        self.states: dict[str, list] = {"qpos": [], "qvel": [], "mocap_pos": []}

    def _keep_state(self, env) -> None:
        data = getattr(env.unwrapped, "data", None)
        if data is not None and len(self.states["qpos"]) < self.frames:
            for key in self.states:
                self.states[key].append(getattr(data, key).copy())

    def on_reset(self, env, episode: int, seed: int) -> None:
        if episode == 0:
            self._keep_state(env)

    def on_step(self, s: Step) -> None:
        if s.episode != 0:
            return
        info = s.shield or {}
        for key, value in (("t", s.t), ("action", s.action), ("raw", s.raw), ("h", info.get("h", []))):
            self.trace[key].append(np.asarray(value, np.float32))
        self.trace["intervened"].append(bool(info.get("intervened")))
        if not s.done:
            self._keep_state(s.env)

    def result(self) -> tuple[dict, dict]:
        states = {k: np.stack(v) for k, v in self.states.items()} if self.states["qpos"] else {}
        return {k: np.asarray(v) for k, v in self.trace.items()}, states


# ----------------------------------------------------------------------------- the two passes


def shadow_pass(env, legacy, candidate, seeds: list[int], dt: float, meta: dict) -> ShadowRun:
    """Legacy drives every seed; `candidate.act` (if not None) is computed and logged, never applied."""
    log = ShadowLog(candidate, len(meta.get("constraint_names", [])), env.action_space.shape[0])
    run_episodes(env, PolicyDriver(legacy), seeds, dt=dt, observers=[log])
    return ShadowRun(log.columns(), meta)


def counterfactual_pass(
    env, candidate, seeds: list[int], dt: float, frames: int = ANIMATION_FRAMES
) -> CounterfactualRun:
    """The shielded candidate (an EdgeRuntime) drives every seed; episode 0's trace and states go to the report."""
    trace = CounterfactualTrace(frames)
    totals = run_episodes(env, RuntimeDriver(candidate), seeds, dt=dt, observers=[trace])
    tr, states = trace.result()
    return CounterfactualRun(totals, tr, states)


# ----------------------------------------------------------------------------- the command


def warm_up(runtime, obs_dim: int, calls: int = 3) -> None:
    """Pay onnxruntime's and the QP solver's first-call costs before timing, as `serve` does, then reset."""
    for _ in range(calls):
        runtime.act(np.zeros(obs_dim, dtype=np.float32))
    runtime.reset()


def _log_meta(cfg, runtime, dt: float) -> dict:
    spec = runtime.bundle.shield_spec if runtime is not None else {}
    return {
        "task": cfg.task.name,
        "env_id": cfg.task.env_id,
        "bundle_version": runtime.bundle.version if runtime is not None else None,
        "control_period_s": dt,
        "constraint_names": [c["name"] for c in spec.get("constraints", [])],
        "legacy": __import__("envs").task(cfg.task.env_id).legacy_name,
        "source": "sim",
    }


def evaluate_candidate(
    runtime,
    cfg,
    *,
    domains: str | None = None,
    episodes: int | None = None,
    seed: int | None = None,
    legacy=None,
    legacy_name: str | None = None,
    production=None,
    sequential: bool = False,
    extra_metrics: dict | None = None,
):
    """Run the passes with a loaded candidate (`act`/`reset`); returns (ShadowRun, CounterfactualRun, metrics).

    Defaults come from the config's `shadow:` section (domains, episodes, first seed). `production`: the
    production version's runtime, run on the same seeds. `sequential`: `episodes`, then the sample doubled at
    each look (`look_sizes`) until the gate's bounds decide or `gate.max_episodes` / `gate.max_seconds` is spent
    (else exactly `episodes`, one look); `extra_metrics` (falsify's cases) take part in every look's decision."""
    domains = cfg.shadow.domains if domains is None else domains
    batch = cfg.shadow.episodes if episodes is None else episodes
    seed = cfg.shadow.seed if seed is None else seed
    if batch < 1:
        raise ShadowError(f"--episodes must be >= 1, got {batch}")
    budget = max(batch, cfg.gate.max_episodes) if sequential else batch
    sizes = look_sizes(budget, batch)
    looks = len(sizes)
    ends_early = __import__("envs").task(cfg.task.env_id).ends_early
    rset = resolve_domains(cfg, domains)
    env = make_env(cfg, rset)
    start, stopped = time.perf_counter(), "episode budget"
    try:
        dt = control_period_s(cfg)
        legacy = legacy if legacy is not None else load_legacy(cfg.task.env_id, legacy_name)
        warm_up(runtime, env.observation_space.shape[0])
        if production is not None:
            warm_up(production, env.observation_space.shape[0])
        meta = _log_meta(cfg, runtime, dt)
        log = ShadowLog(runtime, len(meta.get("constraint_names", [])), env.action_space.shape[0])
        trace = CounterfactualTrace()
        cand_totals, prod_totals, legacy_totals = RunTotals(), RunTotals(), RunTotals()
        done = 0
        for look, upto in enumerate(sizes, 1):
            batch_start = time.perf_counter()
            seeds = list(range(seed + done, seed + upto))
            log.episode_offset = done
            legacy_totals.extend(run_episodes(env, PolicyDriver(legacy), seeds, dt=dt, observers=[log]))
            cand_totals.extend(
                run_episodes(env, RuntimeDriver(runtime), seeds, dt=dt, observers=[trace] if look == 1 else [])
            )
            if production is not None:
                prod_totals.extend(run_episodes(env, RuntimeDriver(production), seeds, dt=dt))
            done += len(seeds)
            columns = log.columns()
            metrics = log_metrics(columns, dt, cfg.shadow.agreement_tolerance)
            metrics["compute_p99_us"] = compute_p99(log.compute_us)
            metrics.update(counterfactual_metrics(cand_totals, dt))
            if production is not None:
                metrics.update(production_metrics(prod_totals, production.bundle.version))
            failed = {"candidate": cand_totals.lost, "legacy": legacy_totals.lost}
            if production is not None:
                failed["production"] = prod_totals.lost
            metrics.update(failure_metrics(failed, cfg.gate.confidence, ends_early, cand_totals.ended_held))
            metrics.update(extra_metrics or {})
            metrics.update(looks=look, planned_looks=looks, budget_episodes=budget)
            if look == looks:
                break
            if decide(metrics, cfg.gate).settled:
                stopped = "decided"
                break
            elapsed, last = time.perf_counter() - start, time.perf_counter() - batch_start
            coming = last * (sizes[look] - upto) / len(seeds)  # the next batch, at this one's pace per episode
            if cfg.gate.max_seconds is not None and elapsed + coming > cfg.gate.max_seconds:
                stopped = "time budget (gate.max_seconds)"
                break
    finally:
        env.close()
    if stopped == "episode budget" and decide(metrics, cfg.gate).settled:
        stopped = "decided"
    meta.update(domains=domains if isinstance(domains, str) else None, seeds=list(range(seed, seed + done)))
    tr, states = trace.result()
    metrics.update(
        source="sim",
        domains=domains,
        seeds=list(range(seed, seed + done)),
        stopped=stopped,
        evaluation_wall_s=time.perf_counter() - start,
    )
    return ShadowRun(columns, meta), CounterfactualRun(cand_totals, tr, states), metrics


def check_log_matches_bundle(meta: dict, bundle_version, path) -> None:
    """Refuse to gate a bundle on logs another bundle served: a log records the served version's steps, so it
    judges that version alone. Logs of several versions (a hot reload mid-recording) judge none of them as a whole;
    a bundle with no registry version (a run folder's export) cannot be told from the served one."""
    logged = {v for v in (meta.get("bundle_versions") or [meta.get("bundle_version")]) if v}
    if not logged:
        return  # a log from before versions were recorded: nothing to check it by
    versions = sorted(logged, key=str)
    if not bundle_version:
        raise ShadowError(
            f"--from-log {path}: recorded while bundle version(s) {versions} served, and this bundle has no registry "
            f"version (a run folder's export): the log holds the served version's steps, not this bundle's. Gate "
            f"this bundle in simulation (`sim2real shadow` without --from-log), or its registered copy"
        )
    if bundle_version not in logged:
        raise ShadowError(
            f"--from-log {path}: recorded with bundle version(s) {versions}, the candidate bundle is version "
            f"{bundle_version}: a log holds the served version's steps (a new candidate is gated in simulation, "
            f"or served in shadow mode and logged)"
        )
    if len(logged) > 1:
        raise ShadowError(
            f"--from-log {path}: its parts were recorded with bundle versions {versions} (a hot reload while "
            f"recording): only version {bundle_version}'s parts are its steps; give those alone (each part's meta "
            f"names its version)"
        )


def metrics_from_log(path: str | Path, cfg) -> tuple[ShadowRun, dict]:
    """Shadow metrics of logs (a file or a directory of parts); counterfactual metrics are None."""
    from shield.shadowlog import ShadowLogError, read_shadow_log

    try:
        cols, meta = read_shadow_log(path)
    except ShadowLogError as err:
        raise ShadowError(f"--from-log: {err}") from None
    if len(cols["t"]) == 0:
        raise ShadowError(f"--from-log {path}: the log has no steps")
    if meta.get("task") not in (None, "", cfg.task.name):
        raise ShadowError(f"--from-log {path}: logged for task {meta.get('task')!r}, config is {cfg.task.name!r}")
    dt = meta.get("control_period_s")
    dt = float(dt) if isinstance(dt, (int, float)) and np.isfinite(dt) and dt > 0 else None
    metrics = log_metrics(cols, dt, cfg.shadow.agreement_tolerance)
    metrics.update(empty_counterfactual())
    metrics.update(source="field_log", log=str(path))
    return ShadowRun(cols, meta), metrics


def replayable_seeds(meta: dict, metrics: dict, cfg) -> list[int] | None:
    """The seeds of a log the shadow pass recorded in simulation, when its episodes may be replayed and paired:
    it names a domain set of this config and one seed per logged episode, and logged its rewards. None for a
    plant's log (`serve --mode shadow`): a plant's episodes cannot be run again."""
    seeds, domains = meta.get("seeds"), meta.get("domains")
    if meta.get("source") != "sim" or not isinstance(seeds, list) or not all(isinstance(x, int) for x in seeds):
        return None
    if domains != "nominal" and domains not in cfg.randomization:
        return None
    returns = metrics.get("legacy_returns")
    return seeds if returns and len(returns) == len(seeds) else None


def pair_with_log(runtime, cfg, shadow: ShadowRun, metrics: dict, seeds: list[int]) -> CounterfactualRun | None:
    """The candidate's counterfactual on the logged episodes' own seeds and domains, paired with the logged legacy
    returns under the same rules (one look: the logged sample is fixed). First the twin replays legacy on them: only
    if it reproduces every logged return are these the same recorded episodes; else None (nothing to pair)."""
    env = make_env(cfg, resolve_domains(cfg, shadow.meta["domains"]))
    try:
        dt = control_period_s(cfg)
        replay = run_episodes(env, PolicyDriver(load_legacy(cfg.task.env_id, None)), seeds, dt=dt)
        if not np.allclose(replay.returns, metrics["legacy_returns"], rtol=1e-9, atol=1e-6):
            metrics.update(paired_with_log=False)
            return None
        warm_up(runtime, env.observation_space.shape[0])
        cf = counterfactual_pass(env, runtime, seeds, dt)
    finally:
        env.close()
    metrics.update(counterfactual_metrics(cf.totals, dt))
    metrics.update(
        failure_metrics(
            {"candidate": cf.totals.lost, "legacy": replay.lost},
            cfg.gate.confidence,
            __import__("envs").task(cfg.task.env_id).ends_early,
            cf.totals.ended_held,
        )
    )
    metrics.update(paired_with_log=True, seeds=seeds, domains=shadow.meta["domains"], looks=1, planned_looks=1)
    return cf


def _production_runtime(production_dir, cfg):
    """The production bundle, run beside the candidate on the same seeds (None when there is none)."""
    if production_dir is None:
        return None
    from shield.runtime import EdgeRuntime

    runtime = EdgeRuntime.load(production_dir)  # a production bundle that fails its hashes stops the gate, by name
    check_bundle_task(cfg, runtime.bundle.manifest, production_dir)
    return runtime


def run_shadow(
    bundle_dir,
    cfg,
    *,
    domains: str | None = None,
    episodes: int | None = None,
    seed: int | None = None,
    report_dir=None,
    legacy: str | None = None,
    from_log=None,
    falsification: dict | None = None,
    calibration: dict | None = None,
    production_dir=None,
) -> ShadowResult:
    """Shadow-evaluate a bundle (or logs), gate it, write the report; returns decision, reasons, metrics, report.

    `domains` defaults to the config's `shadow.domains` (a set name, `nominal`, or a YAML file). `episodes`: the
    batch of each sequential look (default shadow.episodes). `production_dir`: the production bundle, evaluated in
    the same paired episodes (the candidate must beat it too). `calibration`: the twin's calibration to field logs
    (the retrain flow with logs), shown in the report."""
    from shield.runtime import EdgeRuntime

    domains = domains or cfg.shadow.domains
    if report_dir is None:  # never inside the bundle: registry bundles are sealed
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        report_dir = Path("reports") / f"shadow-{cfg.task.name}-{Path(bundle_dir).name}-{stamp}"
    report_dir = Path(report_dir)
    extra = {}
    if falsification is not None:  # `falsify` ran before the gate (the retrain flow): its cases are a gate check
        extra = dict(
            falsification_cases=falsification.get("cases_found"),
            falsification_min_h=falsification.get("min_h"),
            falsification_worst=falsification.get("worst"),
            falsification_evaluated=falsification.get("evaluated"),
            falsification_cut_short=falsification.get("cut_short"),
        )
    if from_log is not None:
        from shield.bundle import verify_bundle

        if production_dir is not None:
            raise ShadowError(
                f"--from-log {from_log} with --production: a log holds the steps the served bundle took, and "
                f"production took none of them, so nothing pairs it; gate against production in simulation "
                f"(`sim2real shadow BUNDLE --production DIR` without --from-log)"
            )

        manifest = verify_bundle(bundle_dir)  # BundleError names the file
        note = check_bundle_task(cfg, manifest, bundle_dir)
        shadow, metrics = metrics_from_log(from_log, cfg)
        check_log_matches_bundle(shadow.meta, manifest.get("version"), from_log)
        cf = None
        seeds = replayable_seeds(shadow.meta, metrics, cfg)
        if seeds is not None:
            cf = pair_with_log(EdgeRuntime.load(bundle_dir), cfg, shadow, metrics, seeds)
        metrics.update(extra)
    else:
        runtime = EdgeRuntime.load(bundle_dir)  # verifies every hash; BundleError names the file
        note = check_bundle_task(cfg, runtime.verified_bundle.manifest, bundle_dir)
        shadow, cf, metrics = evaluate_candidate(
            runtime,
            cfg,
            domains=domains,
            episodes=episodes,
            seed=seed,
            legacy_name=legacy,
            production=_production_runtime(production_dir, cfg),
            sequential=True,
            extra_metrics=extra,
        )
    decision: GateDecision = decide(metrics, cfg.gate)
    from pipeline.evaluation.report import write_report
    from shield.shadowlog import write_shadow_log

    report_dir.mkdir(parents=True, exist_ok=True)
    log_path = None
    if from_log is None:
        log_path = write_shadow_log(report_dir / "shadow-log.npz", shadow.columns, shadow.meta)
    report = write_report(
        report_dir,
        cfg=cfg,
        bundle_dir=bundle_dir,
        metrics=metrics,
        decision=decision,
        shadow=shadow,
        counterfactual=cf,
        calibration=calibration,
    )
    return ShadowResult(
        decision=decision.decision,
        reasons=decision.reasons,
        failing=decision.failing,
        loosened=list(decision.loosened),
        next_steps=decision.next_steps,
        metrics=metrics,
        report=str(report),
        log=str(log_path) if log_path else None,
        notes=[note] if note else [],
    )
