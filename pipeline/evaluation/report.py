"""The shadow report: one self-contained HTML file (plots as base64 PNG, the animation as a base64 GIF).

Sections: the gate table (every check, value vs threshold), candidate, legacy and production side by side
with the paired intervals the gate decided on, headline metrics,
legacy vs candidate action traces, h(x) over time with shield interventions
marked, return distributions, latency, and an offscreen animation of the
first counterfactual episode (or a note saying why it is missing).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from pipeline.evaluation.episodes import MIN_H_MEANING
from pipeline.evaluation.gate_statistics import BOUND_METHOD
from pipeline.evaluation.shadow_metrics import failures_line

REPORT_FILE = "shadow-report.html"
ANIMATION_FILE = "counterfactual.gif"


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _img(b64: str, alt: str, mime: str = "image/png") -> str:
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:{mime};base64,{b64}">'


def _first_episode(cols: dict) -> np.ndarray:
    return cols["episode"] == cols["episode"][0]


def plot_actions(cols: dict, names: list[str] | None = None) -> str:
    """Legacy vs candidate (raw and shielded) action per dimension over the first logged episode; `names`: each
    action's declared name (its actuator's)."""
    import matplotlib.pyplot as plt

    sel = _first_episode(cols)
    t = cols["t"][sel]
    act_dim = cols["legacy_action"].shape[1]
    fig, axes = plt.subplots(act_dim, 1, figsize=(8, 2.2 * act_dim), sharex=True, squeeze=False)
    for d, ax in enumerate(axes[:, 0]):
        ax.plot(t, cols["legacy_action"][sel, d], label="legacy (applied)", lw=1.6, color="black")
        ax.plot(t, cols["candidate_raw"][sel, d], label="candidate raw", lw=0.9, color="tab:orange", alpha=0.7)
        ax.plot(t, cols["candidate_action"][sel, d], label="candidate shielded", lw=1.0, color="tab:blue", ls="--")
        ax.set_ylabel(names[d] if names and d < len(names) else f"action[{d}]")
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle("Shadow pass, first episode: legacy drives, candidate computed but not applied", fontsize=9)
    return _png(fig)


def plot_barriers(t: np.ndarray, h: np.ndarray, intervened: np.ndarray, names: list[str], title: str) -> str:
    """h(x) per constraint over time (h >= 0 is safe) with shield interventions marked."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    h = np.asarray(h, dtype=np.float64).reshape(len(t), -1)
    for i in range(h.shape[1]):
        ax.plot(t, h[:, i], lw=1.2, label=names[i] if i < len(names) else f"h[{i}]")
    ax.axhline(0.0, color="red", lw=0.8, ls=":")
    hits = np.flatnonzero(intervened)
    if hits.size:
        finite = h[np.isfinite(h)]
        y = float(finite.min()) if finite.size else 0.0
        ax.scatter(
            t[hits],
            np.full(hits.size, y),
            marker="|",
            color="crimson",
            s=80,
            label=f"shield intervened ({hits.size} steps)",
        )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("h(x)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    return _png(fig)


def plot_returns(metrics: dict) -> str:
    """Per-episode returns of legacy and candidate (points) with means and 95% CIs."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.8))
    rng = np.random.default_rng(0)
    who = [("legacy", "legacy", "black"), ("candidate", "candidate (counterfactual)", "tab:blue")]
    if metrics.get("production_returns"):
        who.append(("production", f"production v{metrics.get('production_version') or '?'}", "tab:green"))
    for x, (key, label, color) in enumerate(who):
        returns = metrics.get(f"{key}_returns")
        if not returns:
            ax.text(x, 0.5, f"{label}: n/a", ha="center", transform=ax.get_xaxis_transform(), fontsize=8)
            continue
        r = np.asarray(returns)
        ax.scatter(x + rng.uniform(-0.12, 0.12, r.size), r, color=color, alpha=0.6, s=18)
        lo, hi = metrics[f"{key}_return_ci95"]
        ax.errorbar(
            x + 0.25,
            metrics[f"{key}_return_mean"],
            yerr=[[metrics[f"{key}_return_mean"] - lo], [hi - metrics[f"{key}_return_mean"]]],
            fmt="D",
            color=color,
            capsize=4,
        )
    ax.set_xticks(range(len(who)), [label for _, label, _ in who])
    ax.set_xlim(-0.6, len(who) - 0.4)
    ax.set_ylabel("episode return")
    ax.set_title("Returns on the same seeds and domains (mean, 95% CI)", fontsize=9)
    return _png(fig)


def plot_latency(latency_us: np.ndarray, control_period_s: float | None) -> str:
    """Histogram of the candidate's per-step latency (µs), with the control period marked."""
    import matplotlib.pyplot as plt

    lat = np.asarray(latency_us, dtype=np.float64)
    lat = lat[np.isfinite(lat) & (lat > 0)]
    fig, ax = plt.subplots(figsize=(6, 2.6))
    if lat.size:
        ax.hist(lat, bins=np.geomspace(lat.min(), lat.max() * 1.01 + 1e-9, 40), color="tab:blue")
        ax.set_xscale("log")
        ax.axvline(np.percentile(lat, 99), color="tab:orange", label="p99")
        if control_period_s and lat.max() > 0.5 * control_period_s * 1e6:
            ax.axvline(control_period_s * 1e6, color="red", label="control period")
        ax.legend(fontsize=7)
    ax.set_xlabel("candidate latency per step (µs): policy + shield")
    ax.set_ylabel("steps")
    return _png(fig)


def _gate_table(decision) -> str:
    rows = []
    for c in decision.checks:
        status = c.status
        value = "n/a" if c.value is None else f"{c.value:.6g}"
        rows.append(
            f'<tr class="{status}"><td>{html.escape(c.key)}</td><td>{value}</td>'
            f"<td>{c.threshold:.6g}</td><td>{status.upper()}</td><td>{html.escape(c.detail)}</td></tr>"
        )
    return (
        "<table><tr><th>threshold</th><th>value</th><th>limit</th><th>result</th><th>detail</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _side_by_side(metrics: dict, decision) -> str:
    """Candidate, legacy and production on the same episodes, with CIs; the paired differences the gate decided on
    (one-sided bounds, spent over the planned looks); how the sequential run stopped; any loosened margin."""
    rows = []
    for who in ("candidate", "legacy", "production"):
        mean, ci = metrics.get(f"{who}_return_mean"), metrics.get(f"{who}_return_ci95")
        if mean is None:
            continue
        name = f"production v{metrics.get('production_version') or '?'}" if who == "production" else who
        rows.append(
            f"<tr><td>{html.escape(name)}</td><td>{len(metrics.get(f'{who}_returns') or [])}</td>"
            f"<td>{mean:.4g}</td><td>[{ci[0]:.4g}, {ci[1]:.4g}]</td>"
            f"<td>{html.escape(failures_line(metrics.get(f'{who}_failures')))}</td></tr>"
        )
    if not rows:
        return ""
    pairs = []
    for c in decision.checks:
        if c.interval is not None and c.key.startswith("gate.min_return_ratio"):
            pairs.append(
                f'<tr class="{c.status}"><td>{html.escape(c.key)}</td><td>{c.value:+.4g}</td>'
                f"<td>[{c.interval[0]:+.4g}, {c.interval[1]:+.4g}]</td><td>{c.threshold:+.4g}</td>"
                f"<td>{c.status.upper()}</td></tr>"
            )
    loosened = "".join(f"<p class='loosened'>LOOSENED by config: {html.escape(line)}</p>" for line in decision.loosened)
    looks = (
        f"<p>{len(metrics.get('candidate_returns') or [])} paired episodes in {metrics.get('looks', 1)} look(s) of "
        f"{metrics.get('planned_looks', 1)} planned; stopped: {html.escape(str(metrics.get('stopped', 'n/a')))}"
        + (f"; {metrics['evaluation_wall_s']:.1f} s" if metrics.get("evaluation_wall_s") else "")
        + ".</p>"
    )
    return (
        "<h2>Same episodes, side by side</h2>"
        + loosened
        + "<table><tr><th>policy</th><th>episodes</th><th>mean return</th><th>95% CI (bootstrap)</th>"
        "<th>episodes lost (ended early, or outside the safe set)</th></tr>"
        + "".join(rows)
        + "</table>"
        + (
            "<table><tr><th>paired difference (candidate - reference)</th><th>mean per episode</th>"
            f"<th>bounds ({BOUND_METHOD})</th><th>threshold</th><th>result</th></tr>" + "".join(pairs) + "</table>"
            if pairs
            else ""
        )
        + looks
    )


def _safety_case(metrics: dict) -> str:
    """The assumption monitor's flag rates and the falsification's worst case (lowest h), when known."""
    rows = [
        ("envelope_rate (shadow pass)", metrics.get("envelope_rate")),
        ("envelope_rate (candidate driving)", metrics.get("candidate_envelope_rate")),
        ("falsification cases", metrics.get("falsification_cases")),
        ("falsification worst h", metrics.get("falsification_min_h")),
    ]
    body = "".join(f"<tr><td>{k}</td><td>{'n/a' if v is None else html.escape(f'{v:.6g}')}</td></tr>" for k, v in rows)
    worst = metrics.get("falsification_worst")
    detail = f"<p>worst case: <code>{html.escape(json.dumps(worst))}</code></p>" if worst else ""
    detail += (
        f'<p class="note">worst h: the lowest barrier value the shield saw in the search; {MIN_H_MEANING}.</p>'
        if metrics.get("falsification_min_h") is not None
        else ""
    )
    return f"<h2>Safety case: envelope and falsification</h2><table>{body}</table>{detail}{_per_constraint(metrics)}"


def _per_constraint(metrics: dict) -> str:
    """Which limit: the candidate's figures per constraint while it drove (shielded)."""
    per = metrics.get("candidate_constraints") or {}
    if not per:
        return ""

    def cell(x, fmt=".4f"):
        return "n/a" if x is None else html.escape(format(x, fmt))

    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{c['violating_steps']}</td><td>{cell(c['worst_excursion'])}</td>"
        f"<td>{cell(c['min_h'])}</td><td>{c['interventions']}</td></tr>"
        for name, c in per.items()
    )
    return (
        "<h3>Per constraint, candidate driving (shielded)</h3><table><tr><th>constraint</th><th>violating steps</th>"
        "<th>worst excursion</th><th>lowest h</th><th>interventions charged</th></tr>" + rows + "</table>"
    )


def _calibration(result: dict) -> str:
    """The twin's calibration to the field logs this gate ran on (`sim2real calibrate`'s result): per parameter,
    nominal vs identified and the range the candidate was gated on, and the twin's prediction error before/after."""
    rows = []
    for name, p in sorted(result["parameters"].items()):
        lo, hi = p["range"]
        status = (
            "known (calibration.known)"
            if p.get("known")
            else "identified"
            if p["identified_ok"]
            else "NOT identified by the logs: keeps its configured range"
        )
        rows.append(
            f'<tr class="{"pass" if p["identified_ok"] else "skipped"}"><td>{html.escape(name)}</td>'
            f"<td>{p['nominal']:.3g}</td><td>{p['identified']:.4g}</td><td>{lo:.4g} .. {hi:.4g}</td>"
            f"<td>{html.escape(status)}</td></tr>"
        )
    log, err = result["log"], result["prediction_error"]
    flat = "".join(
        f"<li>{html.escape(' + '.join(f'{w:+.2f} log {n}' for n, w in d['weights'].items()))}</li>"
        for d in result.get("flat_directions", [])
    )
    return (
        "<h2>Twin calibration: identified vs nominal</h2>"
        f"<p>From {log['seconds']:.0f} s of field log ({html.escape(str(log['source']))}): the twin's prediction "
        f"error (RMS over the window, in noise std units) went from {err['before']['rms_normalized']:.2f} "
        f"(nominal) to {err['after']['rms_normalized']:.2f} (calibrated); latency "
        f"{result['latency_steps']['identified']} control steps. The candidate was trained around the "
        "calibrated set and gated on it as well as on <code>reality</code>.</p>"
        "<table><tr><th>parameter (scale)</th><th>nominal</th><th>identified</th><th>calibrated range</th>"
        "<th>status</th></tr>"
        + "".join(rows)
        + "</table>"
        + (f"<p>Directions the logs cannot pin (flat):</p><ul>{flat}</ul>" if flat else "")
        + _payoff(result.get("payoff"))
    )


def _payoff(p: dict | None) -> str:
    """What calibrating bought: the twin's error before/after, the candidate vs production on the calibrated twin."""
    if p is None:
        return ""
    from pipeline.evaluation.payoff import payoff_lines

    rows = ""
    a = p.get("against_production")
    if a is not None:
        lo, hi = a["paired_difference_ci95"]
        rows = (
            "<table><tr><th>on the calibrated twin, same seeds</th><th>episodes</th><th>mean return</th></tr>"
            f"<tr><td>candidate (trained on the calibrated set)</td><td>{a['episodes']}</td>"
            f"<td>{a['candidate_return_mean']:.4g}</td></tr>"
            f"<tr><td>production v{a['production_version']}</td><td>{a['episodes']}</td>"
            f"<td>{a['production_return_mean']:.4g}</td></tr>"
            f"<tr><td>paired difference (candidate - production)</td><td>{a['episodes']}</td>"
            f"<td>{a['paired_difference_mean']:+.4g} [{lo:+.4g}, {hi:+.4g}] (95 % bootstrap)</td></tr></table>"
        )
    items = "".join(f"<li>{html.escape(line)}</li>" for line in payoff_lines(p))
    return f"<h3>Payoff of calibrating</h3><ul>{items}</ul>{rows}"


def _version_text(version) -> str:
    """The candidate's registry version, or that the gate ran before it was registered (the nightly flow's case)."""
    return "not registered yet: the flow registers it after the gate" if version is None else f"version {version}"


def _seed_range(seeds) -> str:
    """'; seeds a..b' (what `sim2real shadow --seed a` replays), or nothing for a log without seeds."""
    if not seeds:
        return ""
    return f"; seeds {seeds[0]}..{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else f"; seeds {seeds}"


def _metrics_table(metrics: dict) -> str:
    skip = {"legacy_returns", "candidate_returns", "production_returns", "seeds"}
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>"
        for k, v in metrics.items()
        if k not in skip
    )
    return f"<table>{rows}</table>"


_CSS = """body{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
tr.fail td{background:#fdd}tr.pass td{background:#dfd}tr.skipped td{background:#eee}
tr.undecided td{background:#ffe9c4}.loosened{color:#b00;font-weight:bold}
.verdict{font-size:1.4em;font-weight:bold}.verdict.fail{color:#b00}.verdict.pass{color:#080}.verdict.inconclusive{color:#a60}
.verdict.kept{color:#a60}
img.plot{display:block;max-width:100%;margin:0.5em 0}.note{color:#666;font-style:italic}"""


def write_report(
    out_dir, *, cfg, bundle_dir, metrics: dict, decision, shadow, counterfactual=None, calibration: dict | None = None
) -> Path:
    """Write `shadow-report.html` (and the animation GIF) into `out_dir`; returns the HTML path.
    `calibration`: the twin's calibration result (`pipeline.calibration.calibrate`) when the gate ran on it."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cols, meta = shadow.columns, shadow.meta
    names = list(meta.get("constraint_names") or [])
    sel = _first_episode(cols)
    parts = [
        f"<h2>Gate: <span class='verdict {decision.decision}'>{decision.decision.upper()}</span></h2>",
        _gate_table(decision),
        _side_by_side(metrics, decision),
        "<h2>Actions: legacy vs candidate</h2>",
        _img(plot_actions(cols, cfg.action_names(cols["legacy_action"].shape[1])), "action traces"),
    ]
    parts += [
        "<h2>Safety: h(x) over time</h2>",
        _img(
            plot_barriers(
                cols["t"][sel],
                cols["h"][sel],
                cols["intervened"][sel],
                names,
                "Shadow pass (legacy drives): would-be interventions",
            ),
            "h shadow",
        ),
    ]
    if counterfactual is not None and len(counterfactual.trace.get("t", [])):
        tr = counterfactual.trace
        parts.append(
            _img(
                plot_barriers(
                    tr["t"], tr["h"], tr["intervened"], names, "Counterfactual pass (candidate drives, shielded)"
                ),
                "h counterfactual",
            )
        )
    parts.append(_safety_case(metrics))
    if calibration is not None:
        parts.append(_calibration(calibration))
    parts += [
        "<h2>Returns</h2>",
        _img(plot_returns(metrics), "returns"),
        "<h2>Latency</h2>",
        _img(plot_latency(cols["latency_us"], metrics.get("control_period_s")), "latency"),
    ]
    parts.append("<h2>Counterfactual episode (animation)</h2>")
    if counterfactual is None:
        parts.append("<p class='note'>animation skipped: field logs have no counterfactual pass</p>")
    else:
        from pipeline.evaluation.animation import render_animation

        fps = 1.0 / metrics["control_period_s"] if metrics.get("control_period_s") else 25.0
        gif, note = render_animation(cfg.task.env_id, counterfactual.states, out_dir / ANIMATION_FILE, fps=fps)
        if gif is not None:
            parts.append(_img(base64.b64encode(gif.read_bytes()).decode(), "counterfactual animation", "image/gif"))
        parts.append(f"<p class='note'>{html.escape(note)}</p>")
    parts += ["<h2>All metrics</h2>", _metrics_table(metrics)]
    source = (
        metrics.get("log") if metrics.get("source") == "field_log" else f"simulation, domains {metrics.get('domains')}"
    )
    head = (
        f"<h1>Shadow report: {html.escape(cfg.task.name)}</h1><p>candidate bundle <code>{html.escape(str(bundle_dir))}"
        f"</code> ({_version_text(meta.get('bundle_version'))}) vs legacy; "
        f"source: {html.escape(str(source))}; {metrics['episodes']} episodes, {metrics['steps']} steps"
        f"{_seed_range(metrics.get('seeds'))}.</p>"
    )
    doc = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>sim2real shadow report: "
        f"{html.escape(cfg.task.name)}</title><style>{_CSS}</style></head><body>{head}{''.join(parts)}</body></html>"
    )
    path = out_dir / REPORT_FILE
    path.write_text(doc, encoding="utf-8")
    return path
