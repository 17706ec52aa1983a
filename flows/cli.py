"""`sim2real run` and `sim2real schedule`: the Prefect commands, plugged into pipeline's CLI.

Kept free of heavy imports: Prefect is imported only when a command runs.
flows/retrain.py and flows/schedule.py are library only; what these commands
print is decided here. `pipeline.cli.main` applies pipeline's exit-code policy
to them too (0 promoted / scheduled, 1 the gate did not pass, 2 a user error).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flows.server import prefect_defaults
from pipeline import DEFAULT_CONFIG


class RunCommand:
    """`sim2real run`: the whole retrain flow on embedded defaults."""

    HELP = "run the whole pipeline as a Prefect flow: train, export, shadow, gate, register, promote"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        _flow_arguments(p)
        p.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="continue the training in RUN_DIR from its latest checkpoint (a night stopped while it trained: "
            "the flow logs its folder when training starts), then export, gate and promote as usual",
        )
        p.add_argument("--json", action="store_true", help="print one JSON summary object")

    @staticmethod
    def run_cli(args: argparse.Namespace) -> int:
        """The flow on embedded defaults, with a summary at the end; 0 only when the candidate was promoted."""
        _calibratable(args)
        _shield_buildable(args)
        _resumable(args)
        prefect_defaults()  # before Prefect is imported: it reads its settings once, then
        from flows.retrain import retrain
        from flows.server import ephemeral_server

        ephemeral_server()  # stopped with this process, even one killed with SIGKILL

        state = retrain(
            config_path=args.config,
            models_root=args.models,
            runs_dir=args.runs,
            steps=args.steps,
            ray_address=args.ray_address,
            from_log=getattr(args, "from_log", None),
            resume=getattr(args, "resume", None),
            return_state=True,
        )
        outcome = state.result(raise_on_failure=False)  # a gate's "no" ends Failed with the summary as its data
        summary = outcome if isinstance(outcome, dict) else _summary_after_failure(args, state)
        print(json.dumps(summary, default=str) if args.json else _human_summary(summary))
        return 0 if summary.get("decision") == "pass" else 1


class ScheduleCommand:
    """`sim2real schedule`: a Prefect deployment of the retrain flow on a cron schedule."""

    HELP = "create a Prefect deployment that runs the retrain flow on a cron schedule"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cron", default="0 3 * * *", help='cron schedule (default "0 3 * * *": nightly at 03:00)')
        _flow_arguments(p, " (each scheduled run reads what is there by then)")
        p.add_argument("--name", default=None, help="deployment name (default retrain-<task>)")
        p.add_argument("--timezone", default="UTC", help="time zone of the cron schedule (default UTC)")
        p.add_argument(
            "--serve",
            action="store_true",
            help="stay in the foreground and run scheduled flows in this process (flow.serve)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object")

    @staticmethod
    def run_cli(args: argparse.Namespace) -> int:
        _calibratable(args)
        _shield_buildable(args)
        prefect_defaults()  # before Prefect is imported: it reads its settings once, then
        from flows.schedule import schedule

        if args.serve:
            from flows.server import ephemeral_server

            ephemeral_server()  # stopped with this process, even one killed with SIGKILL
        result = schedule(
            args.config,
            args.cron,
            name=args.name,
            timezone=args.timezone,
            serve=args.serve,
            models_root=args.models,
            runs_dir=args.runs,
            steps=args.steps,
            ray_address=args.ray_address,
            from_log=args.from_log,
        )
        if args.json:
            print(json.dumps(result))
        else:
            print(f"deployment {result['deployment']} scheduled '{result['cron']}' ({result.get('timezone', '')})")
            if result["parameters"].get("from_log"):
                print(f"each run first calibrates the twin to the field logs in {result['parameters']['from_log']}")
            if not result.get("served"):
                print(f"start a worker from the repository root: prefect worker start --pool {result['work_pool']}")
        return 0


def _flow_arguments(p: argparse.ArgumentParser, logs_note: str = "") -> None:
    """The retrain flow's parameters, the same for `run` (now) and `schedule` (every scheduled run)."""
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"task config YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--steps", type=int, help="training env steps (overrides train.total_env_steps)")
    p.add_argument("--models", default="models", help="registry root (default models/)")
    p.add_argument("--runs", default="runs", help="where training runs and reports go (default runs/)")
    p.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else local)")
    p.add_argument(
        "--from-log",
        metavar="LOGS",
        help="field shadow logs (file or directory): calibrate the twin "
        "to them first, train around the calibrated set, gate on it as well as on reality" + logs_note,
    )


def _calibratable(args: argparse.Namespace) -> None:
    """With --from-log, refuse a task calibration cannot fit (CalibrationError: exit 2, one line) here, before a
    flow starts: not a traceback and a failed gate after a Prefect server came up, nor every night at 3 a.m."""
    if getattr(args, "from_log", None):
        from pipeline.calibration.twin import Twin
        from pipeline.config import load_config

        Twin(load_config(args.config).task.env_id)


def _resumable(args: argparse.Namespace) -> None:
    """With --resume, refuse a folder training cannot continue (no checkpoint, another task's or algorithm's, an
    adaptive run) here in one line (exit 2), not as a failed flow after a Prefect server came up."""
    if not getattr(args, "resume", None):
        return
    from pipeline.config import load_config
    from pipeline.training.checkpoint import latest_checkpoint, read_checkpoint
    from pipeline.training.scaffold import algorithm_of
    from pipeline.training.train import is_adaptive

    if not Path(args.resume).is_dir():
        raise ValueError(f"--resume {args.resume}: no such folder (the flow logs its run folder when training starts)")
    cfg = load_config(args.config)
    if is_adaptive(cfg):
        raise ValueError(f"--resume {args.resume}: an adaptive run (train.adaptive) cannot resume; run it again")
    ckpt = read_checkpoint(latest_checkpoint(args.resume))  # a CheckpointError names the folder
    task, algorithm = ckpt.get("task", cfg.task.name), algorithm_of(ckpt)
    if task != cfg.task.name or algorithm != cfg.train.algorithm:
        raise ValueError(
            f"--resume {args.resume}: its checkpoint trains task {task!r} with {algorithm}; --config {args.config} "
            f"trains {cfg.task.name!r} with {cfg.train.algorithm}: give the config the run was started with"
        )


def _shield_buildable(args: argparse.Namespace) -> None:
    """Build the shield every bundle carries (export writes it whatever shield.enabled says) before a flow starts:
    a plant it cannot be built for is refused here in one line (exit 2), not by export after training."""
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    build_shield_spec(load_config(args.config))


def _summary_after_failure(args: argparse.Namespace, state) -> dict:
    from pipeline.config import load_config
    from pipeline.deployment.registry import Registry

    cfg = load_config(args.config)
    return {
        "task": cfg.task.name,
        "decision": "fail",
        "state": state.name,
        "error": str(state.message),
        "production": Registry(args.models).production(cfg.task.name),
    }


def _human_summary(s: dict) -> str:
    # A flow that ended before registering a candidate (a training crash, a production bundle that does not
    # verify) ran no gate: its headline says it stopped, and the line below says why.
    head = f"gate {s['decision'].upper()}" if "version" in s else "stopped before a gate decision"
    lines = [f"sim2real run: {s['task']}: {head}"]
    if "version" in s:
        was = s.get("previous_production")
        moved = (
            f"production stays {was}"
            if was is not None and s["production"] == was
            else f"production -> {s['production']} (was {'none' if was is None else was})"
        )
        lines.append(f"  registered version {s['version']}; {moved}")
    else:
        lines.append(f"  flow ended {s.get('state')}: {s.get('error')}")
        lines.append(f"  production unchanged: {s.get('production')}")
    for r in s.get("reasons", []):
        lines.append(f"  - {r}")
    lines += [f"  next: {line}" for line in s.get("next_steps", [])]
    if s.get("report"):
        lines.append(f"  report: {s['report']}")
    return "\n".join(lines)
