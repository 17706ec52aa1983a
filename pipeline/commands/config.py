"""`sim2real config`: document every config key, or validate a file (`--check FILE`)."""

from __future__ import annotations

import argparse

from pipeline.commands import command, emit


@command("config")
def run(args: argparse.Namespace) -> int:
    from pipeline.commands import UsageError
    from pipeline.config import describe_fields, load_config

    if args.check and args.config and args.check != args.config:
        raise UsageError(f"config: --check {args.check} and --config {args.config} name two files; name one")
    path = args.check or args.config
    if args.check is not None and not path:
        raise UsageError("config --check needs the file to validate: `sim2real config --check FILE`")
    if path:
        from pipeline.training.rollout import plant_notes, preflight

        args.check = path  # the messages below name the file as it was given
        cfg = load_config(path)
        preflight(cfg)  # every set runs the env once, the legacy controller answers: or the key to change
        figures = None
        if cfg.shield.enabled:  # every randomization set must lie inside the shield's assumptions
            from pipeline.safety.shield_spec import build_shield_spec, needs_synthesis

            spec = build_shield_spec(cfg)  # EnvelopeError (a ConfigError) names set, parameter, range and limit
            figures = shield_figures(spec, synthesized=needs_synthesis(cfg.shield))
        starts, targets = plant_notes(cfg)
        gate = gate_note(cfg.gate)
        clock = falsify_note(cfg.falsify)
        human = f"{args.check}: ok (task {cfg.task.name}, hash {cfg.config_hash()[:12]})"
        for note in (starts, *targets, gate, clock):
            if note:
                human += f"\nnote: {note}"
        if figures is not None:
            human += "\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items() if k != "sets")
            # The check measures and checks the shield's numbers; it does not search for a plant and an attack
            # that break it (a minute or more): an ok here is not yet a certificate.
            human += (
                f"\nnext: `sim2real shield synthesize --config {args.check}` certifies the shield: it falsifies it "
                f"(falsify.candidates, {cfg.falsify.candidates} candidates) and runs the legacy controller behind it "
                "on reality, and refuses it naming why; the retrain flow does the same before its gate"
            )
        result = {"ok": True, "task": cfg.task.name, "config_hash": cfg.config_hash(), "shield": figures}
        notes = {"starts_note": starts, "targets_notes": targets, "gate_note": gate, "falsify_note": clock}
        emit(args, {**result, **notes}, human)
        return 0
    rows = describe_fields()
    width = max(len(k) for k, *_ in rows)
    human = "\n".join(f"{k:<{width}}  {d}" + (f"  ({t}, default {v})" if v else f"  ({t})") for k, t, v, d in rows)
    emit(args, {"fields": [{"key": k, "type": t, "default": v, "description": d} for k, t, v, d in rows]}, human)
    return 0


def gate_note(gate) -> str | None:
    """A gate whose episode budget is below the fewest episodes a return comparison may pass on cannot promote
    (every night ends inconclusive, or fails): said, not refused, since a wiring test may want exactly that."""
    if gate.max_episodes >= gate.min_episodes:
        return None
    return (
        f"gate.max_episodes ({gate.max_episodes}) is below gate.min_episodes ({gate.min_episodes}): no return "
        "comparison can pass on so few episodes, so no night can promote (each ends inconclusive, or fails); "
        "raise gate.max_episodes"
    )


def falsify_note(search) -> str | None:
    """A clock on the gate's search makes its verdict depend on how busy the machine is: said, not refused (a
    wiring test, or a user who wants a bound on the night, may want exactly that)."""
    if search.budget_s is None:
        return None
    return (
        f"falsify.budget_s ({search.budget_s:g} s) caps the retrain flow's search by the clock: on a busy machine it "
        f"may end before falsify.candidates ({search.candidates}) and pass a bundle a quiet one would fail; unset it "
        "for the same verdict on any machine (shield synthesize does not read it)"
    )


def shield_figures(spec: dict, synthesized: bool) -> dict:
    """What the check measured and the shield will assume: braking authority, model error, input gain, latency,
    noise, pushes and the monitor's bounds, per position where they are per position; per set, what each admits."""
    a = spec.get("assumptions", {})
    kin = spec.get("kinematics", {})
    predictive = spec.get("predictive")
    return {
        "synthesized": synthesized,
        # Which filter keeps the constraints (`shield synthesize` says why and certifies it).
        "filter": f"predictive (horizon {predictive['horizon']} steps)" if predictive else "braking barrier",
        "margin": spec.get("margin"),
        "brake_accel": kin.get("brake_accel"),
        # The predictive filter reads no braking figure; the schema still needs a positive one per position.
        **({"brake_accel_note": _brake_note(spec)} if predictive else {}),
        "max_accel_error": a.get("max_accel_error"),
        "input_gain_error": a.get("max_input_gain_error"),
        "input_gain_range": spec.get("input_gain_range"),
        "disturbance_accel": a.get("max_disturbance_accel"),
        "push_velocity": a.get("max_push_velocity"),
        "latency_steps": [spec.get("latency_min_steps", spec.get("latency_steps")), spec.get("latency_steps")],
        "obs_noise_std": a.get("obs_noise_std"),
        "monitor_accel": (a.get("monitor") or {}).get("accel"),
        # The check writes the monitor's bounds down from the declared disturbances; a bundle's are measured.
        "monitor_bounds": "measured over the sets"
        if "measured" in (a.get("monitor") or {})
        else "from the declared disturbances (export measures the bundle's over the sets)",
        "sets": a.get("sets"),
    }


def _brake_note(spec: dict) -> str:
    """What `brake_accel` means under the predictive filter, naming the coordinates whose figure is a floor."""
    synthesis = (spec.get("assumptions") or {}).get("synthesis") or {}
    measured, names = synthesis.get("authority_accel") or [], synthesis.get("names") or []
    floors = [name for name, pair in zip(names, measured) if min(pair) <= 0.0]
    where = (
        f"for {', '.join(floors)} synthesis measured no braking at the worst admitted state (<= 0: the drive does "
        "not reach it, or another body's pull outweighs the drive there), so its figure is a floor of 1 % of the "
        "nominal full-action acceleration, not a measurement"
        if floors
        else "every figure here is the braking synthesis measured"
    )
    return f"not read by the predictive filter, which keeps the constraints by its plans; {where}"
