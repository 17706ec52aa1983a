"""Shadow metrics: the numbers the gate and the report read, computed the same way for sim and field logs.

`log_metrics` needs only the shadow-log columns, so a log recorded by
`sim2real serve --mode shadow` and the in-sim shadow pass give the same
numbers for the same steps. `counterfactual_metrics` summarizes the pass where
the candidate drives. Metrics that cannot be computed are None (JSON null).
"""

from __future__ import annotations

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def mean_ci95(values: np.ndarray) -> tuple[float | None, list[float] | None]:
    """Mean and a 95% percentile-bootstrap CI (fixed seed, so reports are reproducible)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)):
        return None, None
    mean = float(values.mean())
    if values.size == 1:
        return mean, [mean, mean]
    rng = np.random.default_rng(0)
    means = values[rng.integers(0, values.size, size=(BOOTSTRAP_RESAMPLES, values.size))].mean(axis=1)
    return mean, [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def episode_sums(episode: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum `values` per episode id, in order of first appearance."""
    ids, first = np.unique(episode, return_index=True)
    ids = ids[np.argsort(first)]
    return np.array([values[episode == i].sum(dtype=np.float64) for i in ids])


def latency_stats(latency_us: np.ndarray, control_period_s: float | None) -> dict:
    """p50/p99/max latency (µs) and deadline misses (steps slower than the control period)."""
    lat = np.asarray(latency_us, dtype=np.float64)
    lat = lat[np.isfinite(lat)]
    if lat.size == 0:
        return {"latency_p50_us": None, "latency_p99_us": None, "latency_max_us": None, "deadline_misses": None}
    misses = int(np.sum(lat > control_period_s * 1e6)) if control_period_s else None
    return {
        "latency_p50_us": float(np.percentile(lat, 50)),
        "latency_p99_us": float(np.percentile(lat, 99)),
        "latency_max_us": float(lat.max()),
        "deadline_misses": misses,
    }


def compute_p99(compute_us) -> float | None:
    """p99 of per-step CPU times (µs; `episodes.timed`), None where none were measured (a field log)."""
    cpu = np.asarray(compute_us, dtype=np.float64)
    cpu = cpu[np.isfinite(cpu)]
    return float(np.percentile(cpu, 99)) if cpu.size else None


def log_metrics(cols: dict[str, np.ndarray], control_period_s: float | None, agreement_tolerance: float) -> dict:
    """Metrics of a shadow log (legacy driving, candidate computed): divergence, agreement, interventions, latency.

    Divergence and agreement compare legacy with the candidate's *shielded* action (what would be applied).
    """
    n = int(cols["t"].shape[0])
    if n == 0:
        raise ValueError("shadow log has no steps")
    legacy = cols["legacy_action"].astype(np.float64)
    cand = cols["candidate_action"].astype(np.float64)
    if legacy.shape != cand.shape:
        raise ValueError(f"legacy_action {legacy.shape} and candidate_action {cand.shape} differ in shape")
    diff = np.abs(cand - legacy)
    rewards, costs = cols["reward"], cols["cost"]
    legacy_returns = episode_sums(cols["episode"], rewards) if np.all(np.isfinite(rewards)) else np.array([])
    mean, ci = mean_ci95(legacy_returns)
    out = {
        "steps": n,
        "episodes": int(np.unique(cols["episode"]).size),
        "control_period_s": control_period_s,
        "action_rmse": np.sqrt(np.mean(diff**2, axis=0)).tolist(),
        "action_p95_abs_diff": np.percentile(diff, 95, axis=0).tolist(),
        # The unshielded policy's divergence: separates "the policy disagrees" from "the shield stepped in".
        "raw_action_rmse": np.sqrt(np.mean((cols["candidate_raw"].astype(np.float64) - legacy) ** 2, axis=0)).tolist(),
        "agreement_rate": float(np.mean(np.all(diff <= agreement_tolerance, axis=1))),
        "agreement_tolerance": agreement_tolerance,
        "would_be_intervention_rate": float(np.mean(cols["intervened"])),
        "would_be_interventions": int(np.sum(cols["intervened"])),
        "would_be_episode_interventions": episode_sums(cols["episode"], cols["intervened"]).astype(int).tolist(),
        "would_be_episode_steps": episode_sums(cols["episode"], np.ones(n)).astype(int).tolist(),
        "would_be_fallback_rate": float(np.mean(cols["fallback"])),
        # Share of steps the shield's assumption monitor flagged (None for logs without the column).
        "envelope_rate": float(np.mean(cols["envelope"])) if "envelope" in cols else None,
        "legacy_returns": legacy_returns.tolist() if mean is not None else None,
        "legacy_return_mean": mean,
        "legacy_return_ci95": ci,
        "legacy_violations": int(np.sum(costs)) if np.all(np.isfinite(costs)) else None,
        "min_h": [float(np.min(col[np.isfinite(col)])) if np.isfinite(col).any() else None for col in cols["h"].T],
    }
    out.update(latency_stats(cols["latency_us"], control_period_s))
    return out


def counterfactual_metrics(totals, control_period_s: float | None) -> dict:
    """Metrics of the pass where the shielded candidate drives, from its `RunTotals` (pipeline.evaluation.episodes)."""
    mean, ci = mean_ci95(np.asarray(totals.returns))
    lat = latency_stats(np.asarray(totals.latency_us), control_period_s)
    steps = totals.steps
    summary = totals.summary() if steps else {}
    out = {
        "candidate_returns": [float(r) for r in totals.returns],
        "candidate_return_mean": mean,
        "candidate_return_ci95": ci,
        "candidate_violations": int(sum(totals.violations)),
        "candidate_violation_episodes": int(sum(v > 0 for v in totals.violations)),
        "candidate_interventions": int(totals.flags["intervened"]) if totals.shielded else None,
        "candidate_intervention_rate": summary.get("intervention_rate"),
        "candidate_fallback_rate": summary.get("fallback_rate"),
        "candidate_steps": steps,
        # Per episode, so the gate can bound the intervention rate with the episode as its unit (steps of one
        # episode are not independent trials).
        "candidate_episode_interventions": [int(k) for k in totals.interventions] if totals.shielded else None,
        "candidate_episode_steps": [int(n) for n in totals.lengths],
        "candidate_constraints": summary.get("constraints", {}),
        "counterfactual_latency_p99_us": lat["latency_p99_us"],
        "counterfactual_compute_p99_us": compute_p99(totals.compute_us),
        "counterfactual_deadline_misses": lat["deadline_misses"],
    }
    # Further shield flags (e.g. the assumption monitor's `envelope`) under their summary names, prefixed like
    # the rest of this pass (the shadow pass's own `envelope_rate` comes from the log).
    out.update(
        {
            f"candidate_{k}": v
            for k, v in summary.items()
            if k.endswith("_rate") and k not in ("intervention_rate", "fallback_rate")
        }
    )
    return out


def production_metrics(totals, version) -> dict:
    """The production version driving the same seeds: its returns (paired with the candidate's) and safety counts."""
    mean, ci = mean_ci95(np.asarray(totals.returns))
    return {
        "production_version": version,
        "production_returns": [float(r) for r in totals.returns],
        "production_return_mean": mean,
        "production_return_ci95": ci,
        "production_violations": int(sum(totals.violations)),
    }


def failure_metrics(
    failed: dict[str, list[bool]], confidence: float, ends_early: bool = True, held: list[bool] | None = None
) -> dict:
    """Episodes each policy lost (`RunTotals.lost`: the task ended them early, a dropped pole or a crash, or they
    left the safe set), per policy as k of n with the exact upper bound at `confidence` (one look), and against the
    candidate episode by episode: episodes only the candidate lost, and only the reference. `ends_early`: whether
    the task can end an episode early at all (a declared termination, a crash), or only on a diverged state.
    `held`: per candidate episode, whether the task ended it while the shield held the candidate at a limit
    (`RunTotals.ended_held`); the paired counts then say how many of the candidate's own losses ended so.

    The gate decides on the paired counts (`gate.max_lost_rate_increase`): a dropped pole costs an episode hundreds
    of return units, so a candidate that loses one episode in thirty can be worse than legacy on the mean while a
    20-episode sample that shows none puts its mean gain well above 0."""
    from pipeline.evaluation.gate_statistics import rate_summary

    out: dict = {f"{who}_failures": rate_summary(sum(flags), len(flags), confidence) for who, flags in failed.items()}
    out["episodes_can_end_early"] = bool(ends_early)
    cand = failed.get("candidate")
    for who in ("legacy", "production"):
        ref = failed.get(who)
        if cand is not None and ref is not None and len(ref) == len(cand):
            out[f"failures_vs_{who}"] = {
                "candidate_only": sum(c and not r for c, r in zip(cand, ref)),
                f"{who}_only": sum(r and not c for c, r in zip(cand, ref)),
                "episodes": len(cand),
            }
            if held is not None and len(held) == len(cand):
                out[f"failures_vs_{who}"]["candidate_only_held"] = sum(
                    c and not r and h for c, r, h in zip(cand, ref, held)
                )
    return out


def failures_line(f: dict | None) -> str:
    """A `*_failures` summary in words: '0 of 20, rate <= 0.139 at 95%'; 'n/a' when unknown (a field log)."""
    if not f:
        return "n/a"
    return f"{f['k']} of {f['n']}, rate <= {f['upper']:.3f} at {f['confidence']:.0%}"


def empty_counterfactual() -> dict:
    """The counterfactual keys, all None: field logs have no pass where the candidate drives."""
    from pipeline.evaluation.episodes import RunTotals

    probe = RunTotals(returns=[0.0], violations=[0], lengths=[1], latency_us=[1.0])
    return {k: None for k in counterfactual_metrics(probe, 0.02)}


def side_by_side(metrics: dict) -> dict:
    """Candidate, legacy and production on the same episodes: mean return and its 95% CI each."""
    rows = {}
    for who in ("candidate", "legacy", "production"):
        if metrics.get(f"{who}_return_mean") is not None:
            rows[who] = {
                "return_mean": metrics[f"{who}_return_mean"],
                "return_ci95": metrics[f"{who}_return_ci95"],
                "episodes": len(metrics.get(f"{who}_returns") or []),
                "failures": metrics.get(f"{who}_failures"),
            }
    if metrics.get("production_version") is not None and "production" in rows:
        rows["production"]["version"] = metrics["production_version"]
    return rows
