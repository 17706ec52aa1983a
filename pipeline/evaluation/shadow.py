"""Shadow-mode evaluation of a candidate bundle beside the legacy controller, then the promotion gate.

Two passes over the same seeds and domains:

1. *shadow*: the legacy controller drives; the candidate (bundle through the
   edge runtime, shield on) computes its action every step from a copy of the
   observation, and that action is never applied. Every step is logged in the
   shadow-log schema (`shield.shadowlog`), the same one `serve --mode shadow`
   writes in the field.
2. *counterfactual*: the shielded candidate drives the same seeds.

`--from-log` replaces both passes with field logs: the shadow metrics come out
the same (one function computes them), the counterfactual ones are None and
the gate says which checks it skipped.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.evaluation.gate import GateDecision, decide
from pipeline.evaluation.shadow_metrics import counterfactual_metrics, empty_counterfactual, log_metrics

ANIMATION_FRAMES = 100  # frames of the counterfactual episode kept for the report's animation


class ShadowError(ValueError):
    """Bad shadow input a user can cause (domains, episodes, legacy name, log); the message names it."""


@dataclass
class ShadowRun:
    """One shadow pass: the step log in shadow-log columns, plus what the report plots."""

    columns: dict[str, np.ndarray]
    meta: dict


@dataclass
class CounterfactualRun:
    """The pass where the shielded candidate drives: per-episode totals and the first episode's trace."""

    returns: list[float] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    interventions: int = 0
    fallbacks: int = 0
    envelope_flags: int = 0
    latency_us: list[float] = field(default_factory=list)
    trace: dict[str, np.ndarray] = field(default_factory=dict)  # episode 0: t, action, h, intervened
    states: dict[str, np.ndarray] = field(default_factory=dict)  # episode 0: qpos, qvel, mocap_pos (animation)


# ----------------------------------------------------------------------------- environment


def resolve_domains(cfg, domains: str):
    """A RandomizationSet from a set name in `cfg.randomization` or a YAML file (a set, or a config's sets)."""
    if domains in cfg.randomization:
        return cfg.randomization[domains]
    path = Path(domains)
    if path.suffix in (".yaml", ".yml") or path.exists():
        import yaml

        from envs.randomization import RandomizationError, load_randomization_sets, parse_randomization

        try:
            doc = yaml.safe_load(path.read_text())
            if isinstance(doc, dict) and "randomization" in doc:
                sets = load_randomization_sets(path)
                name = "reality" if "reality" in sets else (next(iter(sets)) if len(sets) == 1 else None)
                if name is None:
                    raise ShadowError(f"--domains {domains}: has sets {sorted(sets)}; name one 'reality' or keep one")
                return sets[name]
            return parse_randomization(doc or {}, f"{path}")
        except OSError as err:
            raise ShadowError(f"--domains {domains}: cannot read ({err.strerror})") from None
        except yaml.YAMLError as err:
            raise ShadowError(f"--domains {domains}: not valid YAML ({err})") from None
        except RandomizationError as err:
            raise ShadowError(f"--domains {domains}: {err}") from None
    raise ShadowError(f"--domains {domains!r}: not a randomization set of this config "
                      f"({sorted(cfg.randomization)}) nor a YAML file")


def make_env(cfg, rset):
    """The task env on the given domains, with the config's episode length."""
    import gymnasium as gym
    import envs  # noqa: F401  (registers the task ids)

    kwargs = {"randomization": rset}
    if cfg.task.max_episode_steps:
        kwargs["max_episode_steps"] = cfg.task.max_episode_steps
    return gym.make(cfg.task.env_id, **kwargs)


def control_period_s(cfg, env) -> float:
    """Control period (s): the task's safety spec, else the env's dt."""
    import envs

    try:
        return float(envs.safety_spec(cfg.task.env_id)["dt"])
    except ValueError:
        return float(getattr(env.unwrapped, "dt"))


def load_legacy(env_id: str, name: str | None):
    """The task's legacy controller; `name`, when given, must be the one the task ships."""
    import envs

    expected = envs.LEGACY_NAMES.get(env_id)
    if name is not None and name != expected:
        raise ShadowError(f"--legacy {name!r}: task {env_id} has legacy controller {expected!r}")
    return envs.legacy_controller(env_id)


# ----------------------------------------------------------------------------- the two passes


def shadow_pass(env, legacy, candidate, seeds: list[int], dt: float, meta: dict) -> ShadowRun:
    """Legacy drives every seed; `candidate.act` (if not None) is computed and logged, never applied."""
    rows: dict[str, list] = {k: [] for k in ("t", "episode", "step", "obs", "legacy_action", "candidate_raw",
                                             "candidate_action", "intervened", "fallback", "h", "latency_us",
                                             "reward", "cost")}
    n_h = len(meta.get("constraint_names", []))
    act_dim = env.action_space.shape[0]
    for ep, seed in enumerate(seeds):
        obs, _ = env.reset(seed=seed)
        legacy.reset()
        if candidate is not None:
            candidate.reset()
        step, done = 0, False
        while not done:
            if candidate is not None:
                obs_copy = obs.copy()  # the candidate never gets (or mutates) what legacy sees
                t0 = time.perf_counter_ns()
                safe, raw, info = candidate.act(obs_copy)
                latency = (time.perf_counter_ns() - t0) / 1e3
                h = np.asarray(info.get("h", np.full(n_h, np.nan)), np.float32).reshape(-1)
                cand = (np.asarray(raw, np.float32), np.asarray(safe, np.float32), bool(info.get("intervened")),
                        bool(info.get("fallback")), h, latency)
            else:
                nan = np.full(act_dim, np.nan, np.float32)
                cand = (nan, nan, False, False, np.full(n_h, np.nan, np.float32), np.nan)
            action = np.asarray(legacy(obs[None, :]), np.float32)[0]
            next_obs, reward, terminated, truncated, info_env = env.step(action)
            for key, value in zip(("t", "episode", "step", "obs", "legacy_action"), (step * dt, ep, step, obs, action)):
                rows[key].append(value)
            for key, value in zip(("candidate_raw", "candidate_action", "intervened", "fallback", "h", "latency_us"), cand):
                rows[key].append(value)
            rows["reward"].append(reward)
            rows["cost"].append(info_env.get("cost", np.nan))
            obs, step, done = next_obs, step + 1, terminated or truncated
    matrix = ("obs", "legacy_action", "candidate_raw", "candidate_action", "h")
    cols = {k: (np.stack(v) if k in matrix else np.asarray(v)) for k, v in rows.items()}
    if cols["h"].ndim == 1:  # no constraints: keep the [N, 0] shape
        cols["h"] = cols["h"].reshape(len(cols["t"]), -1)
    # Cast to the schema's dtypes now, so metrics of this run equal those of its log read back.
    from shield.shadowlog import COLUMNS

    return ShadowRun({k: np.asarray(v, dtype=COLUMNS[k]) for k, v in cols.items()}, meta)


def counterfactual_pass(env, candidate, seeds: list[int], dt: float, frames: int = ANIMATION_FRAMES) -> CounterfactualRun:
    """The shielded candidate drives every seed; episode 0's trace and states are kept for the report."""
    run = CounterfactualRun()
    trace: dict[str, list] = {"t": [], "action": [], "raw": [], "h": [], "intervened": []}
    qpos, qvel, mocap = [], [], []
    for ep, seed in enumerate(seeds):
        obs, _ = env.reset(seed=seed)
        candidate.reset()
        total, cost, step, done = 0.0, 0.0, 0, False
        while not done:
            if ep == 0 and step < frames and hasattr(env.unwrapped, "data"):
                qpos.append(env.unwrapped.data.qpos.copy())
                qvel.append(env.unwrapped.data.qvel.copy())
                mocap.append(env.unwrapped.data.mocap_pos.copy())
            t0 = time.perf_counter_ns()
            safe, raw, info = candidate.act(obs.copy())
            run.latency_us.append((time.perf_counter_ns() - t0) / 1e3)
            run.interventions += bool(info.get("intervened"))
            run.fallbacks += bool(info.get("fallback"))
            run.envelope_flags += bool(info.get("envelope"))
            if ep == 0:
                for key, value in (("t", step * dt), ("action", safe), ("raw", raw), ("h", info.get("h", [])),
                                   ("intervened", bool(info.get("intervened")))):
                    trace[key].append(np.asarray(value, np.float32) if key != "intervened" else value)
            obs, reward, terminated, truncated, info_env = env.step(np.asarray(safe, np.float32))
            total += float(reward)
            cost += float(info_env.get("cost", 0.0))
            step, done = step + 1, terminated or truncated
        run.returns.append(total)
        run.costs.append(cost)
        run.lengths.append(step)
    run.trace = {k: np.asarray(v) for k, v in trace.items()}
    if qpos:
        run.states = {"qpos": np.stack(qpos), "qvel": np.stack(qvel), "mocap_pos": np.stack(mocap)}
    return run


# ----------------------------------------------------------------------------- the command


def warm_up(runtime, obs_dim: int, calls: int = 3) -> None:
    """Pay onnxruntime's and the QP solver's first-call costs before timing, as `serve` does, then reset."""
    for _ in range(calls):
        runtime.act(np.zeros(obs_dim, dtype=np.float32))
    runtime.reset()


def _log_meta(cfg, runtime, dt: float) -> dict:
    spec = runtime.bundle.shield_spec if runtime is not None else {}
    return {"task": cfg.task.name, "env_id": cfg.task.env_id,
            "bundle_version": runtime.bundle.version if runtime is not None else None,
            "control_period_s": dt, "constraint_names": [c["name"] for c in spec.get("constraints", [])],
            "legacy": __import__("envs").LEGACY_NAMES.get(cfg.task.env_id), "source": "sim"}


def evaluate_candidate(runtime, cfg, *, domains: str = "reality", episodes: int | None = None,
                       seed: int | None = None, legacy=None, legacy_name: str | None = None):
    """Run both passes with a loaded candidate (`act`/`reset`); returns (ShadowRun, CounterfactualRun, metrics)."""
    episodes = cfg.shadow.episodes if episodes is None else episodes
    seed = cfg.shadow.seed if seed is None else seed
    if episodes < 1:
        raise ShadowError(f"--episodes must be >= 1, got {episodes}")
    rset = resolve_domains(cfg, domains)
    env = make_env(cfg, rset)
    try:
        dt = control_period_s(cfg, env)
        legacy = legacy if legacy is not None else load_legacy(cfg.task.env_id, legacy_name)
        seeds = list(range(seed, seed + episodes))
        warm_up(runtime, env.observation_space.shape[0])
        shadow = shadow_pass(env, legacy, runtime, seeds, dt, _log_meta(cfg, runtime, dt))
        cf = counterfactual_pass(env, runtime, seeds, dt)
    finally:
        env.close()
    metrics = log_metrics(shadow.columns, dt, cfg.shadow.agreement_tolerance)
    metrics.update(counterfactual_metrics(cf.returns, cf.costs, cf.interventions, cf.fallbacks,
                                          sum(cf.lengths), np.asarray(cf.latency_us), dt, cf.envelope_flags))
    metrics.update(source="sim", domains=domains, seeds=seeds)
    return shadow, cf, metrics


def check_log_matches_bundle(meta: dict, bundle_version, path) -> None:
    """Refuse to gate a registered bundle on logs recorded from a different version."""
    logged = {v for v in (meta.get("bundle_versions") or [meta.get("bundle_version")]) if v}
    if bundle_version and logged and bundle_version not in logged:
        raise ShadowError(f"--from-log {path}: recorded with bundle version(s) {sorted(logged, key=str)}, "
                          f"the candidate bundle is version {bundle_version}")


def metrics_from_log(path: str | Path, cfg) -> tuple[ShadowRun, dict]:
    """Shadow metrics of field logs (a file or a directory of parts); counterfactual metrics are None."""
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


def run_shadow(bundle_dir, cfg, *, domains: str = "reality", episodes: int | None = None, seed: int | None = None,
               report_dir=None, legacy: str | None = None, from_log=None, falsification: dict | None = None) -> dict:
    """Shadow-evaluate a bundle (or field logs), gate it, write the report; returns decision, reasons, metrics, report."""
    from shield.runtime import EdgeRuntime

    domains = domains or cfg.shadow.domains
    if report_dir is None:  # never inside the bundle: registry bundles are sealed
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        report_dir = Path("reports") / f"shadow-{cfg.task.name}-{Path(bundle_dir).name}-{stamp}"
    report_dir = Path(report_dir)
    if from_log is not None:
        from shield.bundle import verify_bundle

        manifest = verify_bundle(bundle_dir)  # BundleError names the file
        shadow, metrics = metrics_from_log(from_log, cfg)
        check_log_matches_bundle(shadow.meta, manifest.get("version"), from_log)
        cf = None
    else:
        runtime = EdgeRuntime.load(bundle_dir)  # verifies every hash; BundleError names the file
        shadow, cf, metrics = evaluate_candidate(runtime, cfg, domains=domains, episodes=episodes, seed=seed,
                                                 legacy_name=legacy)
    if falsification is not None:  # `falsify` ran before the gate (the retrain flow): its cases are a gate check
        metrics.update(falsification_cases=falsification.get("cases_found"),
                       falsification_min_h=falsification.get("min_h"),
                       falsification_worst=falsification.get("worst"))
    decision: GateDecision = decide(metrics, cfg.gate)
    from shield.shadowlog import write_shadow_log
    from pipeline.evaluation.report import write_report

    report_dir.mkdir(parents=True, exist_ok=True)
    log_path = None
    if from_log is None:
        log_path = write_shadow_log(report_dir / "shadow-log.npz", shadow.columns, shadow.meta)
    report = write_report(report_dir, cfg=cfg, bundle_dir=bundle_dir, metrics=metrics, decision=decision,
                          shadow=shadow, counterfactual=cf)
    return {"decision": decision.decision, "reasons": decision.reasons, "failing": decision.failing,
            "metrics": metrics, "report": str(report), "log": str(log_path) if log_path else None}


def run_cli(args) -> int:
    """`sim2real shadow`: exit 0 when the gate passes, 1 when it fails, 2 on bad input."""
    from pipeline.config import ConfigError, load_config
    from shield.bundle import BundleError

    try:
        cfg = load_config(args.config)
        result = run_shadow(args.bundle, cfg, domains=args.domains or cfg.shadow.domains, episodes=args.episodes,
                            seed=args.seed, report_dir=args.report, legacy=args.legacy, from_log=args.from_log)
    except (ConfigError, BundleError, ShadowError) as err:
        print(f"sim2real shadow: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    else:
        m = result["metrics"]
        print(f"{m['episodes']} episodes, {m['steps']} steps ({m['source']}): action RMSE "
              f"{[round(x, 4) for x in m['action_rmse']]}, agreement {m['agreement_rate']:.3f}, "
              f"would-be interventions {m['would_be_intervention_rate']:.3f}")
        print(f"gate: {result['decision'].upper()}")
        for reason in result["reasons"]:
            print(f"  {reason}")
        print(f"report: {result['report']}")
    return 0 if result["decision"] == "pass" else 1
