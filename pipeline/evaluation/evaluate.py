"""Run a policy (bundle, legacy, random or adversarial) on randomized domains, with or without the shield.

`evaluate(cfg, policy, ...)` serves `sim2real eval` (pipeline.commands.eval),
falsify, the benches and the tests. The episodes run in the one episode runner
(`pipeline.evaluation.episodes`), so eval, shadow and the benches measure the
same way: a violation is a step whose `info["cost"]` is 1.
"""

from __future__ import annotations

from typing import Any

# The reference policies live in pipeline.evaluation.adversary (re-exported here for callers).
from pipeline.evaluation.adversary import reference_policy  # noqa: F401
from pipeline.evaluation.episodes import (
    EvalResult,
    PolicyDriver,
    RuntimeDriver,
    check_bundle_task,
    control_period_s,
    domains_label,
    make_env,
    outside_sets,
    resolve_domains,
    run_episodes,
)
from shield.cbf import CbfShield
from shield.spec import ShieldSpec

__all__ = ["evaluate", "reference_policy"]


# Said wherever episodes run behind a shield built from the config rather than a bundle's: nothing certified it, and
# an outside user read 0 violations behind a shield `shield synthesize` had refused as if it were verified.
UNCERTIFIED_NOTE = (
    "the shield here is synthesized from the config (the one `sim2real shield synthesize --config` builds for "
    "it), and this run has not certified it: that command falsifies it and runs your legacy controller behind "
    "it, and says CERTIFIED or refuses it naming why; only a certified shield promises no violating step"
)


def _as_spec(spec: dict | ShieldSpec) -> ShieldSpec:
    return spec if isinstance(spec, ShieldSpec) else ShieldSpec.from_dict(spec)


def evaluate(
    cfg,
    policy,
    *,
    domains: Any = "train",
    episodes: int = 20,
    seed: int = 0,
    shield: bool = True,
    spec: dict | ShieldSpec | None = None,
    max_episode_steps: int | None = None,
    progress: bool = False,
    past_termination: bool = False,
) -> EvalResult:
    """Run `policy` for `episodes` seeded episodes (seeds seed, seed + 1, ...); returns returns, violations and
    shield figures. `policy` is a batch policy, shielded here by `spec` (default: built from the config), or an
    EdgeRuntime, which brings its own shield (shield.json; `spec`'s where given) and is run as `serve` runs it.
    `past_termination`: step on past the task's termination (a fallen pole) to the episode's length, as a real
    plant goes on: the shield's job does not end where the task's does."""
    from shield.runtime import EdgeRuntime

    note = None
    if isinstance(policy, EdgeRuntime):
        bundle = policy.verified_bundle
        given = shield and spec is not None
        note = (
            check_bundle_task(cfg, bundle.manifest, bundle.path, behind="behind the shield given")
            if given
            else check_bundle_task(cfg, bundle.manifest, bundle.path)
        )
        if shield != policy.shielded or given:
            # The same bundle, bare or with a shield: its shield.json's, or `spec` where one is given (a case replayed
            # against the spec it was found on, `falsify --replay CASE --bundle B --shield S`, which ran the bundle's
            # own shield whatever --shield said).
            own = CbfShield(_as_spec(spec if spec is not None else bundle.shield_spec)) if shield else None
            policy = EdgeRuntime(bundle, policy.policy, own)
        driver: RuntimeDriver | PolicyDriver = RuntimeDriver(policy)
    else:
        cbf = None
        if shield:
            if spec is None:
                from pipeline.safety.shield_spec import build_shield_spec

                spec = build_shield_spec(cfg)
                note = UNCERTIFIED_NOTE
            cbf = CbfShield(_as_spec(spec))
        driver = PolicyDriver(policy, cbf)
    rset = resolve_domains(cfg, domains)
    notes = [note] if note else []
    outside = outside_sets(cfg, rset) if rset is not None and rset not in cfg.randomization.values() else []
    if outside and shield:
        notes.append(
            f"these domains reach past every set of the config, which the shield's numbers were synthesized for: "
            f"{'; '.join(outside)}. Nothing certifies it there; its monitor (envelope_rate) flags a plant that "
            f"strays from the model further than any of those sets' plants did (a steady force, more latency, a "
            f"body ringing otherwise), not every plant outside, so read violations and fallbacks, not the flag alone"
        )
    env = make_env(cfg, rset, max_episode_steps)
    try:
        totals = run_episodes(
            env,
            driver,
            list(range(seed, seed + episodes)),
            dt=control_period_s(cfg),
            progress="eval" if progress else None,
            past_termination=past_termination,
        )
    finally:
        env.close()
    return {
        "task": cfg.task.name,
        "domains": domains_label(domains),
        "shield": bool(shield),
        "seed": seed,
        **totals.summary(),
        "notes": notes,
    }
