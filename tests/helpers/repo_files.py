"""The project's tracked files, for the tests that check a task declared as data is named by no code."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_TEXT = (".py", ".toml", ".yaml", ".yml", ".cfg", ".txt", ".xml", ".json")


def tracked_files() -> list[str]:
    """Paths (relative to the repository) of every file git tracks."""
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()


def files_naming(names) -> list[str]:
    """`path: name` for each project file outside configs/, tests/ and docs (docs/, *.md) that contains a name."""
    offenders = []
    for rel in tracked_files():
        if rel.startswith(("configs/", "tests/", "docs/")) or rel.endswith(".md"):
            continue
        path = REPO / rel
        if path.suffix not in _TEXT or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{rel}: {n}" for n in names if n in text]
    return offenders
