"""A `sim2real` command's arguments as its own parser gives them, for tests that call a command's handler."""

from __future__ import annotations

import argparse

from pipeline.cli import build_parser


def cli_args(*argv: str, **kw) -> argparse.Namespace:
    """`sim2real ARGV...` parsed (every flag the command has, at its default), then `kw` set: a flag the command
    gains needs no edit in the tests."""
    args = build_parser()[0].parse_args(list(argv))
    vars(args).update(kw)
    return args
