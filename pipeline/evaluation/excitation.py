"""Is an excitation plan safe wherever the plant may be? Legacy + plan replayed on every corner of `reality`.

Each corner (each range at one end, latency included) runs one episode of the
plan's length with the legacy controller plus the sequence, through the
config's shield; where the shield changed the perturbed action, the raw
sequence is replayed unshielded too, as a legacy loop without a shield applies
it. A run that crossed a limit or lost the plant (the task terminating) is
compared with the legacy controller alone, run the same way on the same seed:
a plan that adds a violation or a lost plant at any corner is ruled out.
"""

from __future__ import annotations

import json

import numpy as np

from pipeline.calibration.plan import ExcitedLegacy
from pipeline.evaluation.evaluate import evaluate
from pipeline.evaluation.falsify import corner_domains


def corner_check(cfg, sequence: np.ndarray, seed: int) -> dict:
    """Replay legacy + sequence (steps, act_dim) on every corner of `reality`, shielded, and raw where the shield
    acted. Figures: corners, steps, violations, interventions, drops (plants the plan lost), the corners that
    failed, and `safe`."""
    from pipeline.safety.shield_spec import build_shield_spec

    spec = build_shield_spec(cfg)
    rset = cfg.randomization.get("reality") or cfg.randomization["train"]
    # A range with low == high has one end: its two "corners" are the same plant.
    corners = list({json.dumps(d, sort_keys=True): d for d in corner_domains(rset)}.values())
    steps = len(sequence)
    out: dict = {"corners": len(corners), "steps": steps, "violations": 0, "interventions": 0, "drops": 0}
    out.update(raw_replays=0, raw_violations=0, drops_without_plan=0, violations_without_plan=0, min_h=None)
    out["failed"] = []

    def run(seq, dom, i, shield=True):
        policy = ExcitedLegacy(cfg.task.env_id, seq)
        return evaluate(
            cfg, policy, domains=dom, episodes=1, seed=seed + i, shield=shield, spec=spec, max_episode_steps=steps
        )

    for i, dom in enumerate(corners):
        shielded = run(sequence, dom, i)
        runs = [(shielded, True)]
        out["interventions"] += round(shielded["intervention_rate"] * shielded["steps"])
        out["violations"] += shielded["violations"]
        if shielded["min_h"] is not None:
            out["min_h"] = shielded["min_h"] if out["min_h"] is None else min(out["min_h"], shielded["min_h"])
        if shielded["intervention_rate"] > 0:  # an unshielded legacy loop applies the sequence as it is
            raw = run(sequence, dom, i, shield=False)
            runs.append((raw, False))
            out["raw_replays"] += 1
            out["raw_violations"] += raw["violations"]
        failed = False
        for r, shield in runs:
            if r["steps"] < steps or r["violations"]:
                # The legacy controller alone, the same way (shielded or not), same seed: what the plan adds.
                alone = run(np.zeros_like(sequence), dom, i, shield=shield)
                lost = r["steps"] < steps and alone["steps"] >= steps
                out["drops"] += lost
                out["drops_without_plan"] += r["steps"] < steps and not lost
                out["violations_without_plan"] += alone["violations"]
                failed = failed or lost or r["violations"] > alone["violations"]
        if failed:
            out["failed"].append({k: v["low"] for k, v in _flat_domain(dom).items()})
    out["safe"] = not out["failed"]
    return out


def _flat_domain(dom: dict) -> dict:
    """A pinned domain mapping as name -> range (latency included), for messages."""
    out = {}
    for group, entries in dom.items():
        if isinstance(entries, dict) and "low" not in entries:
            out.update({f"{group}.{el}": r for el, r in entries.items() if isinstance(r, dict)})
        elif isinstance(entries, dict):
            out[group] = entries
    return out
