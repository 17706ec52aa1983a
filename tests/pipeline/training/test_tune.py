"""`sim2real tune`: population-based training on a real local Ray (Tune's PBT, a population of 4).

One small search runs through the command line; while it runs, a member's process is killed. The search
must then show: after an exploit (a better member's checkpoint restored under perturbed hyperparameters) the
learning rate the optimizer actually steps with is the perturbed one (ray-project/ray#62173 is the bug of
keeping the checkpoint's); the killed member is restarted from its checkpoint and goes on from its step
count; the winner is an ordinary run directory that `sim2real export` takes with parity; TensorBoard has
every member.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.cli import main
from pipeline.config import AppoTrainConfig, SacConfig, Td3Config
from pipeline.deployment.export import PARITY_TOL
from pipeline.training.learner import Learner, appo_policy_loss
from pipeline.training.sac import SacLearner
from pipeline.training.td3 import Td3Learner
from pipeline.training.tune import read_lineage

ROOT = Path(__file__).resolve().parents[3]
POPULATION = 4


def tune_config(tmp_path: Path, **tune) -> Path:
    """cartpole.yaml on a budget of a few thousand env steps per member, searching the learning rate."""
    data = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    data["plant"]["mjcf"] = str(ROOT / "configs" / data["plant"]["mjcf"])
    data["task"]["max_episode_steps"] = 100
    data["train"].update(
        num_actors=1,
        envs_per_actor=4,
        rollout_length=16,
        batches_per_update=1,
        num_epochs=1,
        num_minibatches=1,
        lr_schedule="constant",  # the learning rate in force is then exactly the member's config value
        total_env_steps=4000,
        device="cpu",
    )
    data["validation"].update(every_updates=2, episodes=2)
    data["tune"] = {
        "population": POPULATION,
        "perturbation_interval": 1,
        "quantile_fraction": 0.5,
        "searchable": {"lr": {"low": 1e-4, "high": 3e-3, "log": True}},
        **tune,
    }
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def sim2real(capsys, *argv) -> tuple[int, dict]:
    capsys.readouterr()
    code = main([*map(str, argv), "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


def lineage_after(member_dir: Path, t: float) -> list[dict]:
    """The member's lives begun after time t (none while its lineage is being appended to)."""
    try:
        return [life for life in read_lineage(member_dir) if life["time"] > t]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def records(member_dir: Path, start: int = 0) -> list[dict]:
    """The member's metrics records from line `start` on ([] while a line is half written)."""
    try:
        with open(member_dir / "metrics.jsonl") as f:
            return [json.loads(line) for line in f.readlines()[start:]]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def latest_validation_return(member_dir: Path) -> float:
    """The member's latest validation return (-inf before its first)."""
    return next((r["validation_return"] for r in reversed(records(member_dir)) if "validation_return" in r), -math.inf)


def member_of(trial_dir: Path) -> str:
    return trial_dir.name.split("_")[2] + "_" + trial_dir.name.split("_")[3]


def past_a_kept_report(member_dir: Path, life: dict, every: int) -> bool:
    """Whether the member's current life has trained on past one of its own reports. Tune's report blocks the
    member until the driver asks for the next result, which it does only once PBT has decided to keep the
    member going; an exploit stops the member at the report instead. An update after a report is then proof
    that PBT kept the member, and its next decision comes at the next report, `every` updates on."""
    own = records(member_dir, life["metrics_line"])
    restored = life.get("updates", 0)
    return bool(own) and own[-1]["updates"] % every != 0 and own[-1]["updates"] > restored + every


def kill_members(out: Path, kills: list, done: threading.Event) -> None:
    """SIGKILL the process of a member that has handed Tune three checkpoints (a real death, not a mock), and
    wait for that member's next life. The kill lands between two reports of a member PBT has just kept (the
    best-scoring first), so that Tune restarts it from its own checkpoint; had PBT decided to exploit it at the
    report just before, its next life would rightly start from another member's checkpoint. If a death is still
    followed by an exploit, kill another member, until one death is followed by the member's own resume."""
    every = 2  # the checkpoint (and report) interval: tune_config's validation.every_updates
    while not done.is_set():
        trial_dirs = (out / "tune" / "pbt").glob("run_member_*")
        by_score = sorted(trial_dirs, key=lambda d: -latest_validation_return(out / "members" / member_of(d)))
        for trial_dir in by_score:
            member = member_of(trial_dir)
            if any(k["member"] == member for k in kills) or len(list(trial_dir.glob("checkpoint_*"))) < 3:
                continue
            if not (lives := lineage_after(out / "members" / member, 0.0)):
                continue
            if not past_a_kept_report(out / "members" / member, lives[-1], every):
                continue
            pid = lives[-1]["pid"]  # the member's current life
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # that life had just ended (its member exploited or done): not a death
            kills.append(dict(member=member, pid=pid, time=time.time()))
            while not done.is_set() and not (after := lineage_after(out / "members" / member, kills[-1]["time"])):
                time.sleep(0.2)
            if not done.is_set() and after[0]["event"] == "resume":
                return
            break
        time.sleep(0.05)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One `sim2real tune` run, members killed while it runs: (exit code, JSON, out dir, the kills in order)."""
    tmp = tmp_path_factory.mktemp("tune")
    out, kills, done = tmp / "out", [], threading.Event()
    killer = threading.Thread(target=kill_members, args=(out, kills, done), daemon=True)
    killer.start()
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(["tune", "--config", str(tune_config(tmp)), "--out", str(out), "--json"])
    finally:
        done.set()
        killer.join()
    printed = json.loads(stdout.getvalue())  # one JSON object on stdout, nothing else
    assert printed == json.loads((out / "tune.json").read_text())
    return code, printed, out, kills


def lives(out: Path):
    """Every member's lives: (member, life, the metrics records of that life, in order)."""
    for member_dir in sorted((out / "members").iterdir()):
        for life in read_lineage(member_dir):
            # A life's records start at its metrics_line and count up from the checkpoint it restored
            # (a stopped life may have written a record or two more after it).
            first = life.get("updates", 0) + 1
            own = [r for r in records(member_dir, life["metrics_line"]) if r["updates"] >= first]
            run = []
            for r in own:
                if r["updates"] != first + len(run):
                    break
                run.append(r)
            yield member_dir.name, life, run


@pytest.mark.timeout(600)
def test_the_best_member_is_a_run_directory_that_exports_with_parity(searched, tmp_path, capsys):
    code, summary, out, _ = searched
    assert code == 0
    assert summary["population"] == POPULATION and len(summary["members"]) == POPULATION
    best = max(summary["members"], key=lambda m: m["best_validation_return"])
    assert summary["best_member"] == best["member"]
    assert summary["best_validation_return"] == best["best_validation_return"]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["train"]["lr"] == pytest.approx(summary["best_hyperparameters"]["lr"])
    for m in summary["members"]:  # TensorBoard on OUT shows every member, one run directory each
        assert list((out / "members" / m["member"]).glob("events.out.tfevents.*"))

    code, exported = sim2real(capsys, "export", out, "--out", tmp_path / "bundle")
    assert code == 0 and exported["parity_max_abs_err"] <= PARITY_TOL


@pytest.mark.timeout(600)
def test_a_perturbed_learning_rate_is_the_one_the_optimizer_uses_after_an_exploit(searched):
    _, summary, out, _ = searched
    exploits = [(m, life, run) for m, life, run in lives(out) if life["event"] == "exploit"]
    assert summary["perturbations"] == len(exploits) >= 1
    perturbed = 0
    for member, life, run in exploits:
        assert run, f"{member}: no update after its exploit at update {life['updates']}"
        in_force = [r["lr"] for r in run]  # read back from the optimizer's param group every update
        assert in_force == [pytest.approx(life["hyperparameters"]["lr"], rel=1e-9)] * len(run), member
        perturbed += life["hyperparameters"]["lr"] != pytest.approx(life["from_hyperparameters"]["lr"], rel=1e-6)
    assert perturbed >= 1  # at least one exploit whose new rate differs from the checkpoint's


@pytest.mark.timeout(600)
def test_a_killed_member_restarts_from_its_checkpoint_and_keeps_its_step_count(searched):
    _, _, out, kills = searched
    assert kills, "no member reported a checkpoint to kill"
    for killed in kills:
        after = [(life, run) for m, life, run in lives(out) if m == killed["member"] and life["time"] > killed["time"]]
        assert after, f"{killed['member']} never came back after its process {killed['pid']} was killed"
        life, run = after[0]
        # A resume, or (for a death PBT had just decided to exploit) another member's checkpoint: either way a
        # new process that goes on from the step count of the checkpoint it restored.
        assert life["event"] == "resume" or (life["event"] == "exploit" and killed is not kills[-1])
        assert (life["from_member"] == killed["member"]) == (life["event"] == "resume")
        assert life["pid"] != killed["pid"] and life["env_steps"] > 0
        assert run and run[0]["updates"] == life["updates"] + 1 and run[0]["env_steps"] > life["env_steps"]
    trial_dirs = list((out / "tune" / "pbt").glob(f"run_member_{kills[-1]['member']}_*"))
    assert any((d / "error.txt").exists() for d in trial_dirs)  # Tune saw the failure and retried the trial


@pytest.mark.parametrize("learner", ["vtrace", "sac", "td3"])
def test_a_restored_learner_steps_with_its_own_config_learning_rate(learner):
    spec = dict(obs_dim=3, act_dim=1, hidden_sizes=[8], action_low=[-1.0], action_high=[1.0])

    def make(lr):
        if learner == "vtrace":
            return Learner(spec, AppoTrainConfig(lr=lr), torch.device("cpu"), appo_policy_loss)
        cls, cfg = (SacLearner, SacConfig) if learner == "sac" else (Td3Learner, Td3Config)
        return cls(spec, cfg(lr=lr), 0.99, torch.device("cpu"))

    donor, member = make(1e-3), make(4e-4)
    member.load_state_dict(donor.state_dict())
    optimizers = [v for v in vars(member).values() if isinstance(v, torch.optim.Optimizer)]
    assert optimizers and {g["lr"] for o in optimizers for g in o.param_groups} == {4e-4}


def test_a_searchable_key_the_algorithm_does_not_read_exits_2_naming_it(tmp_path, capsys):
    config = tune_config(tmp_path, searchable={"clip_param": {"low": 0.1, "high": 0.3}})
    data = yaml.safe_load(config.read_text())
    data["train"] = {"algorithm": "impala"}
    config.write_text(yaml.safe_dump(data))
    assert main(["tune", "--config", str(config)]) == 2
    assert "tune.searchable.clip_param: not read by train.algorithm 'impala'" in capsys.readouterr().err


def test_a_run_without_validation_exits_2(tmp_path, capsys):
    data = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    data["validation"] = {"enabled": False}
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(data))
    assert main(["tune", "--config", str(tmp_path / "plain.yaml")]) == 2
    assert "ranked by validation return" in capsys.readouterr().err


def test_an_off_policy_algorithm_is_refused_by_name(tmp_path, capsys):
    data = yaml.safe_load((ROOT / "configs" / "cartpole_sac.yaml").read_text())
    data["tune"] = {"searchable": {"sac.lr": {"low": 1e-4, "high": 1e-3}}}
    (tmp_path / "sac.yaml").write_text(yaml.safe_dump(data))
    assert main(["tune", "--config", str(tmp_path / "sac.yaml")]) == 2
    assert "train.algorithm 'sac' cannot run as a population member" in capsys.readouterr().err
