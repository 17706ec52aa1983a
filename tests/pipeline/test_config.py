"""The task config: shipped files validate, and bad input names its key path."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture()
def cartpole_dict():
    return yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    # A task's own file is named after it; a variant (another algorithm) names the task it trains first.
    assert cfg.task.name == path.stem or (cfg.plant is None and path.stem.startswith(cfg.task.name + "_"))
    assert {"train", "reality"} <= set(cfg.randomization)


def test_config_hash_is_stable_and_sensitive(cartpole_dict):
    a = parse_config(copy.deepcopy(cartpole_dict))
    b = parse_config(copy.deepcopy(cartpole_dict))
    assert a.config_hash() == b.config_hash()
    cartpole_dict["train"]["lr"] = 2 * a.train.lr
    assert parse_config(cartpole_dict).config_hash() != a.config_hash()


def _error_for(data) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "test.yaml")
    return str(err.value)


def test_unknown_key_is_named(cartpole_dict):
    cartpole_dict["train"]["learning_rate"] = 1e-3
    msg = _error_for(cartpole_dict)
    assert "train.learning_rate" in msg and "unknown key" in msg


def test_wrong_type_is_named(cartpole_dict):
    cartpole_dict["train"]["num_actors"] = "many"
    assert "train.num_actors" in _error_for(cartpole_dict)


def test_impossible_value_is_named(cartpole_dict):
    cartpole_dict["gate"]["max_intervention_rate"] = 1.5
    assert "gate.max_intervention_rate" in _error_for(cartpole_dict)


def test_missing_reality_set_is_an_error(cartpole_dict):
    del cartpole_dict["randomization"]["reality"]
    assert "reality" in _error_for(cartpole_dict)


def _first_uniform_range(node, path=()):
    """Path to the first {low, high} range in a randomization set."""
    if isinstance(node, dict):
        if "low" in node and "high" in node:
            return path
        for k, v in node.items():
            found = _first_uniform_range(v, path + (k,))
            if found is not None:
                return found
    return None


def test_low_above_high_in_randomization_is_named(cartpole_dict):
    path = _first_uniform_range(cartpole_dict["randomization"]["train"])
    assert path is not None, "the train set should randomize something"
    node = cartpole_dict["randomization"]["train"]
    for k in path:
        node = node[k]
    node["low"], node["high"] = max(node["low"], node["high"]) + 1.0, min(node["low"], node["high"])
    msg = _error_for(cartpole_dict)
    assert "randomization.train." + ".".join(map(str, path)) in msg


def test_negative_mass_scale_is_named(cartpole_dict):
    train = cartpole_dict["randomization"]["train"]
    masses = train.get("body_mass")
    assert masses, "cartpole train set randomizes body masses"
    body = next(iter(masses))
    masses[body]["low"] = -0.5
    msg = _error_for(cartpole_dict)
    assert f"randomization.train.body_mass.{body}" in msg


def test_cli_rejects_bad_config_with_key_path(tmp_path, cartpole_dict):
    cartpole_dict["shadow"]["episodes"] = -3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cartpole_dict))
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "--check", str(bad)], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "shadow.episodes" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_documents_every_key():
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for key in ("train.lr", "gate.min_return_ratio", "ray.actor_num_cpus", "shield.enabled"):
        assert key in out.stdout


def test_config_check_json_carries_the_figures_it_measured(capsys):
    """Not only ok: the braking authority, the model error, the input gain, latency and noise the shield will assume,
    and per randomization set what it admits."""
    from pipeline.cli import main

    assert main(["config", "--check", str(ROOT / "configs" / "arm.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shield = out["ok"] and out["shield"]
    assert len(shield["brake_accel"]) == 2 and all(
        min(b) > 0 if isinstance(b, list) else b > 0 for b in shield["brake_accel"]
    )
    assert len(shield["max_accel_error"]) == 2 and shield["latency_steps"][0] <= shield["latency_steps"][1]
    assert shield["margin"] > 0 and 0 < shield["input_gain_error"] < 1 and shield["synthesized"] is True
    assert shield["filter"] == "braking barrier"  # the arm's drive brakes every joint (the crane's: predictive)
    assert {"train", "reality"} <= set(shield["sets"]) and "authority_accel" in shield["sets"]["reality"]
    # In words, an ok is not a certificate: the check names the command that falsifies the shield (helper-37's
    # plant passed the check and was refused by `shield synthesize`).
    assert main(["config", "--check", str(ROOT / "configs" / "arm.yaml")]) == 0
    assert "next: `sim2real shield synthesize --config " in capsys.readouterr().out
    assert out["gate_note"] is None


def test_a_gate_budget_below_its_fewest_passing_episodes_is_said_at_check():
    """helper-55 set gate.max_episodes 10 (below gate.min_episodes, 20) and `config --check` said ok; every night
    then ends without a pass."""
    from pipeline.commands.config import gate_note
    from pipeline.config import GateConfig

    note = gate_note(GateConfig(max_episodes=10))
    assert "gate.max_episodes (10) is below gate.min_episodes (20)" in note and "no night can promote" in note
    assert gate_note(GateConfig(max_episodes=20)) is None


def test_config_check_takes_the_file_as_every_other_command_does(capsys):
    """helper-45 typed `config --check --config FILE`, as `eval` and `train` take a config, and got argparse's
    `expected one argument`: both forms check the file; a bare --check says what it needs."""
    from pipeline.cli import main

    path = str(ROOT / "configs" / "cartpole.yaml")
    for args in (["--check", path], ["--check", "--config", path], ["--config", path]):
        assert main(["config", *args, "--json"]) == 0, args
        assert json.loads(capsys.readouterr().out)["task"] == "cartpole"
    assert main(["config", "--check"]) == 2
    assert "needs the file to validate" in capsys.readouterr().err


def test_the_default_config_is_found_outside_the_checkout(tmp_path, monkeypatch, capsys):
    """helper-68 ran `sim2real train` from a folder of its own: `cannot read config configs/cartpole.yaml`, where
    `sim2real envs` lists the shipped file. The default is the shipped one wherever the command runs; a path given
    that does not exist is still named."""
    from pipeline import DEFAULT_CONFIG
    from pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.task.name == "cartpole" and Path(cfg.plant["mjcf"]).is_file()
    case = dict(set="reality", domain={}, policy="random", seed=5, attack=None, episodes=1, episode_steps=20)
    (tmp_path / "case-0.json").write_text(json.dumps(case))
    assert main(["falsify", "--replay", "case-0.json"]) in (0, 1)  # no --config: the default
    assert "1 episode(s) of 20 steps" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="configs/crane.yaml"):
        load_config("configs/crane.yaml")  # not the default: not looked up elsewhere
