"""The `sim2real` commands: one module a command, each with `run(args) -> int`.

`pipeline/cli.py` holds the parsers and `main`; it imports a command's module
only when that command runs, so `sim2real --help` loads no torch, Ray or
MuJoCo. The library modules (training, deployment, evaluation, calibration)
return results and raise errors; turning those into output and exit codes is
done here, and only here.

Output: `emit(args, result, human)` prints one JSON object with `--json`
(numpy values as lists, paths as strings), else the human text; progress goes to
stderr.

Exit codes, the same for every command (`@command` applies them):

- 0: done; for a check, it passed.
- 1: the check the command exists for said no: the gate failed or was
  inconclusive (`shadow`, `run`), `falsify` found a case, `registry verify`
  found a file that does not match.
- 2: a user error: a bad config, argument, path, bundle, checkpoint, log,
  domain set, or a registry operation that cannot be done (unknown version,
  nothing to roll back to). One line on stderr, `sim2real CMD: error: ...`,
  no traceback.
- 130: interrupted (Ctrl-C, or SIGTERM).

A reader that closes the pipe early (`sim2real config | head`) ends the
command quietly with 0.

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

OK, CHECK_FAILED, USER_ERROR, INTERRUPTED = 0, 1, 2, 130

# Errors a user can cause, by class name so that matching them imports nothing heavy.
# ValueError covers the library's bad-value errors (ConfigError, DomainsError, ShadowError,
# CalibrationError, ShieldSpecError, UnknownTaskError, ... all derive from it).
USER_ERRORS = frozenset(
    {
        "ValueError",
        "BundleError",
        "RegistryError",
        "CheckpointError",
        "ExportError",
        "FileNotFoundError",
        "NotADirectoryError",
        "IsADirectoryError",
    }
)

Handler = Callable[[argparse.Namespace], int]


class UsageError(ValueError):
    """Arguments that parse but do not go together (e.g. both BUNDLE and --policy)."""


def is_user_error(err: BaseException) -> bool:
    """True for an error a user can cause and fix from its one-line message."""
    return any(cls.__name__ in USER_ERRORS for cls in type(err).__mro__)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While a command runs, SIGTERM (what cron, systemd and `kill` send) ends it as Ctrl-C does: its `finally`
    blocks run (Ray shut down, the temporary Prefect server stopped), it says "interrupted" and exits 130. The
    handler before is put back after (a test calling `main` keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def guarded(name: str, handler: Handler, args: argparse.Namespace) -> int:
    """Run `handler(args)` under the exit-code policy of this package's docstring."""
    try:
        with _sigterm_as_interrupt():
            return int(handler(args) or OK)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`sim2real config | head`): what it read is what it wanted. Point stdout at
        # devnull so the interpreter's final flush does not raise again on the way out.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except Exception as err:
        if is_user_error(err):
            print(f"sim2real {name}: error: {err}", file=sys.stderr)
            if step := getattr(err, "next_step", None):
                config = getattr(args, "config", None) or getattr(args, "check", None)  # `config --check PATH`
                print(f"  next: {step.format(config=config if isinstance(config, str) else 'CONFIG')}", file=sys.stderr)
            return USER_ERROR
        raise


def command(name: str) -> Callable[[Handler], Handler]:
    """Decorator of a command's `run`: the exit-code policy applies when it is called directly too."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            return guarded(name, handler, args)

        return run

    return wrap


def emit(args: argparse.Namespace, result: dict, human: str) -> None:
    """Print a command's result: one JSON object with --json, else the human text."""
    if getattr(args, "json", False):
        print(json.dumps(result, default=_json_default))
    else:
        print(human)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return obj.tolist()
    return str(obj)  # paths, dates
