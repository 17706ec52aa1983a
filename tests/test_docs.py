"""The documentation site builds strictly, and its generated reference covers every command, option and key."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest
import yaml

from pipeline.cli import build_parser
from pipeline.config import describe_fields

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`mkdocs build --strict`: a broken link, a missing page or a page left out of the nav fails it."""
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _text(site: Path, page: str) -> str:
    html = (site / page / "index.html").read_text()
    return unescape(re.sub(r"<[^>]+>", "", html))


def _commands(parser: argparse.ArgumentParser, prog: str = "sim2real"):
    """(prog, its --help text) for every command and sub-command, read from the parsers' own help output."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}", sub.format_help()
                yield from _commands(sub, f"{prog} {name}")


def test_the_cli_reference_has_every_command_and_option(site):
    text = _text(site, "reference/cli")
    parser, _ = build_parser()
    commands = list(_commands(parser))
    assert len(commands) >= 15  # every pipeline step, registry's actions and flows' run and schedule
    for prog, help_text in commands:
        assert prog in text, prog
        for option in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text)) - {"--help"}:
            assert option in text, f"{prog} {option}"


def _yaml_keys(node, prefix: str = ""):
    """Every key path a YAML uses, lists as [] and maps of named sections by their position."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{prefix}{key}"
            yield from _yaml_keys(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for item in node:
            yield from _yaml_keys(item, prefix[:-1] + "[].")


def _matches(path: str, documented: set[str]) -> bool:
    """A used key path is documented when some reference key equals it with `<name>` parts standing for any name."""
    parts = path.split(".")
    for key in documented:
        kparts = key.split(".")
        if len(kparts) == len(parts) and all(
            k == p or (k.startswith("<") and k.endswith(">")) for k, p in zip(kparts, parts)
        ):
            return True
    return False


def test_the_config_and_plant_references_have_every_key_the_models_and_the_shipped_configs_use(site):
    text = _text(site, "reference/config") + _text(site, "reference/plant")
    rows = describe_fields()
    assert any(k == "plant.observations[].axis" and t == "int" for k, t, _, _ in rows)  # axis is an integer
    for key, _, _, description in rows:
        assert key in text, key
        assert description, f"{key} has no description"
    documented = {k for k, *_ in rows}
    documented |= {
        ".".join(k.split(".")[: i + 1])
        for k in documented
        for i, part in enumerate(k.split("."))
        if part.startswith("<")
    }  # a named entry itself: randomization.<set>
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        data = yaml.safe_load(config.read_text())
        if "plant" in data and "initial_state" in data["plant"]:  # {qpos|qvel: {joint: [lo, hi]}} is free-form
            data["plant"]["initial_state"] = {}
        for path in _yaml_keys(data):
            free_form = re.match(
                r"(plant\.(shield_model\.operating_point|legacy\.setpoints|constraints\[\]\.a)"
                r"|shield\.(model_ranges|gains|ambient_disturbance_accel))\.",
                path,
            )
            assert free_form or _matches(path, documented), f"{config.name}: {path} is not in the reference"


def test_the_readme_is_a_front_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 8 * 1024
    for marker in ("main-command", "test-command"):
        block = readme.split(f"<!-- {marker} -->")[1].split(f"<!-- /{marker} -->")[0]
        assert block.count("\n") == 4 and "python3 -m venv .venv" in block  # one fenced command line


def test_every_file_the_docs_and_code_point_to_exists():
    """A page or a comment that sends a reader to `tests/...py`, `bench/...py` or `configs/...` names a file that is
    there: the tests moved into folders once and a dozen pointers were left at the old paths."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    pointer = re.compile(r"(?<![\w/.-])((?:tests|bench|configs|docs|examples)/[\w/.-]*\w\.(?:py|md|yaml|xml|c))")
    stale = {
        f"{name}: {target}"
        for name in tracked
        if name.endswith((".py", ".md", ".yaml", ".toml", ".c", ".h"))
        for target in pointer.findall((ROOT / name).read_text(errors="replace"))
        if not (ROOT / target).exists() and "missing" not in target  # a test's deliberately absent file
    }
    assert not stale, sorted(stale)
