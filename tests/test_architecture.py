"""The dependency rule of DESIGN.md: checked statically and at import time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "mujoco", "gymnasium", "prefect")


def test_import_contracts_hold():
    """import-linter: flows -> pipeline -> envs, shield standalone, edge stays light."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run(
        [str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout


def _loaded_after(statement: str) -> list[str]:
    code = f"{statement}; import sys, json; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _shield_modules() -> list[str]:
    return sorted("shield." + p.stem for p in (ROOT / "shield").glob("*.py") if p.stem != "__init__")


def test_import_shield_loads_nothing_heavy():
    assert _loaded_after("import shield") == []


@pytest.mark.parametrize("module", _shield_modules())
def test_every_shield_module_loads_nothing_heavy(module):
    assert _loaded_after(f"import {module}") == []


def test_envs_imports_nothing_of_pipeline_shield_or_flows():
    # Of shield, envs may load only the constraint geometry (the one constraint definition).
    code = (
        "import envs, sys; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('pipeline', 'shield', 'flows', 'ray', 'torch', 'prefect') "
        "and m not in ('shield', 'shield.constraints')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_and_every_command_module_load_nothing_heavy():
    # `sim2real --help` must stay fast: parsers and command modules import torch/Ray/MuJoCo only when a command runs.
    from pipeline.cli import HANDLERS

    modules = sorted({spec.split(":")[0] for spec in HANDLERS.values()})
    imports = "; ".join(f"import {m}" for m in modules)
    assert _loaded_after(f"from pipeline.cli import build_parser; build_parser(); {imports}") == []


def test_every_pipeline_command_runs_from_pipeline_commands():
    from pipeline.cli import HANDLERS

    outside = {
        name: spec for name, spec in HANDLERS.items() if not spec.startswith("pipeline.commands.") and name != "serve"
    }  # serve is the edge's own CLI
    assert outside == {}


def _library_modules() -> list[str]:
    # Not library: the command line itself, and the rendering subprocess, whose `main` isolates MuJoCo's renderer.
    paths = (str(p.relative_to(ROOT / "pipeline")) for p in (ROOT / "pipeline").rglob("*.py"))
    return sorted(p for p in paths if not p.startswith("commands/") and p not in ("cli.py", "evaluation/animation.py"))


@pytest.mark.parametrize("path", _library_modules())
def test_library_modules_hold_no_command_line_code(path):
    # Output, argument handling and exit codes live in pipeline/commands/ (one policy); the library returns and raises.
    source = (ROOT / "pipeline" / path).read_text()
    assert not any(word in source for word in ("def run_cli", "argparse", "sys.exit(")), path


def test_a_folder_named_like_a_package_where_the_user_runs_does_not_replace_it(tmp_path):
    """An outside user ran `shield synthesize --out shield` and then `python -m pipeline.cli falsify` in that folder:
    `shield` was imported as the empty folder, and the command died deep in the synthesis cache on a module with no
    file. setuptools' default editable finder runs after Python's path search (pypa/setuptools#3557); the README's
    install (editable_mode=compat) puts the checkout on the path itself, where the real package wins."""
    for name in ("shield", "envs", "pipeline", "flows"):
        (tmp_path / name).mkdir()  # a user's output folders, no __init__.py
    code = (
        "import json, envs, flows, pipeline, shield, shield.spec, pipeline.cli; "
        "print(json.dumps([m.__file__ for m in (envs, flows, pipeline, shield)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(f is not None and Path(f).resolve().is_relative_to(ROOT) for f in files), files
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "falsify", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0 and "--budget-s" in run.stdout, run.stderr[-2000:]
