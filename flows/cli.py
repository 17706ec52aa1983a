"""`sim2real run` and `sim2real schedule`: the Prefect commands, plugged into pipeline's CLI.

Kept free of heavy imports: Prefect is imported only when a command runs.
"""

from __future__ import annotations

import argparse

from pipeline import DEFAULT_CONFIG


class RunCommand:
    """`sim2real run`: the whole retrain flow on embedded defaults."""

    HELP = "run the whole pipeline as a Prefect flow: train, export, shadow, gate, register, promote"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", default=DEFAULT_CONFIG, help=f"task config YAML (default {DEFAULT_CONFIG})")
        p.add_argument("--steps", type=int, help="training env steps (overrides train.total_env_steps)")
        p.add_argument("--models", default="models", help="registry root (default models/)")
        p.add_argument("--runs", default="runs", help="where training runs and reports go (default runs/)")
        p.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else local)")
        p.add_argument("--from-log", metavar="LOGS", help="field shadow logs (file or directory): calibrate the twin "
                       "to them first, train around the calibrated set, gate on it as well as on reality")
        p.add_argument("--json", action="store_true", help="print one JSON summary object")

    @staticmethod
    def run_cli(args: argparse.Namespace) -> int:
        from flows.retrain import run_cli

        return run_cli(args)


class ScheduleCommand:
    """`sim2real schedule`: a Prefect deployment of the retrain flow on a cron schedule."""

    HELP = "create a Prefect deployment that runs the retrain flow on a cron schedule"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cron", default="0 3 * * *", help='cron schedule (default "0 3 * * *": nightly at 03:00)')
        p.add_argument("--config", default=DEFAULT_CONFIG, help=f"task config YAML (default {DEFAULT_CONFIG})")
        p.add_argument("--name", default=None, help="deployment name (default retrain-<task>)")
        p.add_argument("--timezone", default="UTC", help="time zone of the cron schedule (default UTC)")
        p.add_argument("--serve", action="store_true",
                       help="stay in the foreground and run scheduled flows in this process (flow.serve)")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    @staticmethod
    def run_cli(args: argparse.Namespace) -> int:
        from flows.schedule import run_cli

        return run_cli(args)
