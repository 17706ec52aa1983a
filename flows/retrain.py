"""The nightly `retrain` flow: [calibrate ->] train -> export -> falsify -> shadow -> gate -> register -> promote.

Production is the incumbent: the shadow step runs the current production
version in the same paired episodes as the candidate and legacy, and the
candidate is promoted only if it is better than both at the gate's
confidence. Every night runs on its own block of episode seeds (its plants,
starts and pushes), so no night decides on the plants that earlier nights'
candidates were chosen on. A candidate that is not better than production is
registered and production is kept ("kept v3: v4 not better"); the flow still
completes, as nothing went wrong. A failed gate, or one whose budget ran out undecided, is the
flow's expected "no": the run ends Failed with the summary as its data (no
exception, so no traceback). Each registered version records why it was or was
not promoted (`sim2real registry list`).

With field logs (`from_log`), the flow first calibrates the twin to them
(pipeline.calibration), trains on `train` ranges re-centred on what was
identified, shadow-evaluates on the `calibrated` set as well as `reality`, and
the candidate must pass the gate on both. The report and the summary show the
payoff: the twin's prediction error on the log before and after, and the
candidate against production on the calibrated set in the same episodes.

Orchestration only: every step is a function of `pipeline`, and tasks pass
config paths, directories and plain dicts, never live objects (NOTES: unhashable
inputs break caching). All Ray work stays inside the one coarse `train` task.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.context import get_run_context
from prefect.states import Failed

from pipeline.config import load_config
from pipeline.deployment.export import export_policy
from pipeline.deployment.registry import Registry
from pipeline.evaluation.episodes import MIN_H_MEANING
from pipeline.evaluation.falsify import extent
from pipeline.evaluation.gate import promotion_verdict, with_paths
from pipeline.evaluation.monitor_bounds import bundle_spec
from pipeline.evaluation.payoff import payoff
from pipeline.evaluation.shadow import night_seed, run_shadow
from pipeline.evaluation.shadow_metrics import side_by_side
from pipeline.training.checkpoint import list_checkpoints
from pipeline.training.metrics import trim_to_checkpoint
from pipeline.training.train import is_adaptive, train
from shield.bundle import BundleError, sha256_bytes

# Fault drills: SIM2REAL_FAULT_DRILL="train:1" makes the first attempt of the
# `train` task raise a transient error, to exercise retries end to end.
FAULT_DRILL_ENV = "SIM2REAL_FAULT_DRILL"


class ProductionUnreadable(RuntimeError):
    """The production bundle does not verify: the night stops before training (its message says what to do)."""


class TransientFault(RuntimeError):
    """A failure worth retrying (a drill, a Ray start that timed out, ...)."""


def _fault_drill(step: str) -> None:
    spec = dict(item.split(":") for item in os.environ.get(FAULT_DRILL_ENV, "").split(",") if ":" in item)
    if step in spec and get_run_context().task_run.run_count <= int(spec[step]):
        raise TransientFault(f"fault drill: {step} attempt {get_run_context().task_run.run_count} fails on purpose")


def _run_tag() -> str:
    """This task run's folder tag: its id's leading (time-ordered) 8 hex digits and its trailing (random) 6. The
    leading ones alone change about once a minute (Prefect's ids are UUIDv7): two nights started within the same
    minute trained into one folder, and each registered the other's bundle. A retry keeps its task run's id."""
    run_id = get_run_context().task_run.id.hex
    return f"{run_id[:8]}-{run_id[-6:]}"


@task(name="calibrate", retries=0, persist_result=True)
def calibrate_step(config_path: str, from_log: str, runs_dir: str) -> dict:
    """Fit the twin to field logs; write the re-centred config; stop if the shield's envelope misses the result."""
    from pipeline.calibration.calibrate import calibrate, write_calibrated_yaml
    from pipeline.calibration.sets import recentred_training
    from pipeline.config import parse_config
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(config_path)
    result = calibrate(cfg, from_log)
    out = Path(runs_dir) / f"calibration-{_run_tag()}"
    out.mkdir(parents=True, exist_ok=True)
    write_calibrated_yaml(result, out / "calibrated.yaml")
    derived = out / f"{cfg.task.name}-calibrated.yaml"
    data = recentred_training(cfg, result)
    derived.write_text(yaml.safe_dump(data, sort_keys=False))
    # The shield's assumptions must still hold on every set the candidate meets, the calibrated one included:
    # building the spec for the derived config runs the safety case's envelope check, whose error stops the flow.
    build_shield_spec(parse_config(data, str(derived)))
    (out / "calibration.json").write_text(json.dumps(result, indent=1, default=float))
    if result.get("verdict"):  # a misfit twin or a plant outside the ranges: nothing trained on it may ship
        from pipeline.calibration.logs import CalibrationError

        raise CalibrationError(f"--from-log {from_log}: " + "; ".join(result["verdict"]))
    return {"config_path": str(derived), "calibrated": str(out / "calibrated.yaml"), "result": result}


@task(name="train", retries=2, retry_delay_seconds=5, persist_result=True)
def train_step(
    config_path: str,
    runs_dir: str,
    steps: int | None,
    ray_address: str | None,
    resume: str | None = None,
    again: str = "sim2real run",
) -> dict:
    """Train on Ray (local, or the cluster at ray_address / RAY_ADDRESS); `resume`: a run directory to continue
    from its latest checkpoint (`sim2real run --resume`, after a night that was killed while it trained); `again`:
    the command that ran this night, for the log line that says how to continue it."""
    _fault_drill("train")
    cfg = load_config(config_path)
    if resume is None:
        out_dir = Path(runs_dir) / f"{cfg.task.name}-{_run_tag()}"
        # A retry keeps its task run's id, so its folder is the failed attempt's. Trained over, it held two
        # attempts' checkpoints, numbered alike, and the newest could be the failed one's. It continues from the
        # failed attempt's last checkpoint instead, as Ray Tune restores a failed trial. An adaptive run cannot
        # resume (its teacher's checkpoints live in a folder of their own): it starts again in an empty folder.
        if is_adaptive(cfg) and out_dir.is_dir() and any(out_dir.iterdir()):
            shutil.rmtree(out_dir)
        elif list_checkpoints(out_dir):
            resume = str(out_dir)
    else:
        out_dir = Path(resume)
    if resume is not None:
        trim_to_checkpoint(resume)
    get_run_logger().info(
        "%s %s (a night stopped while it trains continues with `%s --resume %s`)",
        "continuing the training in" if resume else "training into",
        out_dir,
        again,
        out_dir.resolve(),
    )
    return train(cfg, out_dir=out_dir, steps=steps, ray_address=ray_address, resume=resume, progress=True).to_dict()


@task(name="export", retries=1, retry_delay_seconds=2, persist_result=True)
def export_step(run_dir: str, models_root: str) -> dict:
    """Export the run's policy to a staged bundle; the export refuses on a parity failure."""
    staged = Path(run_dir) / "bundle"
    shutil.rmtree(staged, ignore_errors=True)  # a retried attempt starts from a clean staging dir
    _fault_drill("export")
    return export_policy(run_dir, out_dir=staged, registry_root=models_root, shield_spec=bundle_spec)


@task(name="falsify", retries=0, persist_result=True)
def falsify_step(bundle_dir: str, config_path: str, out_dir: str, seed: int | None = None) -> dict:
    """Search the config's envelope for a shielded violation of the bundle (falsify.candidates, and falsify.budget_s
    where one is set), from the search seed `seed` (default falsify.seed)."""
    from pipeline.evaluation.falsify import falsify, record

    result = falsify(load_config(config_path), bundle=bundle_dir, out_dir=out_dir, seed=seed)
    return record(result)


@task(name="shadow", retries=0, persist_result=True)
def shadow_step(
    bundle_dir: str,
    config_path: str,
    report_dir: str,
    falsification: dict | None = None,
    domains: str | None = None,
    calibration: dict | None = None,
    production_dir: str | None = None,
    seed: int | None = None,
) -> dict:
    """Shadow pass beside the legacy controller, counterfactual pass, production on the same seeds (from `seed`),
    sequential gate decision (with falsify's cases), report (with the twin's calibration, when the flow calibrated
    it)."""
    _fault_drill("shadow")
    cfg = load_config(config_path)
    return run_shadow(
        bundle_dir,
        cfg,
        domains=domains or cfg.shadow.domains,
        report_dir=report_dir,
        falsification=falsification,
        calibration=calibration,
        production_dir=production_dir,
        seed=seed,
    )


@task(name="register", retries=1, retry_delay_seconds=2, persist_result=True)
def register_step(
    bundle_dir: str, models_root: str, metrics: dict, flow_run_id: str, task_name: str, production: int | None = None
) -> int:
    """Copy the bundle into the registry as a new version, with its shadow metrics and why it is (not) promoted."""
    _fault_drill("register")
    registry = Registry(models_root)
    version = registry.register(bundle_dir, metrics=metrics, extra={"prefect_flow_run_id": flow_run_id})
    gate = {
        **metrics["gate"],
        "verdict": promotion_verdict(
            metrics["gate"]["decision"],
            version,
            production,
            metrics["gate"]["reasons"],
            metrics["gate"].get("loosened", []),
        ),
    }
    registry.annotate(task_name, version, metrics={"gate": gate})
    return version


@task(name="promote", retries=1, retry_delay_seconds=2, persist_result=True)
def promote_step(models_root: str, task_name: str, version: int, against: int | None) -> str | None:
    """Move the production pointer to the new version (atomic), logged as the gate's move, only if production is
    still `against`, the version the gate judged the candidate against; else why not (a night that ran beside
    this one on the same registry promoted first)."""
    from pipeline.deployment.registry import ProductionMoved

    _fault_drill("promote")
    try:
        Registry(models_root).promote(task_name, version, by="gate", expected_production=against)
    except ProductionMoved as err:
        return str(err)
    return None


@flow(name="retrain", log_prints=True)
def retrain(
    config_path: str = "configs/cartpole.yaml",
    models_root: str = "models",
    runs_dir: str = "runs",
    steps: int | None = None,
    ray_address: str | None = None,
    from_log: str | None = None,
    resume: str | None = None,
) -> dict:
    """Nightly retraining: promotes the new policy only if it passes the shadow gate.

    from_log: field shadow logs (file or directory); calibrate first and gate on the calibrated set too.
    resume: a run directory whose training continues from its latest checkpoint (a night killed while it trained).
    """
    logger = get_run_logger()
    cfg = load_config(config_path)  # fail fast, before any Ray work, on a bad config
    flow_run_id = str(get_run_context().flow_run.id)

    # The command that ran this night, as the resume hint gives it back: every option that shapes the night.
    again = " ".join(
        ["sim2real run", f"--config {config_path}"]
        + ([f"--steps {steps}"] if steps is not None else [])
        + [f"--models {Path(models_root).resolve()}", f"--runs {Path(runs_dir).resolve()}"]
        + ([f"--from-log {from_log}"] if from_log else [])
        + ([f"--ray-address {ray_address}"] if ray_address else [])
    )
    calibration = None
    if from_log:
        calibration = calibrate_step(config_path, from_log, runs_dir)
        config_path = calibration["config_path"]  # train and shadow on the calibrated config from here on
        logger.info("calibrated to %s in %.0f s: %s", from_log, calibration["result"]["wall_s"], config_path)
    registry = Registry(models_root)
    previous = registry.production(cfg.task.name)  # the incumbent, run in the same paired episodes
    production_dir = str(registry.bundle_dir(cfg.task.name, previous)) if previous is not None else None
    if previous is not None:
        # Checked before any training: a production bundle that does not verify cannot run beside the candidate,
        # and the night ended, after training and falsify, as a failed gate that named nothing of it.
        try:
            registry.verify(cfg.task.name, previous)
        except BundleError as err:
            raise ProductionUnreadable(
                f"{cfg.task.name}: production v{previous} does not verify, so no candidate can be judged against "
                f"it; nothing was trained. {err}. `sim2real registry verify {cfg.task.name}` names every bad file; "
                f"`sim2real registry rollback {cfg.task.name}` puts back the version before it (the edge box "
                f"refuses to load a bundle that does not verify)"
            ) from None
    # Tonight's plants: a block of seeds no earlier night's gate ran on (night = the version this candidate gets).
    night = registry.next_version(cfg.task.name)
    seed = night_seed(cfg, night)
    trained = train_step(config_path, runs_dir, steps, ray_address, resume, again)
    logger.info("trained %s env steps in %.0f s: %s", trained["env_steps"], trained["wall_s"], trained["run_dir"])
    exported = export_step(trained["run_dir"], models_root)
    logger.info("exported bundle %s (parity max abs err %.2e)", exported["bundle"], exported["parity_max_abs_err"])
    logger.info(_shield_line(Path(exported["bundle"]) / "shield.json", config_path))
    # Each night searches from its own seed: with the shield spec unchanged from night to night, one seed would
    # replay the same corners, draws and attacks every night, where successive seeds add up to a wider search.
    falsification = falsify_step(
        exported["bundle"], config_path, str(Path(trained["run_dir"]) / "falsify"), seed=cfg.falsify.seed + night - 1
    )
    min_h = falsification["min_h"]
    logger.info(
        "falsify (search seed %d, night %d's own): %s shielded violation case(s) in %s; lowest barrier value the "
        "shield saw %s (%s)",
        falsification["seed"],
        night,
        falsification["cases_found"],
        extent(falsification),
        "n/a" if min_h is None else f"{min_h:.4g}",
        MIN_H_MEANING,
    )
    calibrated = calibration["result"] if calibration is not None else None
    on_calibrated = None
    if calibration is not None:
        # The calibrated set first: the candidate against production there is the payoff the main report shows.
        on_calibrated = shadow_step(
            exported["bundle"],
            config_path,
            str(Path(trained["run_dir"]) / "report-calibrated"),
            falsification,
            domains="calibrated",
            calibration=calibrated,
            production_dir=production_dir,
            seed=seed,
        )
        calibrated = {
            **calibrated,
            "payoff": payoff(calibrated, on_calibrated["metrics"], _production_calibrated(registry, cfg, previous)),
        }
    shadow = shadow_step(
        exported["bundle"],
        config_path,
        str(Path(trained["run_dir"]) / "report"),
        falsification,
        calibration=calibrated,
        production_dir=production_dir,
        seed=seed,
    )
    seeds = shadow["metrics"]["seeds"]
    # The replay is the night's gate only with its config and its production beside it: without --production
    # `shadow` judges against legacy alone and can pass what the night kept out.
    beside = f" --production {production_dir}" if production_dir else ""
    logger.info(
        "gate episodes: seeds %d..%d, night %d's own block (replay: sim2real shadow %s --config %s --seed %d%s)",
        seeds[0],
        seeds[-1],
        night,
        exported["bundle"],
        config_path,
        seeds[0],
        beside,
    )
    if on_calibrated is not None:
        shadow = _gate_on_both(shadow, on_calibrated)

    metrics = {
        "shadow": shadow["metrics"],
        "gate": {
            "decision": shadow["decision"],
            "reasons": shadow["reasons"],
            "failing": shadow["failing"],  # the config keys of the checks that failed: what `registry promote` names
            "loosened": shadow.get("loosened", []),
            "against_production": previous,
        },
        "falsify": {k: falsification[k] for k in ("seed", "evaluated", "cases_found", "min_h")},
        "train": {
            k: trained.get(k)
            for k in (
                "algorithm",
                "env_steps",
                "updates",
                "final_return",
                "wall_s",
                # transfer: the checkpoint selected on validation and why (issue 13)
                "best_updates",
                "best_validation_return",
                "stopped_early",
                "adr_fraction",
            )
        },
    }
    if calibrated is not None:
        metrics["calibration"] = {**_calibration_metrics(calibrated), "payoff": calibrated["payoff"]}
    version = register_step(exported["bundle"], models_root, metrics, flow_run_id, cfg.task.name, previous)
    passed = shadow["decision"] == "pass"
    moved = promote_step(models_root, cfg.task.name, version, previous) if passed else None
    verdict = promotion_verdict(shadow["decision"], version, previous, shadow["reasons"], shadow.get("loosened", []))
    if moved is not None:
        # The gate passed against a production that is no longer there: kept, and said so in the registry.
        verdict = f"not promoted: {moved}"
        logger.warning("%s", verdict)
        passed = False
        shadow = {**shadow, "decision": "kept", "reasons": [*shadow["reasons"], f"NOT PROMOTED: {moved}"]}
        registry.annotate(
            cfg.task.name, version, metrics={"gate": {**metrics["gate"], "decision": "kept", "verdict": verdict}}
        )

    summary = {
        "task": cfg.task.name,
        "decision": shadow["decision"],
        "reasons": shadow["reasons"],
        "version": version,
        "verdict": verdict,
        "production": registry.production(cfg.task.name),
        "previous_production": previous,
        "comparison": side_by_side(shadow["metrics"]),
        "loosened": shadow.get("loosened", []),
        # A run whose training stalled says so beside the gate's own advice: that is where a failing return starts.
        "next_steps": with_paths(
            shadow.get("next_steps", []),
            config=config_path,
            bundle=exported["bundle"],
            case=next(iter(sorted((Path(trained["run_dir"]) / "falsify").glob("case-*.json"))), None),
        )
        + ([f"training: {trained['stall_note']}"] if trained.get("stall_note") and not passed else []),
        "report": shadow["report"],
        "run_dir": trained["run_dir"],
        "flow_run_id": flow_run_id,
    }
    if calibration is not None:
        summary["calibration"] = {
            **metrics["calibration"],
            "calibrated_set": calibration["calibrated"],
            "config": calibration["config_path"],
        }
    _publish_artifacts(summary, shadow, trained, calibrated)
    if shadow["decision"] in ("fail", "inconclusive"):  # a Failed state carrying the summary, not an exception
        # The state's message is the run's one line (Prefect logs it): the checks that failed, not every reason.
        stays = f"v{previous}" if previous is not None else "none"
        return Failed(message=f"{cfg.task.name}: {summary['verdict']}; production stays {stays}", data=summary)
    logger.info("%s", summary["verdict"])
    return summary


def _production_calibrated(registry: Registry, cfg, version: int | None) -> bool | None:
    """Whether the production version was trained after a calibration (None: there is no production)."""
    if version is None:
        return None
    return bool(registry.show(cfg.task.name, version).get("metrics", {}).get("calibration"))


# Worst first: the decision of two gate runs is the worse of the two.
_DECISION_ORDER = ("fail", "kept", "inconclusive", "pass")


def _gate_on_both(reality: dict, calibrated: dict) -> dict:
    """One decision from the shadow runs on `reality` and on the calibrated set: pass only if both pass."""
    decision = min(reality["decision"], calibrated["decision"], key=_DECISION_ORDER.index)
    reasons = list(reality["reasons"]) + [f"calibrated: {r}" for r in calibrated["reasons"]]
    metrics = {**reality["metrics"], "calibrated": calibrated["metrics"]}
    return {
        **reality,
        "decision": decision,
        "reasons": reasons,
        "failing": list(dict.fromkeys([*reality["failing"], *calibrated["failing"]])),
        "metrics": metrics,
        "report_calibrated": calibrated["report"],
    }


def _calibration_metrics(result: dict) -> dict:
    """What the registry keeps of a calibration: identified vs nominal, error before/after, wall time."""
    return {
        "latency_steps": result["latency_steps"]["identified"],
        "parameters": {
            n: {k: p[k] for k in ("nominal", "identified", "identified_ok", "range")}
            for n, p in result["parameters"].items()
        },
        "unidentified": result["unidentified"],
        "verdict": result.get("verdict", []),
        "latency_confidence": result["latency_steps"].get("confidence"),
        "combinations": result.get("combinations", []),
        "prediction_error_before": result["prediction_error"]["before"]["rms_normalized"],
        "prediction_error_after": result["prediction_error"]["after"]["rms_normalized"],
        "wall_s": result["wall_s"],
    }


def _publish_artifacts(summary: dict, shadow: dict, trained: dict, calibration: dict | None = None) -> None:
    from pipeline.calibration.calibrate import summary_lines
    from pipeline.evaluation.payoff import payoff_lines

    headline = {
        "pass": "PASSED, promoted",
        "kept": "production KEPT",
        "inconclusive": "INCONCLUSIVE, not promoted",
    }.get(summary["decision"], "FAILED, not promoted")
    reasons = "\n".join(f"- {r}" for r in summary["reasons"])
    table = "".join(
        f"| {who}{' v' + str(row['version']) if 'version' in row else ''} | {row['episodes']} | "
        f"{row['return_mean']:.2f} | [{row['return_ci95'][0]:.2f}, {row['return_ci95'][1]:.2f}] |\n"
        for who, row in summary["comparison"].items()
    )
    loosened = "".join(f"- LOOSENED: {line}\n" for line in summary.get("loosened", []))
    steps = summary.get("next_steps", [])
    next_steps = ("\n## Next\n" + "".join(f"- {line}\n" for line in steps)) if steps else ""
    calibrated = (
        ""
        if calibration is None
        else (
            "\n## Calibration (identified vs nominal)\n"
            + "\n".join(f"- {line}" for line in summary_lines(calibration))
            + f"\n- calibrated set: `{summary['calibration']['calibrated_set']}`\n"
            + "\n## Payoff of calibrating\n"
            + "\n".join(f"- {line}" for line in payoff_lines(calibration["payoff"]))
            + "\n"
        )
    )
    create_markdown_artifact(
        key="retrain-summary",
        markdown=(
            f"# Retrain {summary['task']}: gate {headline}\n\n"
            f"- version: **{summary['version']}**\n- production: **{summary['production']}** "
            f"(was {summary['previous_production']})\n- training: {trained['env_steps']} env steps, "
            f"{trained['wall_s']:.0f} s, final return "
            f"{'n/a' if trained['final_return'] is None else format(trained['final_return'], '.1f')}\n"
            f"- report: `{summary['report']}`\n- {summary['verdict']}\n\n"
            f"## Same episodes, side by side\n| policy | episodes | mean return | 95% CI |\n|---|---|---|---|\n"
            f"{table}\n## Gate\n{loosened}{reasons}\n{next_steps}{calibrated}"
        ),
        description=f"gate {summary['decision']}",
    )
    rows = [
        {"metric": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v}
        for k, v in _flatten(shadow["metrics"]).items()
    ]
    create_table_artifact(key="shadow-metrics", table=rows, description="shadow-mode metrics")
    create_link_artifact(
        key="shadow-report",
        link=Path(summary["report"]).resolve().as_uri(),
        link_text="HTML shadow report",
        description="plots, gate table, animation",
    )


def _flatten(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _shield_line(spec_path: Path, config_path: str) -> str:
    """What keeps the bundle's plant inside its limits, said once per night: the filter, its margin, and which
    numbers synthesis measured; the certificate itself is `shield synthesize`'s (this night's falsify follows)."""
    if not spec_path.is_file():
        return "shield: none in this bundle (shield.enabled is false): nothing keeps the plant inside its limits"
    data = spec_path.read_bytes()
    spec = json.loads(data)
    predictive = spec.get("predictive")
    # The predictive filter tightens each limit by its measured tube, not by the margin (which serves the barrier).
    kind = (
        f"predictive filter (horizon {predictive['horizon']} steps, its limits tightened by its measured tube)"
        if predictive
        else f"braking barrier, margin {spec.get('margin'):.3g}"
    )
    measured = "synthesis" in (spec.get("assumptions") or {})
    return (
        f"shield: {kind}, "
        + (
            "synthesized from the plant (any number the config sets is checked against it)"
            if measured
            else "every number set by the config"
        )
        + f"; shield.json sha256 {sha256_bytes(data)[:16]}...: `sim2real shield synthesize --config "
        f"{config_path}` certifies this very file where its certificate's shield_sha256 is the same"
    )
