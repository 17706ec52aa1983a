"""`sim2real shield synthesize`: measure the shield from the plant, falsify it, write shield.json and a certificate.

Exit 0 with a certificate; 1 with a refusal (`certificate.json` then says which
parameter and range cannot be certified, why, and the largest sub-range that can);
2 for a config synthesis cannot read (a user error).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path

from pipeline.commands import CHECK_FAILED, OK, UsageError, command, emit

LEGACY_EPISODES = 10  # reality episodes the legacy controller runs behind the synthesized shield
FALSIFIED_SPEC = "falsified-shield.json"  # the spec a refusal by falsification broke, for its replay


def add_arguments(p: argparse.ArgumentParser, default_config: str) -> None:
    """The `shield` command's parser (`pipeline/cli.py` registers it)."""
    sub = p.add_subparsers(dest="shield_cmd", required=True, metavar="ACTION")
    s = sub.add_parser(
        "synthesize",
        help="measure the shield's numbers from the MJCF and the randomization sets, "
        "falsify, and write shield.json + certificate.json (exit 1: refused)",
    )
    s.add_argument("--config", default=default_config, help=f"task config YAML (default {default_config})")
    s.add_argument("--out", help="folder for shield.json and certificate.json (default reports/shield-<task>)")
    s.add_argument(
        "--budget-s",
        type=float,
        help="cap the falsification by the clock (s), as well as by falsify.candidates; by default it has "
        "no clock, so its verdict for a seed is the same on any machine",
    )
    s.add_argument("--no-falsify", action="store_true", help="measure and build only (the certificate says so)")
    s.add_argument(
        "--episodes",
        type=int,
        default=LEGACY_EPISODES,
        help=f"reality episodes of the legacy controller behind the shield (default {LEGACY_EPISODES})",
    )
    s.add_argument(
        "--monitor-runs",
        type=int,
        help="shielded runs per randomization set that measure the assumption monitor's bounds (default: as many "
        "as an exported bundle's are measured with, so that with --seed 0 the shield.json certified is the one "
        "bundles of this config carry, byte for byte; 0: keep the bounds derived from the declared disturbances)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the measurement and the search")
    s.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")


@command("shield")
def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.safety import certificate, synthesis
    from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.episodes < 0:
        raise UsageError(f"--episodes must be >= 0, got {args.episodes}")
    if args.monitor_runs is None:
        from pipeline.evaluation.monitor_bounds import RUNS_PER_SET

        args.monitor_runs = RUNS_PER_SET
    if args.monitor_runs < 0:
        raise UsageError(f"--monitor-runs must be >= 0, got {args.monitor_runs}")
    cfg = load_config(args.config)
    out = Path(args.out or f"reports/shield-{cfg.task.name}")
    stage = _stages()
    stage("measuring the envelope: braking, model error and input gain over every set's plants")
    meas = synthesis.measure(cfg, seed=args.seed)
    refused = None
    problems = synthesis.authority_problems(meas)
    weak = synthesis.gain_problems(meas) if cfg.shield.input_gain_error is None else []
    if weak:  # a drive too weak for any shield model: no filter can count on it
        stage("the drive's effect falls too low or reverses somewhere: looking for a range that can be certified")
        refused = certificate.refusal(cfg, meas, weak)
    elif problems and (cfg.shield.brake_accel is not None or cfg.shield.brake_fraction is not None):
        refused = certificate.refusal(cfg, meas, problems)  # hand-set braking: the barrier, or nothing
    spec = None
    starts = None  # the predictive filter's start coverage, where a falsification refusal measured it
    if refused is None:
        stage(
            "building the shield: where braking cannot keep a limit, the predictive filter's backup and its tube "
            "(the plant run under the backup over every set's corners and draws: the longest part)"
        )
        try:
            spec = build_shield_spec(cfg, measurement=meas)
        except EnvelopeError as err:  # an override that does not cover the measurement, or a set outside the spec
            if problems:  # the braking barrier cannot, and the predictive filter could not either
                refused = both_refused(cfg, certificate.refusal(cfg, meas, problems), str(err))
            else:
                said = str(err)  # a refusal that already says what it cannot certify is not prefixed again
                message = said if said.startswith("cannot certify") else f"cannot certify {cfg.task.name}: {said}"
                refused = {"certified": False, "reason": said, "message": message}
                # No range named by a measured figure: a range pinned at nominal, or the latency the shield
                # predicts through, may be what it cannot cover.
                stage("refused: looking for a range, and the longest latency, that can be certified")
                ways = certificate.unblamed_ways(cfg, args.seed, progress=stage)
                refused.update(ways)
                refused["message"] += certificate.ways_line(ways)
    if spec is not None and args.monitor_runs:
        stage(f"measuring the assumption monitor's bounds ({args.monitor_runs} runs per set)")
        spec = _with_monitor(cfg, spec, args.monitor_runs, args.seed)
    falsified = falsified_spec = None
    if spec is not None and not args.no_falsify:
        clock = f", or {args.budget_s:g} s if sooner" if args.budget_s is not None else ""
        stage(
            f"falsifying: searching for a shielded violation ({cfg.falsify.candidates} candidates"
            f"{clock}, falsify.candidates)"
        )
        falsified = _falsify(cfg, spec, args, out)
        if falsified["cases_found"]:
            worst = falsified["cases"][0]
            ends, where = _case_plant(cfg, worst)
            reason = (
                f"falsify found {falsified['cases_found']} shielded violation(s) within the envelope, e.g. set "
                f"{worst['set']} at {where}, policy {worst['policy']}: {worst.get('violations', '?')} violating "
                f"step(s); "
            )
            on_nominal = _nominal_replay(cfg, worst, spec)
            if on_nominal:  # the range is not the cause: narrowing it would change nothing
                ends = []
                reason += (
                    f"the same attack from the same starts breaks it on the nominal plant too (no parameter "
                    f"randomized, no latency, noise or push: {on_nominal} violating step(s)), so no randomized range "
                    f"is the cause"
                )
                advice = (
                    "Check where the episodes start (plant.initial_state) against the constraints: a start near a "
                    "limit, or moving toward one faster than the shield can stop, is outside what any shield keeps; "
                    "else make the plant easier to hold (a stronger drive); narrowing a range or a smaller shield "
                    "number will not do"
                )
            else:
                reason += "the model error synthesis measured does not cover this plant"
                stage("replaying the case with each of its ends moved back to nominal, one at a time")
                moved = _one_at_a_time(cfg, worst, spec, ends)
                kept = [name for name, steps in moved if steps == 0]
                if moved:
                    reason += "; replayed with one of them moved back to nominal at a time: " + ", ".join(
                        f"{name} {'keeps it inside' if steps == 0 else f'{steps} violating step(s)'}"
                        for name, steps in moved
                    )
                advice = (
                    (
                        f"Narrow {' or '.join(kept)} first (back to nominal alone, it keeps this case inside), or "
                        if kept
                        else "Narrow the range(s) at the end(s) named (no one alone keeps this case inside: several "
                        "together), or "
                    )
                    + "make the plant easier to hold (a stronger drive, lighter pushes); a smaller shield number "
                    "will not do. Narrow a range only where your plant really lies inside the narrower one: a plant "
                    "past it is outside what is certified (helper-71's promoted policy, certified at 0-1 steps of "
                    "latency, left its limits in 26 of 30 episodes at 2), and `sim2real eval --domains` on a set at "
                    "the end you cut shows what it does there"
                )
            if "predictive" in spec:
                from pipeline.safety.predictive import start_coverage

                starts = start_coverage(cfg, spec)
                if starts and starts["not_admitted"]:
                    # Episodes started where the filter admits no plan run uncertified: a case found there is
                    # the start's as much as any range's (a ball on a plate started 5 cm off centre).
                    advice = f"First, {starts['message']}. {advice}"
            refused = {
                "certified": False,
                "falsification": falsified,
                "parameter": ends,
                "reason": reason,
                "message": f"cannot certify {cfg.task.name}: {reason}. {advice}. Replay (the same plant, seed, attack "
                f"and episode length, against the shield it broke): sim2real falsify --config {args.config} --replay "
                f"{worst.get('case_file')} --shield {out / FALSIFIED_SPEC}",
            }
            falsified_spec = spec
    if spec is not None and args.episodes:
        stage(f"the legacy controller behind the shield on reality ({args.episodes} episodes)")
    legacy = _legacy(cfg, spec, args) if spec is not None and args.episodes else None
    if refused is not None and legacy is not None and legacy["violations"] and "falsification" in refused:
        # Refused by a falsification case already: the legacy controller crossing too is said in the message, not
        # only in the record (helper-71: 115 violating steps of its LQR behind a refused shield, in the JSON alone).
        refused["message"] += (
            f". The legacy controller behind this shield left the safe set on reality too: {legacy['violations']} "
            f"violating step(s) in {legacy['violation_episodes']} of {legacy['episodes']} episodes (replay: sim2real "
            f"eval --config {args.config} --policy legacy --domains reality --episodes {args.episodes} --seed "
            f"{cfg.shadow.seed})"
        )
    if refused is None and legacy is not None and legacy["violations"]:
        # The certificate says no plant of the envelope leaves the safe set behind this shield; a legacy controller
        # that does on `reality` disproves it as surely as a falsification case.
        reason = (
            f"the legacy controller behind the shield left the safe set on reality: {legacy['violations']} "
            f"violating step(s) in {legacy['violation_episodes']} of {legacy['episodes']} episodes"
        )
        refused = {
            "certified": False,
            "reason": reason,
            "message": f"cannot certify {cfg.task.name}: {reason}. Replay: sim2real eval --config {args.config} "
            f"--policy legacy --domains reality --episodes {args.episodes} --seed {cfg.shadow.seed}",
        }
    out.mkdir(parents=True, exist_ok=True)
    if falsified_spec is not None:  # what the case's replay runs against; never a shield.json that could be shipped
        (out / FALSIFIED_SPEC).write_text(json.dumps(falsified_spec, indent=2) + "\n")
    if refused is not None:
        record = {
            **refused,
            "task": cfg.task.name,
            # The filter a refusal by falsification or by the legacy controller judged (None: none could be built).
            "filter": certificate.filter_record(spec, cfg, starts) if spec is not None else None,
            "envelope": certificate.envelope_record(cfg),
            "model_error": meas.record(),
            "legacy_on_reality": legacy,
        }
    else:
        from shield.bundle import sha256_bytes, shield_json_bytes

        record = certificate.certificate(cfg, meas, spec, falsified, legacy)
        # Written as a bundle writes it: its hash here is the one `sim2real registry show` gives the bundle's.
        certified = shield_json_bytes(spec)
        record["shield_sha256"] = sha256_bytes(certified)
        (out / "shield.json").write_bytes(certified)
    (out / "certificate.json").write_text(json.dumps(record, indent=2, default=_plain) + "\n")
    record["out"] = str(out)
    emit(args, record, _human(cfg, meas, spec, record, refused, out))
    return OK if refused is None else CHECK_FAILED


def _stages():
    """A line on stderr as each stage of synthesis starts, with the time so far: a plant whose tube or bisection
    takes many minutes printed nothing for 20 of them, and its owner could not tell working from stuck."""
    start = time.perf_counter()

    def stage(what: str) -> None:
        print(f"synthesize [{time.perf_counter() - start:6.0f} s]: {what}", file=sys.stderr, flush=True)

    return stage


def legacy_lines(legacy: dict | None, predictive: bool = True) -> list[str]:
    """What the legacy controller behind the shield met on reality: the share of its steps changed, its violating
    steps, and the share answered FALLBACK (the protocol's alarm) when there were any, said for the filter in use
    (`predictive`: the predictive filter's backup; else the braking barrier's least-violation brake)."""
    if not legacy:
        return []
    lines = [
        f"  legacy on reality behind the shield: {legacy['intervention_rate']:.1%} of steps changed, "
        f"{legacy['violations']} violating steps"
    ]
    if legacy.get("fallback_rate"):
        lines.append(
            f"  and {legacy['fallback_rate']:.1%} of its steps answered FALLBACK, the protocol's alarm: the "
            + (
                "shield's backup acting with nothing certifying it, as at an episode start outside the states the "
                "filter admits (plant.initial_state against the constraints less the tube) or past a limit"
                if predictive
                else "braking barrier found no action meeting its conditions and braked as hard as it could, with "
                "nothing certifying it (the model error it covers outran its braking there, or the plant was past "
                "a limit)"
            )
        )
    if legacy.get("fallback_starts"):
        lines.append(
            f"  {legacy['fallback_starts']} of its {legacy['episodes']} episodes started outside the states the "
            "filter admits: nothing is certified there until the backup has pulled the plant in. The certificate "
            "covers starts the filter admits; narrow plant.initial_state to have it cover every start"
        )
    return lines


def _case_plant(cfg, case: dict) -> tuple[list[str], str]:
    """The randomized parameters a falsification case fixed at an end of its set's range (their keys), and the
    case's plant in words: each scale with the end it sits at, its latency and its push."""
    from envs.randomization import parse_randomization
    from pipeline.safety.sampling import range_parameters, ranges

    configured = ranges(cfg.randomization[case["set"]])
    drawn = parse_randomization(case["domain"], "case")
    ends, words = [], []
    for name, lo, _ in range_parameters(drawn):
        c_lo, c_hi = configured.get(name, (lo, lo))
        end = "low" if math.isclose(lo, c_lo) else "high" if math.isclose(lo, c_hi) else None
        if end is not None and not math.isclose(c_lo, c_hi):
            ends.append(name)
        words.append(f"{name} {lo:.3g}x" + (f" (its {end} end)" if end else ""))
    if drawn.latency_steps is not None:
        words.append(f"latency {drawn.latency_steps.high} step(s)")
    if drawn.push is not None:
        words.append(f"pushes up to {drawn.push.max_force:g} N on {drawn.push.body}")
    return ends, ", ".join(words)


def _with_monitor(cfg, spec: dict, runs: int, seed: int) -> dict:
    """The spec with its assumption monitor's bounds measured over the envelope (`monitor_bounds`), so the monitor
    flags plants just past the envelope's edge; as it is where the spec has no monitor (no noise figures)."""
    from pipeline.evaluation.monitor_bounds import with_measured_monitor

    try:
        return with_measured_monitor(cfg, spec, runs_per_set=runs, seed=seed)
    except ValueError:  # the monitor is off for this spec: nothing to measure
        return spec


def _falsify(cfg, spec: dict, args, out: Path) -> dict:
    from pipeline.evaluation.falsify import falsify, record

    # A count, not a clock: a clock's budget searched a fraction as much on a busy machine, so the same config and
    # seed were certified there and refused on a quiet one. --budget-s adds a clock for whoever asks for one.
    result = falsify(
        cfg,
        spec=spec,
        budget_s=math.inf if args.budget_s is None else args.budget_s,
        seed=args.seed,
        out_dir=out / "falsify",
        progress=not args.json,
    )
    return record(result, cases=True)


# Where a refusal's message breaks into lines: its "; " and its sentence ends (not "e.g. set", not "1.5x").
_CLAUSE = re.compile(r"; |(?<=[a-z)\]])\. (?=[A-Z])")


def _one_at_a_time(cfg, case: dict, spec: dict, ends: list[str]) -> list[tuple[str, int]]:
    """(parameter, violating steps) of the case replayed with that one parameter back at nominal (1x, or its
    range's middle; a latency at its set's shortest), the rest as the case had them: fewest first. A case at a
    corner sits at an end of every range, and naming them all says nothing of which one to narrow. [] for a
    bundle's case."""
    from pipeline.evaluation.falsify import pin, replay_case
    from pipeline.safety.certificate import nominal_value
    from pipeline.safety.sampling import ranges
    from shield.spec import ShieldSpec

    if case.get("policy") == "bundle":
        return []
    rset = cfg.randomization[case["set"]]
    configured = ranges(rset)
    moves = [(name, pin(copy.deepcopy(case["domain"]), name, nominal_value(*configured[name]))) for name in ends]
    latency = (case["domain"].get("latency_steps") or {}).get("high")
    if rset.latency_steps is not None and latency is not None and latency > rset.latency_steps.low:
        shortest = rset.latency_steps.low
        moves.append((f"latency_steps (to {shortest})", pin(copy.deepcopy(case["domain"]), "latency_steps", shortest)))
    shield_spec = ShieldSpec.from_dict(spec)
    out = [
        (name, int(replay_case(cfg, {**case, "domain": domain}, shield_spec)["violations"])) for name, domain in moves
    ]
    return sorted(out, key=lambda t: t[1])


def _nominal_replay(cfg, case: dict, spec: dict) -> int:
    """Violating steps when a falsification case (a reference policy's) runs again on the nominal plant: the same
    policy, attack, seeds (so the same starts) and length, with nothing randomized. 0 for a bundle's case."""
    from pipeline.evaluation.falsify import replay_case
    from shield.spec import ShieldSpec

    if case.get("policy") == "bundle":
        return 0
    return int(replay_case(cfg, {**case, "domain": {}}, ShieldSpec.from_dict(spec))["violations"])


def _legacy(cfg, spec: dict, args) -> dict:
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from shield.spec import ShieldSpec

    shield_spec = ShieldSpec.from_dict(spec)
    result = evaluate(
        cfg,
        reference_policy("legacy", cfg, shield_spec, seed=cfg.shadow.seed),
        domains="reality",
        episodes=args.episodes,
        seed=cfg.shadow.seed,
        shield=True,
        spec=shield_spec,
    )
    keep = (
        "episodes",
        "steps",
        "return_mean",
        "violations",
        "violation_episodes",
        "intervention_rate",
        "fallback_rate",
        "fallback_starts",
        "backup_rate",
        "min_h",
    )
    return {k: result.get(k) for k in keep}


def _plain(obj):
    return obj.tolist() if hasattr(obj, "tolist") else str(obj)


def _rounded(x):
    """Numbers (nested in lists) to 4 significant digits, for reading: the files keep every digit."""
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return float(f"{x:.4g}") if isinstance(x, float) else x


def _units(cfg) -> dict[str, str]:
    """Each observation's declared unit by name ("" where the task declares none)."""
    import envs
    from pipeline.deployment.contract import task_io

    task = envs.task(cfg.task.env_id)
    io, _ = task_io(cfg.task.env_id, task.obs_dim, task.act_dim)
    return {o["name"]: o.get("unit") or "" for o in io["observations"]}


def _predictive_own(said: str) -> str:
    """The predictive filter's own reason in a refusal of both filters (the braking refusal before it cut off)."""
    from pipeline.safety.shield_spec import PREDICTIVE_TOO

    return said.split(PREDICTIVE_TOO, 1)[1] if PREDICTIVE_TOO in said else said


def both_refused(cfg, braking: dict, predictive: str) -> dict:
    """The refusal where neither filter keeps the plant: the braking barrier's (`braking`, from
    `certificate.refusal`) leads where it names a sub-range that certifies, a way to a certificate; where it names
    none, it is a dead end for a plant whose limits braking cannot keep anyway, and the predictive filter's reason,
    the filter such a plant needs, leads instead (helper-70's refusal led with "no sub-range ... can be
    certified", and the reason that mattered came last)."""
    out = {**braking, "predictive": predictive}
    if braking.get("certifiable_range"):
        return out
    out["braking"] = braking["message"].removeprefix("cannot certify ")
    out["message"] = (
        f"cannot certify {cfg.task.name}: the predictive filter, which keeps what braking cannot, cannot keep it: "
        f"{_predictive_own(predictive)}"
    )
    return out


def _human(cfg, meas, spec, record, refused, out: Path) -> str:
    from pipeline.evaluation.episodes import MIN_H_MEANING
    from pipeline.evaluation.falsify import extent
    from pipeline.safety import certificate

    head = (
        f"shield synthesis for {cfg.task.name}: {meas.samples} residual samples on {meas.domains} plants "
        f"in {meas.wall_s:.1f} s"
    )
    lines = [head]
    units = _units(cfg)
    for k, name in enumerate(meas.names):
        lo, hi = meas.gain_range[k]
        law = meas.residual_law[k]
        accel = f"{units[name]}/s^2" if units.get(name) else "units/s^2"
        lines.append(
            f"  {name}: braking {meas.authority[k][0]:.3g} / {meas.authority[k][1]:.3g} {accel} "
            # The accelerations point toward - / +: each brakes a motion the other way (read as the motion's
            # direction, "toward -" was taken for the falling side).
            f"(braking a motion toward + / toward -"
            f"{'; below 0: the drive cannot brake it there' if min(meas.authority[k]) < 0 else ''}), "
            f"model error <= {meas.residual_accel[k]:.3g} {accel} (law {law['accel']:.4g} + "
            f"{law['per_unit']:.4g} x {law['feature']}), input gain {lo:.3f} .. {hi:.3f} x nominal"
        )
    if refused is not None:
        # One clause a line: a refusal runs to a thousand characters, one line of which no terminal shows whole.
        lines.append("REFUSED: " + "\n  ".join(_CLAUSE.split(refused["message"])))
        if refused.get("braking"):  # led by the predictive filter's reason: the barrier's follows
            lines.append("  and the braking barrier cannot either: " + "\n  ".join(_CLAUSE.split(refused["braking"])))
        elif refused.get("predictive"):  # both filters were refused: the predictive filter's own reason too
            lines.append(
                "  and the predictive filter, which keeps what braking cannot, cannot either: "
                + _predictive_own(refused["predictive"])
            )
    else:
        falsified = record.get("falsification")
        # The predictive filter keeps its constraints tightened by its tube: a margin as wide as a band (helper-67's
        # 0.794 beside a 0.25 rad limit) read as a shield that could admit nothing.
        units = "in each constraint's own units" + (
            "; the predictive filter tightens its limits by its tube, below, not by it" if "predictive" in spec else ""
        )
        lines.append(
            f"CERTIFIED: margin {spec['margin']:g} ({units}), "
            f"brake {_rounded(spec['kinematics']['brake_accel'])}, disturbance {_rounded(spec['disturbance_accel'])}, "
            f"input_gain_error {spec['input_gain_error']:g}"
        )
        if "predictive" in spec:
            pr = spec["predictive"]
            grows = pr["measured"].get("state_dependent")
            tube = (
                f"tube at rest {[round(t, 3) for t in grows['largest_at_rest']]}, at {grows['reference']} "
                f"{[round(t, 3) for t in grows['largest_at_the_reference']]}"
                if grows and "largest_at_the_reference" in grows
                else f"tube at the horizon {[round(t, 3) for t in pr['tube'][-1]]}"
            )
            lines.append(
                f"  filter: predictive (horizon {pr['horizon']} steps, backup gain {_rounded(pr['backup_gain'])}, "
                f"{tube}), chosen where a braking barrier cannot keep a limit: {pr['measured']['why'][0]}"
            )
            starts = (record.get("filter") or {}).get("starts")
            if starts:
                lines.append(
                    f"  starts: all {starts['corners']} corners of plant.initial_state admitted from the first step"
                    if not starts["not_admitted"]
                    else f"  starts, NOT all certified: {starts['message']}"
                )
            if grows and grows.get("held_out"):
                rounds = "; ".join(
                    f"{r['plans']} plans, {r['share_missed']:.2%} past it, by up to x{r['largest_error_over_bound']}"
                    for r in grows["held_out"]
                )
                lines.append(
                    f"  tube checked on fresh plans it was not fitted to, per round ({rounds}): fitted to all "
                    f"{grows['plans']}, then x{grows['scaled_by']} (what the last round missed by, at least 1)"
                )
                if "validation" in grows:
                    v = grows["validation"]
                    lines.append(
                        f"  the tube shipped, on {v['plans']} more fresh plans: {v['missed']} past it"
                        + (f" (by up to x{v['largest_error_over_tube']})" if v["missed"] else "")
                        + f"; a plan drawn as these were leaves it with probability at most "
                        f"{v['share_missed_at_most']:.2%} ({v['confidence']:.0%} confidence)"
                    )
        if falsified:
            lines.append(
                f"  falsify: {extent(falsified, '--budget-s')}, lowest h {_rounded(falsified['min_h'])} "
                f"({MIN_H_MEANING})"
            )
    lines += legacy_lines(record.get("legacy_on_reality"), (record.get("filter") or {}).get("type") != "barrier")
    if record.get("conservative"):
        lines.append(f"  {certificate.conservative_line(record['conservative'])}")
    lines.append(f"  written: {out / 'certificate.json'}" + ("" if refused else f", {out / 'shield.json'}"))
    if not refused:
        lines.append(
            f"  shield.json sha256 {record['shield_sha256'][:16]}...: `sim2real registry show` gives a bundle's; "
            "one exported from this config carries this file where both were measured with the default seed and "
            "monitor runs"
        )
    return "\n".join(lines)
