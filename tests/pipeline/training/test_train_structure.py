"""The shape of pipeline/training/: one table names the algorithms, no import cycle, no private name crosses a module.

Read from the source (ast), so a lazy import inside a function counts like one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.config import ALGORITHM_NAMES, TRAIN_CONFIGS

ROOT = Path(__file__).resolve().parents[3]
TRAINING = ROOT / "pipeline" / "training"
TABLE = TRAINING / "algorithms.py"


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, absolute or relative."""
    found = []
    package = _module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{module}" if module else base
            names = [alias.name for alias in node.names]
            found.append((module, names))
            # `from pipeline.training import sac` imports the module pipeline.training.sac
            found += [
                (f"{module}.{n}", [])
                for n in names
                if (ROOT / Path(*f"{module}.{n}".split("."))).with_suffix(".py").is_file()
            ]
    return found


def test_the_training_package_has_no_import_cycle():
    modules = {_module_name(p): p for p in TRAINING.glob("*.py")}
    graph = {name: {m for m, _ in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(name) :] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, stack + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_private_name_of_the_training_package_is_imported_elsewhere():
    crossing = [
        f"{_module_name(p)} takes {n} from {m}"
        for p in _modules("pipeline", "flows", "tests", "bench")
        for m, names in _imports(p)
        if m.startswith("pipeline.training") and m != _module_name(p)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert crossing == []


def _string_compares(path: Path) -> list[str]:
    """Comparisons (==, !=, in, match cases) against an algorithm's name, with their line."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op in operands:
                values = [op] + (list(op.elts) if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [])
                if any(isinstance(v, ast.Constant) and v.value in ALGORITHM_NAMES for v in values):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        elif (
            isinstance(node, ast.MatchValue)
            and isinstance(node.value, ast.Constant)
            and node.value.value in ALGORITHM_NAMES
        ):
            hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


def test_only_the_table_compares_against_an_algorithm_name():
    hits = [h for p in _modules("pipeline", "flows") if p != TABLE for h in _string_compares(p)]
    assert hits == []


def test_the_table_and_the_config_know_the_same_algorithms():
    from pipeline.training.algorithms import ALGORITHMS

    assert list(ALGORITHMS) == list(ALGORITHM_NAMES)
    for name, row in ALGORITHMS.items():
        assert row.name == name and row.config in TRAIN_CONFIGS
        assert row.config.model_fields["algorithm"].annotation.__args__ == (name,)
