"""The task registry: one TaskSpec per task, unknown ids fail loudly, and envs/ has no import cycle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

import envs


def test_envs_modules_import_without_a_cycle():
    """tasks -> wrappers -> domain -> randomization used to close back on tasks (hidden by a function-level import)."""
    import grimp

    graph = grimp.build_graph("envs")
    cycles = []
    for a in sorted(m for m in graph.modules if m != "envs"):
        for b in graph.find_modules_directly_imported_by(a):
            if b.startswith("envs.") and graph.find_shortest_chain(importer=b, imported=a):
                cycles.append((a, b))
    assert cycles == []
    # The function-level imports that hid it are gone too: randomization imports nothing of envs.
    assert graph.find_modules_directly_imported_by("envs.randomization") == set()


def test_every_task_is_one_spec_and_unknown_ids_fail_loudly():
    ids = [t["env_id"] for t in envs.describe_tasks()]
    assert {"sim2real/CartPoleRail-v0", "sim2real/QuadrotorGeofence-v0"} <= set(ids)
    # The shipped tasks: a test that ran before in this process may have registered a plant from its own temporary
    # folder, since changed or removed (a cache test edits an included MJCF), and that plant is its to check.
    configs = (Path(__file__).resolve().parents[2] / "configs").resolve()
    ids = [i for i in ids if envs.task_config_path(i).resolve().parent == configs]
    assert len(ids) >= 7
    for env_id in ids:
        spec = envs.task(env_id)
        assert envs.safety_spec(env_id)["model"] == spec.shield_model["type"]
        assert envs.task_config_path(env_id).name.endswith(".yaml")
    # No fall-through: an unknown task never gets another task's settings.
    for call in (envs.safety_spec, envs.legacy_controller, envs.task_config_path, envs.nominal_model):
        with pytest.raises(envs.UnknownTaskError, match="Conveyor-v0.*known tasks"):
            call("sim2real/Conveyor-v0")
    with pytest.raises(ValueError, match="double_integrator"):
        envs.nominal_model("sim2real/QuadrotorGeofence-v0")


def test_a_set_name_is_read_from_the_tasks_yaml(tmp_path, monkeypatch):
    """A code task's YAML: $SIM2REAL_CONFIG_DIR is consulted when a set is asked for, not frozen at import.
    A declared task's YAML is the file that declares it."""
    (tmp_path / "quadrotor.yaml").write_text("randomization:\n  calm: {obs_noise_std: 0.0}\n")
    monkeypatch.setenv("SIM2REAL_CONFIG_DIR", str(tmp_path))
    assert envs.task_config_path("sim2real/QuadrotorGeofence-v0") == tmp_path / "quadrotor.yaml"
    assert envs.resolve_randomization("sim2real/QuadrotorGeofence-v0", "calm").is_empty()
    declared = envs.task_config_path("sim2real/CartPoleRail-v0")
    assert declared == Path(__file__).resolve().parents[2] / "configs" / "cartpole.yaml"


def _own_task_list(monkeypatch) -> None:
    """Files a test registers are listed in $SIM2REAL_TASKS, which every later subprocess inherits: a file this
    test then edits into a conflicting declaration would make them warn. The list comes back after the test."""
    monkeypatch.setenv("SIM2REAL_TASKS", os.environ.get("SIM2REAL_TASKS", ""))


def test_a_copy_of_a_shipped_yaml_elsewhere_is_the_same_task(tmp_path, monkeypatch):
    """An edited copy (other sets, same plant) finds the shipped MJCF by name and registers as the shipped task."""
    import yaml

    _own_task_list(monkeypatch)

    from envs.tasks import register_task_file

    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "configs" / "cartpole.yaml").read_text())
    doc["randomization"]["reality"]["latency_steps"] = {"low": 1, "high": 1}
    copy = tmp_path / "my_cartpole.yaml"
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert register_task_file(copy, check=True) is envs.task("sim2real/CartPoleRail-v0")
    doc["plant"]["episode_steps"] = 100  # a different plant under the same id is refused
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(envs.UnknownTaskError, match="declared twice"):
        register_task_file(copy)


def test_an_installed_wheel_finds_the_task_yamls_without_a_checkout(tmp_path):
    """A non-editable install: configs/ ships as data, every task (the arm's MJCF included) resolves from there."""
    import shutil
    import subprocess
    import sys
    import venv
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "envs", "pipeline", "shield", "flows", "configs"):
        if (root / name).is_dir():
            shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(root / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    wheel = next((tmp_path / "dist").glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--ignore-installed",
            "-q",
            "--prefix",
            str(env_dir),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # The heavy dependencies come from this interpreter's site-packages, after the wheel's own files.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site) / "zz_deps.pth").write_text("\n".join(deps) + "\n")
    code = (
        "import envs, json, gymnasium as gym; "
        "print(json.dumps([envs.__file__, {t['task']: t['config'] for t in envs.describe_tasks()}, "
        "gym.make(envs.describe_tasks()[-1]['env_id'], randomization='reality').reset(seed=0)[0].tolist()]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SIM2REAL_CONFIG_DIR", "SIM2REAL_TASKS")}
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    module, configs, obs = json.loads(out.stdout.strip().splitlines()[-1])
    assert module.startswith(str(env_dir))
    shipped = {yaml.safe_load(p.read_text())["task"]["name"] for p in (root / "configs").glob("*.yaml")}  # variants too
    assert set(configs) == shipped and all(
        c.startswith(str(env_dir / "share" / "sim2real" / "configs")) for c in configs.values()
    )
    assert len(obs) > 0


def test_a_checkout_elsewhere_is_the_same_task_with_the_same_config_hash(tmp_path, monkeypatch):
    """The task's identity and the config hash read the MJCF's name and bytes, not its absolute path:
    a copy of configs/ (YAML beside its MJCF) is the same task with the same hash; an edited MJCF is not."""
    import shutil

    _own_task_list(monkeypatch)

    from envs.tasks import register_task_file
    from pipeline.config import load_config

    root = Path(__file__).resolve().parents[2]
    for name in ("cartpole.yaml", "cartpole_rail.xml"):
        shutil.copy(root / "configs" / name, tmp_path / name)
    assert register_task_file(tmp_path / "cartpole.yaml", check=True) is envs.task("sim2real/CartPoleRail-v0")
    assert (
        load_config(tmp_path / "cartpole.yaml").config_hash()
        == load_config(root / "configs" / "cartpole.yaml").config_hash()
    )
    with open(tmp_path / "cartpole_rail.xml", "a") as f:
        f.write("<!-- edited -->\n")
    with pytest.raises(envs.UnknownTaskError, match="declared twice"):
        register_task_file(tmp_path / "cartpole.yaml")


def test_envs_lists_a_plant_declared_elsewhere_and_the_registry_s_tasks(
    tmp_path, tmp_path_factory, monkeypatch, capsys
):
    """`sim2real envs --config FILE` declares a plant kept outside configs/; a task with bundles in the registry
    is listed with its versions, also when its YAML is not found here."""
    import json
    import shutil

    import yaml

    from pipeline.cli import main
    from tests.helpers.bundle_helpers import export_test_bundle

    _own_task_list(monkeypatch)
    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "configs" / "cartpole.yaml").read_text())
    doc["task"] = {"name": "mycart", "env_id": "sim2real/MyCart-v0"}
    shutil.copy(root / "configs" / "cartpole_rail.xml", tmp_path / "my_rail.xml")
    doc["plant"]["mjcf"] = "my_rail.xml"
    (tmp_path / "mycart.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    models = tmp_path / "models"
    assert main(["envs", "--registry", str(models), "--json"]) == 0
    assert "sim2real/MyCart-v0" not in {t["env_id"] for t in json.loads(capsys.readouterr().out)["tasks"]}

    bundle, _ = export_test_bundle(tmp_path_factory, "planar")  # task "planar": a bundle, no YAML here
    (models / "planar").mkdir(parents=True)
    shutil.copytree(bundle, models / "planar" / "1")
    assert main(["envs", "--config", str(tmp_path / "mycart.yaml"), "--registry", str(models), "--json"]) == 0
    tasks = {t["env_id"]: t for t in json.loads(capsys.readouterr().out)["tasks"]}
    mine = tasks["sim2real/MyCart-v0"]
    assert mine["task"] == "mycart" and mine["constraints"] and mine["obs_dim"] == 5
    planar = tasks["sim2real/Planar-test"]
    assert planar["declared_here"] is False and planar["registry"] == {
        "env_id": "sim2real/Planar-test",
        "versions": [1],
        "production": None,
    }
    assert main(["envs", "--config", str(tmp_path / "mycart.yaml"), "--registry", str(models)]) == 0
    assert "only in the registry" in capsys.readouterr().out


def test_an_rk4_plant_is_refused_naming_the_mjcf_option(tmp_path, monkeypatch):
    """MuJoCo's finite differences (the shield's linear model, the LQR) refuse RK4: say so, not a traceback."""
    import shutil

    from pipeline.cli import main

    _own_task_list(monkeypatch)
    root = Path(__file__).resolve().parents[2]
    for name in ("cartpole.yaml", "cartpole_rail.xml"):
        shutil.copy(root / "configs" / name, tmp_path / name)
    xml = tmp_path / "cartpole_rail.xml"
    xml.write_text(xml.read_text().replace('integrator="Euler"', 'integrator="RK4"'))
    yaml_file = tmp_path / "cartpole.yaml"
    yaml_file.write_text(
        yaml_file.read_text().replace("name: cartpole\n", "name: rk4cart\n").replace("CartPoleRail-v0", "Rk4Cart-v0")
    )
    assert main(["config", "--check", str(yaml_file)]) == 2
