"""Shield synthesis kept on disk between processes (pipeline.safety.cache): a spec built from the cache is the one
built afresh; anything the numbers are computed from changes the key; a torn, foreign or unkeepable entry is
computed again, never served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.safety import cache, predictive, synthesis
from pipeline.safety.shield_spec import build_shield_spec

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty cache folder of the test's own, and no synthesis held in this process."""
    monkeypatch.setenv("SIM2REAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(synthesis, "_CACHE", {})
    monkeypatch.setattr(predictive, "_CACHE", {})
    return tmp_path / "cache" / "synthesis"


def test_a_spec_built_from_the_cache_is_the_one_built_afresh(own_cache, monkeypatch):
    """The crane: its measurement and its predictive filter both come back from disk, and the spec is the same to
    the byte, without measuring or synthesizing again (as in a new process: nothing is held in this one)."""
    cfg = load_config(ROOT / "configs" / "crane.yaml")
    fresh = json.dumps(build_shield_spec(cfg), sort_keys=True)
    # No timing in the spec: shield.json's content decides whether a hot reload keeps a plant's shield, and two
    # nights with the same shield differed only in a wall time.
    assert "wall_s" not in fresh
    assert sorted(p.name.split("-")[0] for p in own_cache.glob("*.json")) == ["measurement", "predictive"]

    def not_again(*args, **kwargs):
        raise AssertionError("computed again: the cache was not read")

    monkeypatch.setattr(synthesis, "_CACHE", {})
    monkeypatch.setattr(predictive, "_CACHE", {})
    monkeypatch.setattr(synthesis, "measure", not_again)
    monkeypatch.setattr(predictive, "section", not_again)
    assert json.dumps(build_shield_spec(cfg), sort_keys=True) == fresh


def split_crane(folder: Path, gear: float) -> Path:
    """The crane declared as a task of its own, its motor in a file the MJCF includes: the YAML and the MJCF's own
    bytes stay the same whatever the included file says."""
    folder.mkdir(parents=True, exist_ok=True)
    xml = (ROOT / "configs" / "crane_gantry.xml").read_text()
    start, end = xml.index("  <actuator>"), xml.index("</actuator>") + len("</actuator>")
    (folder / "crane_main.xml").write_text(xml[:start] + '  <include file="crane_motor.xml"/>\n' + xml[end:])
    motor = xml[start:end].replace('gear="60"', f'gear="{gear}"')
    (folder / "crane_motor.xml").write_text(f"<mujoco>\n{motor}\n</mujoco>\n")
    doc = yaml.safe_load((ROOT / "configs" / "crane.yaml").read_text())
    doc["task"].update(name="cachecrane", env_id=f"sim2real/CacheCrane{folder.parent.name.replace('_', '')}-v0")
    doc["plant"]["mjcf"] = "crane_main.xml"
    (folder / "crane.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / "crane.yaml"


def test_the_key_changes_with_everything_the_numbers_are_computed_from(tmp_path, monkeypatch, own_cache):
    path = split_crane(tmp_path / "plant", gear=60)
    cfg = load_config(path)
    key = cache.entry_key("measurement", cfg)
    assert key == cache.entry_key("measurement", load_config(path))  # the same inputs, the same key
    # A file the MJCF includes: the config's hash (which reads the MJCF's own bytes) cannot see it, the key does.
    (tmp_path / "plant" / "crane_motor.xml").write_text(
        (tmp_path / "plant" / "crane_motor.xml").read_text().replace('gear="60"', 'gear="45"')
    )
    edited = load_config(path)
    assert edited.config_hash() == cfg.config_hash() and cache.entry_key("measurement", edited) != key
    # The config's own numbers, what the result is built on, its kind, and the code that computes it.
    narrower = cfg.model_copy(deep=True)
    narrower.shield.synthesis_samples += 1
    assert cache.entry_key("measurement", narrower) != key
    assert cache.entry_key("measurement", cfg, extra={"margin": 0.01}) != key
    assert cache.entry_key("predictive", cfg) != key
    monkeypatch.setattr(cache, "code_identity", lambda: "another checkout's code")
    assert cache.entry_key("measurement", cfg) != key
    # A model MuJoCo cannot compile has no key: computed (and refused there, with its reason), never kept.
    (tmp_path / "plant" / "crane_motor.xml").unlink()
    assert cache.entry_key("measurement", edited) is None
    compute, calls = counting({"a": 1})
    assert cache.cached("demo", edited, compute, dict, dict) == {"a": 1} and not own_cache.exists()


def counting(value):
    calls = []

    def compute():
        calls.append(1)
        return value

    return compute, calls


def test_a_torn_or_foreign_entry_is_computed_again_and_rewritten(own_cache):
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    compute, calls = counting({"brake": [1.5, 2.5]})
    assert cache.cached("demo", cfg, compute, dict, dict) == {"brake": [1.5, 2.5]}
    assert cache.cached("demo", cfg, compute, dict, dict) == {"brake": [1.5, 2.5]} and len(calls) == 1
    (entry,) = own_cache.glob("demo-*.json")
    kept = entry.read_text()
    entry.write_text(kept[: len(kept) // 2])  # torn
    assert cache.cached("demo", cfg, compute, dict, dict) == {"brake": [1.5, 2.5]} and len(calls) == 2
    assert entry.read_text() == kept
    foreign = json.loads(kept)
    foreign.update(key="0" * 64, value={"brake": [9.0, 9.0]})  # another key's numbers under this name
    entry.write_text(json.dumps(foreign))
    assert cache.cached("demo", cfg, compute, dict, dict) == {"brake": [1.5, 2.5]} and len(calls) == 3
    assert entry.read_text() == kept


def test_a_value_that_does_not_come_back_equal_is_served_but_not_kept(own_cache):
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    compute, calls = counting((1.5, 2.5))  # a tuple: JSON gives back a list
    assert cache.cached("demo", cfg, compute, list, list) == (1.5, 2.5)
    assert cache.cached("demo", cfg, compute, list, list) == (1.5, 2.5) and len(calls) == 2
    assert not list(own_cache.glob("demo-*.json"))


def test_an_empty_cache_setting_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SIM2REAL_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() is None
    compute, calls = counting({"a": 1})
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    cache.cached("demo", cfg, compute, dict, dict)
    cache.cached("demo", cfg, compute, dict, dict)
    assert len(calls) == 2 and not list(tmp_path.rglob("*.json"))
    monkeypatch.delenv("SIM2REAL_CACHE_DIR")
    assert cache.cache_dir() == tmp_path / "sim2real" / "synthesis"


def test_entries_another_code_identity_wrote_are_removed_when_one_is_written(own_cache, monkeypatch):
    """An upgrade (or an edited checkout) can never read the entries of the code before it: writing an entry removes
    them and their lock files once they are STALE_AFTER_S old (a second checkout in use keeps its own), and keeps
    every entry this code wrote."""
    import os
    import time

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    monkeypatch.setattr(cache, "code_identity", lambda: "last release's code")
    cache.cached("demo", cfg, lambda: {"a": 1}, dict, dict)
    (old,) = own_cache.glob("demo-*.json")
    assert old.with_suffix(".lock").exists()
    older = own_cache / "predictive-0.json"  # the format before entries stated their code
    older.write_text(json.dumps({"key": "0", "kind": "predictive", "value": {}}))
    monkeypatch.setattr(cache, "code_identity", lambda: "this release's code")
    assert cache.cached("demo", cfg, lambda: {"a": 2}, dict, dict) == {"a": 2}  # another code: another key
    assert old.exists() and older.exists()  # recent: another checkout may be using them
    aged = time.time() - cache.STALE_AFTER_S - 60
    for path in (old, older):
        os.utime(path, (aged, aged))
    assert cache.cached("demo", cfg, lambda: {"b": 3}, dict, dict, extra=1) == {"b": 3}
    kept = sorted(own_cache.glob("*.json"))
    assert len(kept) == 2 and old not in kept and not older.exists() and not old.with_suffix(".lock").exists()
    assert all(json.loads(p.read_text())["code"] == "this release's code" for p in kept)
    mine = kept[0]
    os.utime(mine, (aged, aged))  # this code's own entries stay, however old
    cache.cached("demo", cfg, lambda: {"c": 4}, dict, dict, extra=2)
    assert mine.exists()
