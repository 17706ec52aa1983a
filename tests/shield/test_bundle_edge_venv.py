"""Edge load: a bundle loads and acts in a fresh venv where only `pip install sim2real[edge]` was run.

That install pulls numpy, onnxruntime and daqp and nothing else; the test asserts
no torch/mujoco/ray/gymnasium/prefect is importable there or imported by the runtime.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from pipeline.deployment.export import export_deterministic
from pipeline.deployment.registry import Registry
from tests.helpers.bundle_helpers import shield_spec, trained_like_policy

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "mujoco", "ray", "gymnasium", "prefect", "onnx", "pydantic", "yaml", "pipeline", "envs"]
# What building the sim2real distribution needs (a copy, so the shared tree gets no build/ litter).
SOURCE = ["pyproject.toml", "README.md", "envs", "pipeline", "shield", "flows"]

EDGE_SCRIPT = """
import json, sys
import numpy as np
from shield.runtime import EdgeRuntime, resolve_production
bundle = resolve_production(sys.argv[1], "planar")
runtime = EdgeRuntime.load(bundle)
safe, raw, info = runtime.act(np.array([1.95, 0.0, 2.0, 0.0], np.float32))
print(json.dumps({"bundle": str(bundle), "safe": safe.tolist(), "raw": raw.tolist(),
                  "intervened": bool(info["intervened"]),
                  "heavy": sorted(m for m in %r if m in sys.modules),
                  "site": [p for p in sys.path if "site-packages" in p],
                  "shield_module": sys.modules["shield.runtime"].__file__}))
"""


@pytest.fixture(scope="session")
def edge_python(tmp_path_factory):
    """Python of a fresh venv after `pip install <repo>[edge]` (pip reaches the configured index)."""
    base = tmp_path_factory.mktemp("edge")
    source = base / "sim2real-src"
    source.mkdir()
    for name in SOURCE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.exists():
            shutil.copy2(src, source / name)
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(base / "venv")
    python = base / "venv" / "bin" / "python"
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{source}[edge]"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"pip install sim2real[edge] into the edge venv failed:\n{out.stderr[-2000:]}"
    return python


def test_bundle_loads_and_acts_in_an_edge_venv_without_torch(edge_python, tmp_path):
    policy, meta = trained_like_policy()
    registry = Registry(tmp_path / "models")
    result = export_deterministic(policy, meta, shield_spec(), config_hash="c0ffee", registry_root=registry.root)
    registry.promote("planar", result["version"])

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    out = subprocess.run(
        [str(edge_python), "-c", EDGE_SCRIPT % (HEAVY,), str(registry.root)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], f"the edge runtime imported {report['heavy']}"
    assert all(str(edge_python.parents[1]) in p for p in report["site"]), report["site"]
    assert report["shield_module"].startswith(str(edge_python.parents[1])), "must run the installed copy"
    assert report["bundle"].endswith("planar/1")
    # The same bundle acts the same way at the edge as here, and the shield is active there.
    import numpy as np

    from shield.runtime import EdgeRuntime

    safe, raw, _ = EdgeRuntime.load(result["bundle"]).act(np.array([1.95, 0.0, 2.0, 0.0], np.float32))
    assert np.allclose(report["raw"], raw, atol=1e-6) and np.allclose(report["safe"], safe, atol=1e-6)
    assert report["intervened"] and report["safe"][0] <= 0.0


def test_edge_install_pulls_only_the_edge_packages(edge_python):
    out = subprocess.run(
        [str(edge_python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {p["name"].lower() for p in json.loads(out.stdout)}
    assert {"sim2real", "numpy", "onnxruntime", "daqp"} <= installed
    assert not installed & {"torch", "mujoco", "ray", "gymnasium", "prefect", "onnx", "pydantic"}, installed
