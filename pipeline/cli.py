"""The `sim2real` command line: one entry point, a subcommand per pipeline step.

Parsers are defined here so `--help` is complete and fast; each command's work
lives in its own module of `pipeline.commands` (`run(args) -> int`), imported
only when that command runs. The output helper and the exit-code policy (0 ok,
1 the check failed, 2 a user error in one line, 130 interrupted) are in
`pipeline.commands` and apply to every command, the plugged-in ones too.
The orchestration commands (`run`, `schedule`) belong to `flows/`,
which depends on `pipeline` and not the other way round, so they are found
through the `sim2real.commands` entry-point group instead of an import.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pipeline import DEFAULT_CONFIG
from pipeline.commands import guarded
from shield.serve_cli import add_serve_arguments

# command -> "module:function" that runs it (imported lazily)
HANDLERS: dict[str, str] = {
    "envs": "pipeline.commands.envs:run",
    "config": "pipeline.commands.config:run",
    "train": "pipeline.commands.train:run",
    "tune": "pipeline.commands.tune:run",
    "export": "pipeline.commands.export:run",
    "eval": "pipeline.commands.eval:run",
    "shadow": "pipeline.commands.shadow:run",
    "falsify": "pipeline.commands.falsify:run",
    "registry": "pipeline.commands.registry:run",
    "serve": "shield.server:run_cli",
    "calibrate": "pipeline.commands.calibrate:run",
    "shield": "pipeline.commands.shield:run",
}


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")


def _config_flag(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--config",
        required=required,
        default=None if required else DEFAULT_CONFIG,
        help=f"task config YAML (default {DEFAULT_CONFIG}); see `sim2real config`",
    )


def _add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "envs", help="list the tasks: obs/action sizes, constraints, legacy controller, registry versions"
    )
    p.add_argument(
        "--config", action="append", metavar="FILE", help="also declare the plant of this task YAML (repeatable)"
    )
    p.add_argument("--registry", default="models", help="registry root whose tasks are listed too (default models/)")
    _json_flag(p)

    p = sub.add_parser("config", help="document every config key, or validate a config file")
    p.add_argument(
        "--check", nargs="?", const="", metavar="FILE", help="validate FILE (or --config FILE) and report every bad key"
    )
    p.add_argument("--config", metavar="FILE", help="the file to validate, named as every other command names it")
    _json_flag(p)

    p = sub.add_parser(
        "train",
        help="train a policy: Ray rollout actors and the learner train.algorithm names (appo, impala, sac, td3)",
    )
    p.add_argument("--config", help=f"task config YAML (default {DEFAULT_CONFIG}; with --resume, the run's own)")
    p.add_argument("--steps", type=int, help="total env steps (overrides train.total_env_steps)")
    p.add_argument("--actors", type=int, help="rollout actors (overrides train.num_actors)")
    p.add_argument("--envs-per-actor", type=int, help="envs per actor (overrides train.envs_per_actor)")
    p.add_argument("--out", help="run directory (default runs/<task>-<timestamp>)")
    p.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    _json_flag(p)

    p = sub.add_parser(
        "tune",
        help="population-based training (Ray Tune PBT) over the hyperparameters tune.searchable names; "
        "the best member by validation return becomes an ordinary run directory",
    )
    _config_flag(p)
    p.add_argument("--population", type=int, help="members trained at once (overrides tune.population)")
    p.add_argument("--budget-s", type=float, help="wall-clock budget of the search, s (overrides tune.budget_s)")
    p.add_argument("--steps", type=int, help="env steps per member (overrides train.total_env_steps)")
    p.add_argument("--out", help="output directory (default runs/<task>-tune-<timestamp>)")
    p.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    _json_flag(p)

    p = sub.add_parser("export", help="export a run's policy to an ONNX bundle (parity-checked)")
    p.add_argument("run_dir", help="training run directory")
    p.add_argument("--out", help="write a standalone bundle here instead of registering it")
    p.add_argument("--registry", default="models", help="registry root (default models/)")
    _json_flag(p)

    p = sub.add_parser("eval", help="evaluate a bundle or a reference policy, with or without the shield")
    p.add_argument("bundle", nargs="?", help="bundle directory (or use --policy)")
    # pipeline.evaluation.adversary.REFERENCE_POLICIES, spelled out so the parser imports nothing heavy (a test holds
    # them equal)
    p.add_argument(
        "--policy",
        choices=["legacy", "random", "bang_bang", "adversarial"],
        help="reference policy instead of a bundle (bang_bang: each action flips between its bounds)",
    )
    _config_flag(p)
    p.add_argument("--domains", default="train", help="randomization set: train, reality, nominal (none), or FILE.yaml")
    p.add_argument("--episodes", type=int, default=20, help="episodes to run")
    p.add_argument("--no-shield", action="store_true", help="run the policy without the safety shield")
    p.add_argument(
        "--past-termination",
        action="store_true",
        help="step on past the task's termination (a fallen pole) to the episode's length, as a real "
        "plant goes on: does the shield still hold the limits?",
    )
    p.add_argument("--seed", type=int, default=0, help="first episode seed")
    _json_flag(p)

    p = sub.add_parser("shadow", help="shadow-evaluate a bundle beside the legacy controller and gate it")
    p.add_argument("bundle", help="candidate bundle directory")
    _config_flag(p)
    p.add_argument("--legacy", help="legacy controller name (default: the task's)")
    p.add_argument(
        "--domains", default=None, help="randomization set, nominal (none), or FILE.yaml (default shadow.domains)"
    )
    p.add_argument(
        "--episodes",
        type=int,
        help="episodes per batch of each pass; the gate adds batches until it "
        "decides or gate.max_episodes ran (default shadow.episodes)",
    )
    p.add_argument("--seed", type=int, help="first episode seed (default shadow.seed)")
    p.add_argument("--report", metavar="DIR", help="write the HTML report and logs here")
    p.add_argument(
        "--production",
        metavar="BUNDLE",
        help="the production bundle: run on the same seeds, and the "
        "candidate must beat it too (gate.min_return_ratio_production)",
    )
    p.add_argument(
        "--from-log",
        metavar="PATH",
        help="use logs recorded by `sim2real serve --mode shadow` (or by a "
        "simulated shadow run, then paired with the candidate's counterfactual) instead of simulating",
    )
    _json_flag(p)

    p = sub.add_parser("falsify", help="search the config's envelope for a shielded violation (exit 1 if one is found)")
    _config_flag(p)
    p.add_argument("--bundle", help="attack this bundle's policy and shield.json (default: the config's spec)")
    p.add_argument("--candidates", type=int, help="candidates the search evaluates (default falsify.candidates)")
    p.add_argument(
        "--budget-s",
        type=float,
        help="cap the search by the clock (s) as well (default falsify.budget_s, unset: no clock, so the same "
        "verdict for a seed on any machine)",
    )
    p.add_argument("--seed", type=int, help="search seed (default falsify.seed)")
    p.add_argument("--out", help="where found cases are written (default reports/falsify-<task>-<time>)")
    p.add_argument(
        "--replay",
        metavar="CASE",
        help="run a written case (case-N.json) again instead of searching: its pinned plant, seed, policy, attack "
        "and episode length (exit 1 if it violates again)",
    )
    p.add_argument(
        "--shield",
        metavar="SHIELD_JSON",
        help="with --replay: the shield spec the case was found against (default: --bundle's, else the config's)",
    )
    _json_flag(p)

    p = sub.add_parser(
        "calibrate", help="fit the twin's randomized parameters and latency to shadow logs: a calibrated set"
    )
    _config_flag(p)
    p.add_argument(
        "--from-log",
        metavar="PATH",
        help="shadow logs (file or directory) from `serve --mode shadow` (required unless --plan; with --plan: "
        "the quiet log to plan for)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the calibrated randomization set here (YAML, usable as --domains); with --plan: the plan (JSON)",
    )
    p.add_argument(
        "--bundle",
        metavar="DIR",
        help="an adaptive policy's bundle: replay it over the same logs and set the plant it believes in (its "
        "plant_estimate) beside the fit",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="design an excitation (a perturbation the legacy loop adds to its action) that makes --params "
        "identifiable, with the expected 90%% intervals and a safety check on every corner of reality",
    )
    p.add_argument(
        "--params",
        metavar="A,B",
        help="with --plan: parameters to make identifiable (default: those the --from-log leaves unpinned, else all)",
    )
    p.add_argument(
        "--amplitude",
        type=float,
        default=0.1,
        help="with --plan: the perturbation's peak, a fraction in (0, 1] of the normalized action range (default 0.1)",
    )
    p.add_argument(
        "--steps", type=int, default=1500, help="with --plan: control steps the excitation lasts (default 1500)"
    )
    p.add_argument("--seed", type=int, default=0, help="with --plan: the excitation generator's seed (default 0)")
    _json_flag(p)

    p = sub.add_parser("registry", help="list, inspect, promote, roll back or verify bundles in models/")
    rsub = p.add_subparsers(dest="registry_cmd", required=True, metavar="ACTION")
    for name, text, needs_version in (
        ("list", "list versions and the production pointer", False),
        ("show", "show one version: its origin, gate and why it is (not) in production", True),
        ("promote", "point production at a version", True),
        ("rollback", "move production back to the previous version", False),
        ("verify", "check every file hash of one or all versions", False),
    ):
        rp = rsub.add_parser(name, help=text)
        rp.add_argument("task", nargs="?" if name in ("list", "verify") else None, help="task name, e.g. cartpole")
        if needs_version:
            rp.add_argument("version", type=int, help="bundle version")
        if name == "promote":
            rp.add_argument(
                "--force", action="store_true", help="promote a version whose gate did not pass (refused without it)"
            )
        elif name == "verify":
            rp.add_argument("version", type=int, nargs="?", help="bundle version (default: all)")
        # --models as `run` and `serve` name the registry root; --root is what this command said first.
        rp.add_argument("--models", "--root", dest="root", default="models", help="registry root (default models/)")
        _json_flag(rp)

    p = sub.add_parser(
        "shield", help="synthesize the shield from the plant and certify it (or refuse, naming the range)"
    )
    importlib.import_module("pipeline.commands.shield").add_arguments(p, DEFAULT_CONFIG)

    p = sub.add_parser("serve", help="serve a verified bundle to physical controllers over UDP")
    add_serve_arguments(p)  # one definition, shared with `python -m shield.server`


def _plugin_commands() -> dict[str, Any]:
    """Commands contributed by other packages (flows' `run` and `schedule`)."""
    return {ep.name: ep for ep in entry_points(group="sim2real.commands")}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    """The full parser and the plugin handlers it found."""
    parser = argparse.ArgumentParser(
        prog="sim2real",
        description="MuJoCo digital twin -> domain-randomized training on Ray -> ONNX bundle -> "
        "shadow evaluation and gate -> CBF-shielded edge serving. Prefect chains it (`sim2real run`).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_pipeline_commands(sub)
    plugin_handlers = {}
    for name, ep in sorted(_plugin_commands().items()):
        command = ep.load()
        command.add_arguments(sub.add_parser(name, help=command.HELP))
        plugin_handlers[name] = command.run_cli
    return parser, plugin_handlers


def _resolve(spec: str) -> Callable[[argparse.Namespace], int]:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sim2real` console script."""
    parser, plugin_handlers = build_parser()
    args = parser.parse_args(argv)
    handler = plugin_handlers.get(args.command) or _resolve(HANDLERS[args.command])
    return guarded(args.command, handler, args)  # the one exit-code policy (pipeline.commands)


if __name__ == "__main__":
    sys.exit(main())
