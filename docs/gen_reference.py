"""Generates the reference pages from the code at build time (mkdocs-gen-files): the CLI from `sim2real`'s
own parser, the config and plant-declaration keys from the pydantic models. Nothing here is written by hand,
so the reference cannot drift from what the code accepts."""

from __future__ import annotations

import argparse

import mkdocs_gen_files

from envs import declaration
from pipeline.cli import build_parser
from pipeline.config import describe_fields


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _command_page(prog: str, parser: argparse.ArgumentParser, help_text: str, level: int) -> list[str]:
    lines = [f"{'#' * level} `{prog}`", "", _cell(help_text), "", "```", parser.format_usage().strip(), "```", ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}` (positional)"
        default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
        choices = f" One of {', '.join(f'`{c}`' for c in action.choices)}." if action.choices else ""
        rows.append(f"| {name} | {_cell((action.help or '') + choices)} | {default} |")
    if rows:
        lines += ["| argument | meaning | default |", "|---|---|---|", *rows, ""]
    for name, sub in _subcommands(parser).items():
        lines += _command_page(f"{prog} {name}", sub, _help_of(parser, name), level + 1)
    return lines


def cli_page() -> str:
    parser, _ = build_parser()
    lines = [
        "# CLI reference",
        "",
        "Generated from `sim2real`'s parser. Every command has `--help`; `--json` prints one JSON object. "
        "Exit codes: 0 ok, 1 the check failed (a gate said no, falsify found a case), 2 a user error "
        "(one line naming the culprit), 130 interrupted.",
        "",
    ]
    for name, sub in _subcommands(parser).items():
        lines += _command_page(f"sim2real {name}", sub, _help_of(parser, name), 2)
    return "\n".join(lines)


def _key_table(rows) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {_cell(t)} | {_cell(f'`{v}`' if v else '')} | {_cell(d)} |" for k, t, v, d in rows]
    return out + [""]


def config_page() -> str:
    rows = [r for r in describe_fields() if not r[0].startswith("plant.")]
    lines = [
        "# Config keys",
        "",
        "Generated from `pipeline.config.Config`: every key a task YAML may set (`sim2real config` prints the "
        "same list, `sim2real config --check FILE` validates a file and names a bad key by its path). "
        "`<set>`, `<body>` and the like stand for names you choose. The `plant:` section has its own page: "
        "[Plant declaration](plant.md).",
        "",
    ]
    sections: dict[str, list] = {}
    for row in rows:
        sections.setdefault(row[0].split(".")[0], []).append(row)
    for section, srows in sections.items():
        lines += [f"## `{section}`", "", *_key_table(srows)]
    return "\n".join(lines)


def plant_page() -> str:
    rows = [r for r in describe_fields() if r[0] == "plant" or r[0].startswith("plant.")]
    doc = declaration.__doc__ or ""
    summary, _, rest = doc.partition("\n\n")
    example, _, notes = rest.partition("\n\n")
    lines = [
        "# Plant declaration",
        "",
        "Generated from `envs.declaration.PlantDeclaration`: the `plant:` section of a task YAML, which "
        "declares a plant as data beside its MJCF. A worked example is in "
        "[Bring your own plant](../how-to/own-plant.md).",
        "",
        "## At a glance",
        "",
        "```yaml",
        _dedent(example),
        "```",
        "",
        notes.strip(),
        "",
        "## Every key",
        "",
        *_key_table(rows),
    ]
    return "\n".join(lines)


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).strip("\n")


for path, build in (
    ("reference/cli.md", cli_page),
    ("reference/config.md", config_page),
    ("reference/plant.md", plant_page),
):
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(build())
