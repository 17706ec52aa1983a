"""`tune(cfg)`: population-based training (Ray Tune's PBT) of the same trainer `sim2real train` runs.

Each member is one Tune trial running `train()` on its own run directory, `OUT/members/<trial id>/`
(metrics.jsonl and TensorBoard events per member, so TensorBoard on OUT shows every member). A member
reports its latest validation return with its newest checkpoint every validation.every_updates updates; PBT lets
the worst members copy a better one's checkpoint (exploit) and perturb the hyperparameters
`tune.searchable` names (explore). Tune restarts a member whose process dies from its last checkpoint
(`tune.max_failures`).

A restarted member takes its hyperparameters from its trial's config, never from the checkpoint it
restores: the learners' `load_state_dict` keeps the optimizer's moments and sets the learning rate the
config says (nets.load_optimizer). Every life of a member is one line of `lineage.jsonl` (start, exploit,
resume), with the config it ran under.

The run's result is the member checkpoint with the best validation return: OUT holds it as an ordinary
run directory (config.yaml under which that checkpoint was trained, checkpoints/, metrics.jsonl), so
export, shadow and the gate take it like any other run, and OUT/tune.json says how the search went.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from pipeline.training.actor_pool import ray_for_run
from pipeline.training.algorithms import algorithm
from pipeline.training.checkpoint import (
    CHECKPOINT_DIR,
    best_checkpoint,
    checkpoint_path,
    latest_checkpoint,
    read_checkpoint,
)
from pipeline.training.scaffold import ray_address_for, with_overrides
from pipeline.training.train import train

MEMBERS_DIR = "members"
LINEAGE = "lineage.jsonl"
SUMMARY = "tune.json"
METRIC = "validation_return"
_ORIGIN = "member.json"  # beside a reported checkpoint: which member wrote it, under which hyperparameters


@dataclass
class MemberSummary:
    """One member of the population, as the search left it."""

    member: str  # Tune's trial id; its run directory is OUT/members/<member>
    hyperparameters: dict[str, float]  # in force in its last life
    best_validation_return: float | None  # of the best checkpoint its run directory kept
    env_steps: int
    exploits: int  # lives that began from another member's checkpoint
    resumes: int  # lives that began from its own checkpoint (paused to share the cluster, or its process died)


@dataclass
class TuneResult:
    """What `sim2real tune` prints: the population, how often it perturbed, and the member that won."""

    run_dir: str  # the best member's checkpoint as an ordinary training run directory
    algorithm: str
    population: int
    perturbations: int  # exploits over all members
    resumes: int  # member lives resumed from their own checkpoint (paused by the scheduler, or after a failure)
    best_member: str | None
    best_hyperparameters: dict[str, float] = field(default_factory=dict)
    best_validation_return: float | None = None
    best_updates: int | None = None
    wall_s: float = 0.0
    members: list[MemberSummary] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tune(
    cfg,
    *,
    out_dir=None,
    population: int | None = None,
    budget_s: float | None = None,
    steps: int | None = None,
    ray_address: str | None = None,
) -> TuneResult:
    """Run a population of `cfg`'s trainer under PBT; return the summary with the best member's run directory.

    `population` and `budget_s` (s of wall time for the whole search) override tune.population and
    tune.budget_s; `steps` overrides train.total_env_steps per member; `ray_address` (else $RAY_ADDRESS,
    else ray.address) joins a cluster instead of starting a local Ray.
    """
    from ray import tune as ray_tune
    from ray.tune.schedulers import PopulationBasedTraining

    start = time.perf_counter()
    cfg = with_overrides(cfg, steps, None, None)
    tc, search = cfg.train, cfg.tune
    if not algorithm(tc.algorithm).tunable:
        raise ValueError(
            f"tune: train.algorithm {tc.algorithm!r} cannot run as a population member yet (its loop checkpoints "
            f"and reports on another cadence); tune an on-policy algorithm (appo, impala)"
        )
    if not cfg.validation.enabled:
        raise ValueError("tune: members are ranked by validation return; set validation.enabled: true")
    if not search.searchable:
        raise ValueError("tune.searchable: names no hyperparameter to search (e.g. lr: {low: 1e-4, high: 3e-3})")
    population = search.population if population is None else population
    if population < 2:
        raise ValueError(f"--population {population}: a population needs at least 2 members")
    budget_s = search.budget_s if budget_s is None else budget_s
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"--budget-s {budget_s}: must be > 0 s")
    out = Path(out_dir) if out_dir else Path("runs") / f"{cfg.task.name}-tune-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    members_dir = (out / MEMBERS_DIR).resolve()

    space = {key: _domain(ray_tune, r) for key, r in search.searchable.items()}
    scheduler = _pbt_without_time_sharing(PopulationBasedTraining)(
        time_attr="training_iteration",
        metric=METRIC,
        mode="max",
        perturbation_interval=search.perturbation_interval,
        hyperparam_mutations=space,
        quantile_fraction=search.quantile_fraction,
        resample_probability=search.resample_probability,
        custom_explore_fn=lambda config: _clipped(config, search.searchable),
    )
    # One bundle for the member's learner, one per rollout actor: Tune starts a member's actors inside the
    # member's placement group, so its reservation must hold them (a validation actor asks for no CPU).
    bundles = [{"CPU": 1.0}] + [{"CPU": cfg.ray.actor_num_cpus}] * tc.num_actors
    trainable = ray_tune.with_resources(
        ray_tune.with_parameters(run_member, base_cfg=cfg, members_dir=str(members_dir)),
        ray_tune.PlacementGroupFactory(bundles),
    )
    member_cpus = sum(b["CPU"] for b in bundles)
    with ray_for_run(ray_address_for(cfg, ray_address), population * member_cpus):
        tuner = ray_tune.Tuner(
            trainable,
            param_space=space,
            tune_config=ray_tune.TuneConfig(scheduler=scheduler, num_samples=population, time_budget_s=budget_s),
            run_config=ray_tune.RunConfig(
                name="pbt",
                storage_path=str((out / "tune").resolve()),
                failure_config=ray_tune.FailureConfig(max_failures=search.max_failures),
                verbose=0,
            ),
        )
        tuner.fit()
    return write_result(out, cfg, population, time.perf_counter() - start)


def _pbt_without_time_sharing(pbt_cls):
    """Tune's PBT pauses a member at its perturbation point while another one waits to start, to time-share
    a cluster too small for the population. Here every member's resources are reserved up front (the local
    Ray is sized for the population), and a paused member pays a whole restart (its process, its actors) to
    come back: keep it training instead."""
    from ray.tune.schedulers import TrialScheduler

    class MembersTrainTogether(pbt_cls):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            return TrialScheduler.CONTINUE if decision == TrialScheduler.PAUSE else decision

    return MembersTrainTogether


def _domain(ray_tune, r):
    return ray_tune.loguniform(r.low, r.high) if r.log else ray_tune.uniform(r.low, r.high)


def _clipped(config: dict, ranges: dict) -> dict:
    """PBT's explore scales a value by 0.8 or 1.2 without bounds: keep it inside the range the config states."""
    return {k: min(max(v, ranges[k].low), ranges[k].high) if k in ranges else v for k, v in config.items()}


def member_config(base_cfg, hyperparameters: dict[str, float], member: str):
    """The member's config: the base with its hyperparameters (each validated like the YAML value), its own
    seed, and a checkpoint at every validation (what it reports to Tune)."""
    cfg = base_cfg.model_copy(deep=True)
    for key, value in hyperparameters.items():
        *path, name = key.split(".")
        section = cfg.train
        for part in path:
            section = getattr(section, part)
        try:
            setattr(section, name, float(value))
        except ValueError as err:
            raise ValueError(f"tune.searchable.{key}={value!r}: {err}") from None
    # Members start from different seeds (else a population of four is four copies of one run).
    cfg.train.seed = (base_cfg.train.seed + zlib.crc32(member.encode())) % 2**31
    cfg.train.checkpoint_every = cfg.validation.every_updates
    return cfg


def run_member(config: dict, *, base_cfg, members_dir: str) -> None:
    """One Tune trial: train() on the member's run directory, from the checkpoint Tune hands it (if any)."""
    from ray import tune as ray_tune

    member = ray_tune.get_context().get_trial_id()
    run_dir = Path(members_dir) / member
    hyperparameters = {k: float(v) for k, v in config.items()}
    cfg = member_config(base_cfg, hyperparameters, member)
    _wait_for_previous_life(run_dir)
    restored = _restore(ray_tune.get_checkpoint(), run_dir)
    event = "start" if restored is None else ("resume" if restored["member"] == member else "exploit")
    _append_lineage(run_dir, cfg, event, hyperparameters, restored)
    latest: list[float] = []  # the member's latest validation return, once it has one

    def report(state: dict) -> bool:
        record = state["metrics"]
        if "validation_return" in record:
            latest[:] = [record["validation_return"]]
        if record and state["updates"] % cfg.train.checkpoint_every == 0 and latest:
            # The loop wrote this update's checkpoint just before calling back: hand Tune a copy of it (by its
            # version: a life Tune stopped may still be writing higher-numbered ones into the directory).
            with tempfile.TemporaryDirectory() as tmp:
                shutil.copy2(checkpoint_path(run_dir, state["learner"].version), tmp)
                (Path(tmp) / _ORIGIN).write_text(json.dumps(dict(member=member, hyperparameters=hyperparameters)))
                ray_tune.report(
                    {
                        METRIC: latest[0],
                        "env_steps": state["env_steps"],
                        "updates": state["updates"],
                        "lr_in_force": state["learner"].optimizer.param_groups[0]["lr"],
                    },
                    checkpoint=ray_tune.Checkpoint.from_directory(tmp),
                )
        return False  # the member's budget (train.total_env_steps) or Tune's stops it

    if restored is None and run_dir.exists():
        shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=True)  # a first life that died before reporting
    train(
        cfg,
        out_dir=None if restored else run_dir,
        resume=run_dir if restored else None,
        progress=False,
        callback=report,
    )


def _wait_for_previous_life(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Tune starts a member's next life before its previous process is gone; the old one may still write a
    checkpoint into the run directory, which the new life would then resume from. Wait until it has exited."""
    if not (run_dir / LINEAGE).exists():
        return
    last = read_lineage(run_dir)[-1]
    if last.get("host") != socket.gethostname() or last["pid"] == os.getpid():
        return  # a process on another node cannot be watched from here
    deadline = time.monotonic() + timeout_s
    while _alive(last["pid"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run_dir}: the member's previous process {last['pid']} is still running")
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _restore(checkpoint, run_dir: Path) -> dict | None:
    """Put the checkpoint Tune hands a member (its own, or a better member's) in place of the member's own
    latest, and say whose it was; None for a member's first life."""
    if checkpoint is None:
        return None
    ckpt_dir = run_dir / CHECKPOINT_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in ckpt_dir.glob("ckpt_*.pt"):
        old.unlink()
    with checkpoint.as_directory() as src:
        origin = json.loads((Path(src) / _ORIGIN).read_text())
        for path in Path(src).glob("ckpt_*.pt"):
            shutil.copy2(path, ckpt_dir / path.name)
    state = read_checkpoint(latest_checkpoint(run_dir))
    return dict(origin, updates=int(state["updates"]), env_steps=int(state["env_steps"]))


def _append_lineage(run_dir: Path, cfg, event: str, hyperparameters: dict, restored: dict | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    line = dict(
        event=event,
        time=time.time(),
        host=socket.gethostname(),
        pid=os.getpid(),  # the member's process in this life
        hyperparameters=hyperparameters,
        config_hash=cfg.config_hash(),
        config=cfg.model_dump(mode="json"),
        metrics_line=sum(1 for _ in open(metrics)) if metrics.exists() else 0,  # where this life's records begin
    )
    if restored is not None:
        line.update(
            from_member=restored["member"],
            from_hyperparameters=restored["hyperparameters"],
            updates=restored["updates"],
            env_steps=restored["env_steps"],
        )
    with open(run_dir / LINEAGE, "a") as f:
        f.write(json.dumps(line) + "\n")


def read_lineage(run_dir: str | Path) -> list[dict]:
    """A member's lives, oldest first."""
    with open(Path(run_dir) / LINEAGE) as f:
        return [json.loads(line) for line in f]


def write_result(out: Path, cfg, population: int, wall_s: float) -> TuneResult:
    """Find the member checkpoint with the best validation return, lay it out in OUT as an ordinary run
    directory, and write OUT/tune.json."""
    members, best = [], None
    for run_dir in sorted((out / MEMBERS_DIR).glob("*/")):
        lives = read_lineage(run_dir)
        path = best_checkpoint(run_dir)
        kept = read_checkpoint(path) if path else None
        score = kept["selection"]["validation_return"] if kept else None
        metrics = run_dir / "metrics.jsonl"  # absent when the member never finished an update
        last_steps = [json.loads(line)["env_steps"] for line in open(metrics)][-1:] if metrics.exists() else []
        members.append(
            MemberSummary(
                member=run_dir.name,
                hyperparameters=lives[-1]["hyperparameters"],
                best_validation_return=score,
                env_steps=last_steps[0] if last_steps else 0,
                exploits=sum(life["event"] == "exploit" for life in lives),
                resumes=sum(life["event"] == "resume" for life in lives),
            )
        )
        if kept is not None and (best is None or score > best[2]["selection"]["validation_return"]):
            best = (run_dir, lives, kept)
    result = TuneResult(
        run_dir=str(out),
        algorithm=cfg.train.algorithm,
        population=population,
        perturbations=sum(m.exploits for m in members),
        resumes=sum(m.resumes for m in members),
        best_member=None,
        wall_s=wall_s,
        members=members,
    )
    if best is not None:
        run_dir, lives, kept = best
        # The config the best checkpoint was trained under: the life whose config hash its checkpoint records.
        life = next(life for life in reversed(lives) if life["config_hash"] == kept["config_hash"])
        (out / "config.yaml").write_text(yaml.safe_dump(life["config"], sort_keys=False))
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
        shutil.copytree(run_dir / CHECKPOINT_DIR, out / CHECKPOINT_DIR)
        for name in ("metrics.jsonl", "selection.json"):
            if (run_dir / name).exists():
                shutil.copy2(run_dir / name, out / name)
        result.best_member = run_dir.name
        result.best_hyperparameters = life["hyperparameters"]
        result.best_validation_return = float(kept["selection"]["validation_return"])
        result.best_updates = int(kept["updates"])
    (out / SUMMARY).write_text(json.dumps(result.to_dict(), indent=2))
    return result
