"""An adaptive policy, RMA-style: a privileged teacher distilled into a history policy (`train.adaptive`).

1. Teacher: the run's on-policy algorithm (onpolicy.py, unchanged) trained on observations with the
   episode's sampled domain parameters appended (`envs.wrappers.PrivilegedObservation`: masses, damping,
   gains and latency normalized to [-1, 1] over the train ranges). Sim-only: no plant reports them.
2. Student: today's history-policy network (observation + the last H (observation, sent action) pairs,
   `PolicyInputs`' layout), trained by DAgger: the student drives the rollouts (the existing
   `RolloutActor`, with a little exploration noise), every state it visits is labelled with the
   teacher's mean action, and the student regresses those labels on everything gathered so far. The
   student must find the plant in its history, because only the labels know it. A second head of the
   student regresses the sampled parameters themselves from the same input (the teacher's privileged
   vector is the label): exported as `plant_estimate`, it shows the operator which plant the policy
   believes it is on (the edge's estimate request, Prometheus). It shares no weights with the actions. Once
   the student is chosen, its estimate is recalibrated on fresh rollouts and scored on others
   (`calibrate_estimate`, estimate.json): export bakes the recalibration in and the contract carries the score.
3. Selection: the student is validated like any policy (`ModelSelection`: checkpoints/best.pt,
   selection.json), and its checkpoints are APPO-shaped history policies, so export, eval and shadow
   take it unchanged. The teacher's own run stays in `teacher/` under the run directory.

Distillation runs in the driver's process, one vector of envs: each step is a small regression on
a few hundred labelled states, far too little work to pay for shipping weights and batches through
Ray; the validation actor still evaluates on the side.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import yaml

from envs.wrappers import domain_encoding
from pipeline.training.actor_pool import ray_for_run
from pipeline.training.algorithms import algorithm
from pipeline.training.checkpoint import write_checkpoint
from pipeline.training.learner import learner_threads, resolve_device
from pipeline.training.metrics import MetricsLogger
from pipeline.training.model import ActorCritic
from pipeline.training.policy import load_policy
from pipeline.training.rollout import RolloutActor
from pipeline.training.scaffold import (
    FINAL_RETURN_WINDOW,
    TrainResult,
    actor_seed_for,
    final_return_of,
    model_spec_for,
    ray_address_for,
    shield_in_loop,
    with_overrides,
)
from pipeline.training.selection import ModelSelection, run_identity, selection_figures

MINIBATCH = 256  # labelled states per Adam step of the student
# The chosen student's plant estimate recalibrated on fresh states, and how well it did on others (export reads it).
ESTIMATE_SKILL_FILE = "estimate.json"


# The chosen student's estimate is recalibrated and scored on fresh episodes: this many plants (half to fit, half to
# score), or as many as this many states hold. With a few dozen plants the two halves' mean parameters differ by
# chance enough to score a head that sees nothing far below 0; with 128 a side, by about 0.02.
CALIBRATION_PLANTS = 256
CALIBRATION_MAX_STATES = 131_072


def calibrate_estimate(student: ActorCritic, x: np.ndarray, encoded: np.ndarray, episode: np.ndarray, names) -> dict:
    """Recalibrate the estimate head on fresh states and score it on others: {"states", "plants", "parameters":
    [{name, offset, scale, held_out_r2}]}.

    A regression head fitted on a few hundred episodes' plants overfits them: on new plants its raw estimate of a
    parameter the history hardly reveals can be worse than the middle of the range. Per parameter, the line
    truth ~ offset + scale * estimate is fitted per state on the even-numbered episodes and scored per state on the
    odd ones, as R^2 (1 exact; 0 the truths' mean; below 0 worse). The slope is kept only where the plants say it is
    positive and clear of chance (t > 2 over the fit episodes' mean estimates against their truths: the states of
    one episode share one truth, so only the plants are independent draws), else 0: a parameter the head cannot
    see then gets the fit states' mean, whatever the head says. `episode`: each state's episode id; `encoded`: its
    parameters in [-1, 1]."""
    with torch.no_grad():
        raw = student.encoded_estimate(torch.from_numpy(x)).clamp(-1.0, 1.0).numpy().astype(np.float64)
    truth = encoded.astype(np.float64)
    plants, first = np.unique(episode, return_index=True)
    fit_plant = plants % 2 == 0
    fit, score = episode % 2 == 0, episode % 2 == 1
    members = np.searchsorted(plants, episode)  # each state's plant index
    count = np.bincount(members)
    out = []
    for k, name in enumerate(names):
        g = (np.bincount(members, weights=raw[:, k]) / count)[fit_plant]  # each fit plant's mean estimate
        y = truth[first, k][fit_plant]  # and its truth
        gs, ys = raw[fit, k], truth[fit, k]
        scale, offset = 0.0, float(ys.mean()) if len(ys) else 0.0
        if len(y) >= 4 and np.var(g) > 1e-12 and np.var(y) > 1e-12 and np.var(gs) > 1e-12:
            r = float(np.corrcoef(g, y)[0, 1])
            if r > 0 and r * math.sqrt(len(y) - 2) / math.sqrt(max(1e-12, 1 - r * r)) > 2.0:
                # The slope per state (the estimate is applied per state, noise within an episode and all); whether
                # there is one at all is judged over the plants, the independent draws.
                scale = max(0.0, float(np.cov(gs, ys, bias=True)[0, 1] / np.var(gs)))
                offset = float(ys.mean() - scale * gs.mean())
        y2 = truth[score, k]
        guess = np.clip(offset + scale * raw[score, k], -1.0, 1.0)
        sst = float(np.sum((y2 - y2.mean()) ** 2))
        r2 = float(1.0 - np.sum((y2 - guess) ** 2) / sst) if sst > 1e-9 * max(len(y2), 1) else None
        out.append({"name": name, "offset": offset, "scale": scale, "held_out_r2": r2})
    return {"states": int(len(x)), "plants": int(len(plants)), "parameters": out}


def episode_ids(privileged: np.ndarray, last: np.ndarray | None, counter: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Episode ids [T * n] (labelled_states' order) of a batch's states from its sampled parameters [T, n, P]: an env
    starts a new episode where its parameters change (a fresh draw). Returns (ids, each env's last (id, params)
    carried to the next batch, the counter)."""
    steps, n = privileged.shape[:2]
    if last is None:
        last = np.full((n, 1 + privileged.shape[2]), np.nan)
    ids = np.empty((steps, n), np.int64)
    for t in range(steps):
        new = np.any(privileged[t] != last[:, 1:], axis=1)
        for e in np.flatnonzero(new):
            counter += 1
            last[e, 0], last[e, 1:] = counter, privileged[t, e]
        ids[t] = last[:, 0]
    return ids.reshape(-1), last, counter


def estimate_calibration(cfg, run_dir: Path, actor: RolloutActor, obs_dim: int) -> dict:
    """`calibrate_estimate` for the checkpoint export will take (the best by validation, else the latest), on the
    fresh episodes of CALIBRATION_PLANTS plants its own rollouts visit (fewer where the state budget runs out);
    records which checkpoint it was."""
    from pipeline.training.checkpoint import best_checkpoint, latest_checkpoint, read_checkpoint

    chosen = best_checkpoint(run_dir) or latest_checkpoint(run_dir)
    ckpt = read_checkpoint(chosen)
    judged = ActorCritic(**ckpt["model_spec"])
    judged.load_state_dict(ckpt["model"])
    actor.set_weights(int(ckpt["updates"]) + 1, ckpt["model"])
    gathered, last, counter = Dataset(), None, 0
    # Enough plants (the halves' means differ by chance less than the scores measure), within a budget of states:
    # twice the distillation's own steps for a short one (a test), CALIBRATION_MAX_STATES at most.
    budget = min(CALIBRATION_MAX_STATES, 2 * cfg.train.adaptive.distill_steps)
    while counter < CALIBRATION_PLANTS and gathered.rows < budget:
        batch = actor.rollout()
        x, teacher_in = labelled_states(batch, obs_dim)
        ids, last, counter = episode_ids(batch["privileged"][:-1], last, counter)
        xs, params, episodes = gathered.extend(x, teacher_in[:, obs_dim:], ids)
    names = [e[0] for e in judged.estimates]
    result = calibrate_estimate(judged, xs, params, episodes, names)
    return {"checkpoint": Path(chosen).name, **result}


def train_adaptive(
    cfg,
    *,
    out_dir=None,
    steps=None,
    actors=None,
    envs_per_actor=None,
    ray_address=None,
    resume=None,
    progress=True,
    callback=None,
) -> TrainResult:
    """Teacher, then student (module docstring); `train.train` documents the arguments. `callback` sees the
    teacher's updates only (the distillation is no learner update)."""
    if resume is not None:
        raise ValueError("train.adaptive: --resume is not supported for an adaptive run; start it again")
    start_wall = time.perf_counter()
    cfg = with_overrides(cfg, steps, actors, envs_per_actor)
    tc, ac = cfg.train, cfg.train.adaptive
    run_dir = Path(out_dir) if out_dir else Path("runs") / f"{cfg.task.name}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    privileged = cfg.randomization["train"].model_dump(mode="json")  # the teacher's parameters, over these ranges

    teacher_cfg = cfg.model_copy(deep=True)
    teacher_cfg.train.adaptive = None
    teacher_cfg.train.total_env_steps = tc.total_env_steps - ac.distill_steps
    actor_cpus = tc.num_actors * cfg.ray.actor_num_cpus
    with ray_for_run(ray_address_for(cfg, ray_address), actor_cpus):
        teacher_result = algorithm(tc.algorithm).train(
            teacher_cfg, out_dir=run_dir / "teacher", progress=progress, callback=callback, privileged=privileged
        )
        teacher, _ = load_policy(run_dir / "teacher")
        with learner_threads(resolve_device("cpu"), 1):
            student, selection, figures = distill(cfg, run_dir, teacher, privileged, progress)

    env_steps = teacher_result.env_steps + figures["env_steps"]
    return TrainResult(
        run_dir=str(run_dir),
        algorithm=tc.algorithm,
        env_steps=env_steps,
        updates=figures["iterations"],
        final_return=figures["final_return"],
        wall_s=time.perf_counter() - start_wall,
        env_steps_per_s=env_steps / (time.perf_counter() - start_wall),
        learner_utilization=teacher_result.learner_utilization,
        actor_restarts=teacher_result.actor_restarts,
        **selection_figures(selection),
    )


def distill(cfg, run_dir: Path, teacher: torch.nn.Module, privileged: dict, progress: bool = True):
    """DAgger: the student collects states, the teacher labels them, the student regresses the labels.

    Returns (student, ModelSelection or None, figures); writes the student's checkpoints into `run_dir`.
    """
    tc, ac = cfg.train, cfg.train.adaptive
    start = time.perf_counter()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    spec, train_set = model_spec_for(cfg, ac.history_length)
    spec["estimates"] = [list(e) for e in domain_encoding(privileged)]
    torch.manual_seed(tc.seed)
    student = ActorCritic(**spec, log_std_init=math.log(max(ac.action_noise, 1e-6)))
    heads = [*student.pi.parameters(), *(student.estimate.parameters() if student.estimate is not None else ())]
    optimizer = torch.optim.Adam(heads, lr=ac.distill_lr)
    rng = np.random.default_rng(np.random.SeedSequence([tc.seed, 1]))
    shield = shield_in_loop(cfg)
    actor = RolloutActor(
        0,
        cfg.task.env_id,
        train_set,
        cfg.task.max_episode_steps,
        tc.num_actors * tc.envs_per_actor,
        tc.rollout_length,
        actor_seed_for(tc.seed, 1),  # not the teacher's actors' seeds: fresh episodes
        spec,
        shield=shield,
        privileged=privileged,
    )
    meta = run_identity(cfg)
    selection = None
    if cfg.validation.enabled:
        selection_cfg = cfg.model_copy(deep=True)
        selection_cfg.train.adr.enabled = False  # the student learns on the declared train set
        selection = ModelSelection(selection_cfg, run_dir, spec, shield, meta)
        selection.start()
    logger = MetricsLogger(run_dir, ac.distill_steps, spec["act_dim"], 0, progress)
    dataset = Dataset()
    recent: deque[float] = deque(maxlen=FINAL_RETURN_WINDOW)
    env_steps, iteration = 0, 0
    obs_dim = spec["obs_dim"]
    try:
        while env_steps < ac.distill_steps:
            actor.set_weights(iteration, student.state_dict())
            batch = actor.rollout()
            x, teacher_in = labelled_states(batch, obs_dim)
            with torch.no_grad():
                label = teacher(torch.from_numpy(teacher_in)).numpy()
            env_steps += len(x)
            iteration += 1
            recent.extend(batch["episodes"][:, 0].tolist())
            student.obs_rms.update(torch.from_numpy(x))
            inputs, labels, params = dataset.extend(x, label, teacher_in[:, obs_dim:])
            loss, estimate_loss = regress(student, optimizer, inputs, labels, ac.distill_epochs, rng, params)
            record = dict(updates=iteration, env_steps=env_steps, distill_loss=loss, dataset=dataset.rows)
            if estimate_loss is not None:
                record["estimate_loss"] = estimate_loss
            if len(batch["episodes"]):
                record["episode_return"] = float(batch["episodes"][:, 0].mean())
            if selection is not None:
                weights = {k: v.clone() for k, v in student.state_dict().items()}
                selection.note(record, selection.after_update(iteration, env_steps, iteration, weights), [])
                if selection.stop_reason:
                    break
            logger.log(record)
        weights = {k: v.clone() for k, v in student.state_dict().items()}
        if selection is not None:
            selection.after_update(iteration, env_steps, iteration, weights, final=True)
            (run_dir / "selection.json").write_text(json.dumps(selection.summary(), indent=2))
        write_checkpoint(
            run_dir,
            iteration,
            dict(
                model=weights,
                model_spec=spec,
                updates=iteration,
                env_steps=env_steps,
                episodes=len(recent),
                wall_s=time.perf_counter() - start,
                **meta,
            ),
        )
        if student.estimate is not None:
            calibration = estimate_calibration(cfg, Path(run_dir), actor, obs_dim)
            (Path(run_dir) / ESTIMATE_SKILL_FILE).write_text(json.dumps(calibration, indent=2))
    finally:
        logger.close()
        if selection is not None:
            selection.close()
    return student, selection, dict(env_steps=env_steps, iterations=iteration, final_return=final_return_of(recent))


class Dataset:
    """DAgger's aggregated dataset: each round appends rows to every array, and the arrays double when full, so a
    round copies its own rows rather than everything gathered so far."""

    def __init__(self):
        self.arrays: list[np.ndarray] = []
        self.rows = 0

    def extend(self, *rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """Append one batch (the same number of rows in each array); returns views of every row so far."""
        n = len(rows[0])
        if not self.arrays:
            self.arrays = [np.empty((max(n, 1) * 8, *r.shape[1:]), r.dtype) for r in rows]
        if self.rows + n > len(self.arrays[0]):
            size = max(2 * len(self.arrays[0]), self.rows + n)
            self.arrays = [
                np.concatenate([a[: self.rows], np.empty((size - self.rows, *a.shape[1:]), a.dtype)])
                for a in self.arrays
            ]
        for a, r in zip(self.arrays, rows, strict=True):
            a[self.rows : self.rows + n] = r
        self.rows += n
        return tuple(a[: self.rows] for a in self.arrays)


def labelled_states(batch: dict, obs_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A rollout batch's visited states as (student inputs [n, input_dim], teacher inputs [n, obs_dim + P]):
    the same observations, the student's with its history, the teacher's with the sampled parameters."""
    x = batch["obs"][:-1].reshape(-1, batch["obs"].shape[-1])
    return x, np.concatenate([x[:, :obs_dim], batch["privileged"][:-1].reshape(len(x), -1)], axis=1)


def regress(
    student: ActorCritic,
    optimizer: torch.optim.Optimizer,
    x: np.ndarray,
    label: np.ndarray,
    epochs: int,
    rng: np.random.Generator,
    params: np.ndarray | None = None,
) -> tuple[float, float | None]:
    """Adam steps on the squared error between the student's mean action and the teacher's, over minibatches
    drawn from the whole aggregated dataset (DAgger keeps every state visited so far), plus, where the student
    has an estimate head, its squared error against the episode's encoded parameters `params` [n, P] (the heads
    share no weights, so the sum trains each on its own error); returns the last (action loss, estimate loss)."""
    new = min(len(x), MINIBATCH * 4)  # about as many draws per round as the newest batch brought
    loss, estimate_loss = torch.zeros(()), None
    estimating = student.estimate is not None and params is not None
    for _ in range(epochs * max(1, new // MINIBATCH)):
        idx = rng.integers(0, len(x), MINIBATCH)
        inputs = torch.from_numpy(x[idx])
        if estimating:
            mean, estimate = student.mean_and_estimate(inputs)
            estimate_loss = torch.mean((estimate - torch.from_numpy(params[idx])) ** 2)
        else:
            mean = student(inputs)[0]
        loss = torch.mean((mean - torch.from_numpy(label[idx])) ** 2)
        total = loss if estimate_loss is None else loss + estimate_loss
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    return float(loss.detach()), None if estimate_loss is None else float(estimate_loss.detach())


def action_error(student: torch.nn.Module, teacher: torch.nn.Module, batch: dict, obs_dim: int) -> float:
    """Mean squared difference of the two deterministic policies' actions on a rollout batch's states."""
    x, teacher_in = labelled_states(batch, obs_dim)
    with torch.no_grad():
        hist = torch.from_numpy(x[:, obs_dim:]).reshape(len(x), student.history_length, -1)
        a_s = student(torch.from_numpy(x[:, :obs_dim]), hist)
        a_t = teacher(torch.from_numpy(teacher_in))
    return float(torch.mean((a_s - a_t) ** 2))
