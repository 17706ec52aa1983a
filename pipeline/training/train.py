"""The training driver: starts Ray, the rollout actors and the learner, and runs the loop.

Async (default): each actor always has work queued (at most
`max_batches_in_flight` batches requested and not consumed, back-pressure by
`ray.wait`); the learner consumes batches as they arrive, publishes weights
once per update with `ray.put`, and actors pick the newest up between
batches. Sync (`train.sync`): every actor collects one batch with the current
weights, the learner takes them all in one update (policy lag 0).
`ActorPool` (actor_pool.py) owns the requests in flight and actor restarts.

Validation (`validation`, selection.py): an evaluation actor scores the
deterministic policy on the `validation` domains every K updates; the best
one is kept as checkpoints/best.pt (what export takes), the run can stop
early when it stops improving, and ADR widens the train ranges.

Run directory: config.yaml (resolved config), metrics.jsonl, TensorBoard
events, checkpoints/ckpt_<updates>.pt, checkpoints/best.pt and
selection.json (which checkpoint was selected and why).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Callable

import numpy as np
import ray
import torch
import yaml

from pipeline.training.actor_pool import ActorPool, WeightSource, ray_for_run
from pipeline.training.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from pipeline.training.learner import Learner, learner_threads, resolve_device
from pipeline.training.metrics import MetricsLogger
from pipeline.training.rollout import RolloutActor, make_env, preflight
from pipeline.training.selection import ModelSelection

# final_return = mean return of this many most recent episodes.
FINAL_RETURN_WINDOW = 20


def _with_overrides(cfg, steps, actors, envs_per_actor):
    cfg = cfg.model_copy(deep=True)
    overrides = {"total_env_steps": steps, "num_actors": actors, "envs_per_actor": envs_per_actor}
    for key, value in overrides.items():
        if value is None:
            continue
        try:  # validate_assignment checks the override like the YAML value
            setattr(cfg.train, key, value)
        except ValueError as err:
            reason = err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)
            raise ValueError(f"train.{key}={value!r}: {reason}") from None
    return cfg


def model_spec_for(cfg) -> tuple[dict, object]:
    """(model_spec, train randomization) from one probe env."""
    randomization = cfg.randomization["train"].model_dump(mode="json")
    env = make_env(cfg.task.env_id, randomization, cfg.task.max_episode_steps)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if len(obs_space.shape) != 1 or len(act_space.shape) != 1:
            raise ValueError(f"{cfg.task.env_id}: needs flat Box observations and actions, got "
                             f"{obs_space} and {act_space}")
        spec = dict(obs_dim=obs_space.shape[0], act_dim=act_space.shape[0], hidden_sizes=list(cfg.train.hidden_sizes),
                    action_low=act_space.low.astype(float).tolist(), action_high=act_space.high.astype(float).tolist(),
                    history_length=cfg.train.history_length)
    finally:
        env.close()
    return spec, randomization


def start_run(cfg, out_dir, resume, steps, actors, envs_per_actor) -> tuple:
    """What every training loop does first: (cfg with the overrides, run_dir, checkpoint to resume or None,
    model_spec, train randomization, device). Writes the resolved config.yaml; seeds torch."""
    if resume is not None:
        run_dir = Path(resume)
        ckpt = read_checkpoint(latest_checkpoint(run_dir))
    else:
        run_dir = Path(out_dir) if out_dir else Path("runs") / f"{cfg.task.name}-{datetime.now():%Y%m%d-%H%M%S}"
        ckpt = None
    cfg = _with_overrides(cfg, steps, actors, envs_per_actor)
    preflight(cfg)  # a set or a legacy controller that cannot run fails here, before the run directory exists
    model_spec, randomization = model_spec_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    return cfg, run_dir, ckpt, model_spec, randomization, device


def ray_address_for(cfg, ray_address: str | None) -> str | None:
    """The Ray cluster to join: the argument, else $RAY_ADDRESS, else the config's (None: start one)."""
    return ray_address or os.environ.get("RAY_ADDRESS") or cfg.ray.address


def actor_seed_for(seed: int, updates: int) -> int:
    """The actors' seed: a resumed run seeds them differently so it does not replay its first life's episodes."""
    return int(np.random.SeedSequence([seed, updates]).generate_state(1)[0])


def add_episode_figures(record: dict, episodes: np.ndarray, episodes_total: int, recent_returns: deque) -> None:
    """Episodes finished since the last record, (n, 3) return/cost/length: their means, and the recent return."""
    if len(recent_returns) == FINAL_RETURN_WINDOW:
        record["episode_return_recent"] = float(np.mean(recent_returns))  # last FINAL_RETURN_WINDOW episodes
    if len(episodes):
        record.update(episode_return=float(episodes[:, 0].mean()), episode_cost=float(episodes[:, 1].mean()),
                      episode_length=float(episodes[:, 2].mean()), episodes=episodes_total)


class _Publisher:
    """Puts the learner's weights into the object store once per update and tells the WeightSource."""

    def __init__(self, learner: Learner, weight_source):
        self.learner, self.weight_source, self.latest, self.weights = learner, weight_source, None, None

    def publish(self) -> tuple[int, list]:
        self.weights = self.learner.cpu_weights()  # kept: validation evaluates (and best.pt stores) these
        ref = ray.put(self.weights)
        self.latest = (self.learner.version, [ref])  # the driver owns the ref; keeping it keeps it alive
        self.weight_source.publish.remote(*self.latest)
        return self.latest


def train(cfg, *, out_dir=None, steps=None, actors=None, envs_per_actor=None, ray_address=None, resume=None,
          progress=True, callback: Callable[[dict], None] | None = None) -> dict:
    """Train the task's policy; returns run_dir, env_steps, updates, final_return, wall_s (+ throughput).

    `steps` is the total env-step budget of the run (a resumed run counts the steps
    it already has). `callback(state)` is called once before the first update and
    after every update with dict(updates, env_steps, learner, actors, metrics); when
    it returns True the run stops early (e.g. a return threshold was reached), with
    a final checkpoint as usual.
    """
    if cfg.train.algorithm == "sac":  # off-policy (Ape-X) loop: pipeline/training/offpolicy.py
        from pipeline.training.offpolicy import train_offpolicy

        return train_offpolicy(cfg, out_dir=out_dir, steps=steps, actors=actors, envs_per_actor=envs_per_actor,
                               ray_address=ray_address, resume=resume, progress=progress, callback=callback)
    start_wall = time.perf_counter()
    cfg, run_dir, ckpt, model_spec, randomization, device = start_run(cfg, out_dir, resume, steps, actors, envs_per_actor)
    tc = cfg.train
    learner = Learner(model_spec, tc, device, log_std_init=tc.log_std_init)
    updates, env_steps, episodes_total, prior_wall = 0, 0, 0, 0.0
    if ckpt is not None:
        if ckpt["model_spec"] != model_spec:
            raise ValueError(f"cannot resume {run_dir}: its model {ckpt['model_spec']} differs from the config's {model_spec}")
        learner.load_state_dict(ckpt["learner"])
        torch.set_rng_state(ckpt["torch_rng_state"])
        updates, env_steps = int(ckpt["updates"]), int(ckpt["env_steps"])
        episodes_total, prior_wall = int(ckpt["episodes"]), float(ckpt["wall_s"])

    actor_cpus = tc.num_actors * cfg.ray.actor_num_cpus
    with learner_threads(device, actor_cpus), ray_for_run(ray_address_for(cfg, ray_address), actor_cpus):
        # Start-up order (on 2 cores the first batch came ~1.5 s sooner): nothing waits for the
        # weight source to boot (it imports only Ray; a named actor is registered when `.remote()`
        # returns, so the rollout actors find it by name), and the rollout actors (the slowest to
        # boot: torch, MuJoCo, their envs) are created before the validation actor.
        weight_source_name = f"sim2real-weights-{uuid.uuid4().hex[:12]}"
        selection = None
        if cfg.validation.enabled:
            selection = ModelSelection(cfg, run_dir, model_spec, _shield_in_loop(cfg), dict(
                env_id=cfg.task.env_id, task=cfg.task.name, config_hash=cfg.config_hash()))
            randomization = selection.train_randomization()  # ADR: the narrow start
        actor_seed = actor_seed_for(tc.seed, updates)
        weight_source = ray.remote(num_cpus=0)(WeightSource).options(name=weight_source_name).remote()
        actor_cls = ray.remote(RolloutActor).options(num_cpus=cfg.ray.actor_num_cpus,
                                                     max_restarts=cfg.ray.max_actor_restarts, max_task_retries=0)
        rollout_actors = [actor_cls.remote(i, cfg.task.env_id, randomization, cfg.task.max_episode_steps,
                                           tc.envs_per_actor, tc.rollout_length, actor_seed, model_spec, weight_source_name,
                                           shield=_shield_in_loop(cfg))
                          for i in range(tc.num_actors)]
        if selection is not None:
            selection.start()
        publisher = _Publisher(learner, weight_source)
        publisher.publish()
        ray.get(weight_source.latest.remote())  # published before the first batch is asked for
        pool = ActorPool(rollout_actors, tc.max_batches_in_flight)
        logger = MetricsLogger(run_dir, tc.total_env_steps, env_steps, progress)

        def checkpoint() -> None:
            # learner.version, not `updates`: after an interrupt they can differ and the weights are the truth.
            write_checkpoint(run_dir, learner.version, dict(
                learner=learner.state_dict(), model=learner.cpu_weights(), model_spec=model_spec,
                updates=learner.version, env_steps=env_steps, episodes=episodes_total, wall_s=prior_wall + time.perf_counter() - start_wall,
                torch_rng_state=torch.get_rng_state(), env_id=cfg.task.env_id, task=cfg.task.name,
                config_hash=cfg.config_hash()))

        recent_returns: deque[float] = deque(maxlen=FINAL_RETURN_WINDOW)
        env_restarts_of = [0] * len(rollout_actors)
        learner_time, loop_start, steps_at_start = 0.0, time.perf_counter(), env_steps
        rate_window: deque[tuple[float, int]] = deque(maxlen=20)

        try:
            if callback:
                callback(dict(updates=updates, env_steps=env_steps, learner=learner, actors=rollout_actors, metrics={}))
            if not tc.sync:
                pool.start()
            record = None  # the last metrics record
            while env_steps < tc.total_env_steps:
                batches = pool.collect_all(publisher.latest) if tc.sync else pool.collect(tc.batches_per_update)
                for batch in batches:
                    env_steps += batch["rewards"].size
                    env_restarts_of[batch["actor"]] = batch["env_restarts"]
                lags = [learner.version - b["version"] for b in batches]
                episodes = np.concatenate([b["episodes"] for b in batches])
                episodes_total += len(episodes)
                recent_returns.extend(episodes[:, 0].tolist())

                learner.set_progress(env_steps / tc.total_env_steps)
                stats = learner.update(batches)
                learner_time += stats["learner_s"]
                updates += 1
                publisher.publish()

                now = time.perf_counter()
                elapsed = now - loop_start
                rate_window.append((now, env_steps))
                window_s = now - rate_window[0][0]
                record = dict(updates=updates, env_steps=env_steps,
                              env_steps_per_s=(env_steps - rate_window[0][1]) / window_s if window_s > 0 else 0.0,
                              learner_samples_per_s=stats["samples"] / stats["learner_s"],
                              learner_utilization=learner_time / elapsed,
                              policy_lag_mean=float(np.mean(lags)), policy_lag_max=int(max(lags)),
                              actor_restarts=pool.restarts, env_restarts=int(sum(env_restarts_of)),
                              **{k: v for k, v in stats.items() if k not in ("samples", "learner_s")})
                add_episode_figures(record, episodes, episodes_total, recent_returns)
                if selection is not None:
                    _note_validation(record, selection.after_update(updates, env_steps, learner.version, publisher.weights),
                                     selection, rollout_actors)
                logger.log(record)
                if updates % tc.checkpoint_every == 0:
                    checkpoint()
                if callback and callback(dict(updates=updates, env_steps=env_steps, learner=learner,
                                              actors=rollout_actors, metrics=record)):
                    break
                if selection is not None and selection.stop_reason:
                    print(f"sim2real train: stopping early at update {updates}: {selection.stop_reason}", file=sys.stderr)
                    break
            if pool.settle() and record is not None:  # actors Ray restarted after their last batch: the last record says so
                logger.log(dict(record, actor_restarts=pool.restarts))
            checkpoint()
            if selection is not None:
                # The final weights compete too; their score goes to selection.json (metrics.jsonl keeps one row per update).
                selection.after_update(updates, env_steps, learner.version, publisher.weights, final=True)
                (run_dir / "selection.json").write_text(json.dumps(selection.summary(), indent=2))
        except KeyboardInterrupt:
            checkpoint()  # Ctrl-C keeps the work done so far: `--resume RUN_DIR` continues from here
            raise
        finally:
            logger.close()
            pool.kill_all()
            if selection is not None:
                selection.close()
            ray.kill(weight_source)

    wall_s = time.perf_counter() - start_wall
    final_return = float(np.mean(recent_returns)) if recent_returns else None
    summary = selection.summary() if selection is not None else None
    return dict(run_dir=str(run_dir), env_steps=env_steps, updates=updates, final_return=final_return,
                wall_s=wall_s, env_steps_per_s=(env_steps - steps_at_start) / (time.perf_counter() - loop_start),
                learner_utilization=learner_time / (time.perf_counter() - loop_start), actor_restarts=pool.restarts,
                best_updates=summary["best"]["updates"] if summary and summary["best"] else None,
                best_validation_return=summary["best"]["validation_return"] if summary and summary["best"] else None,
                stopped_early=summary["stopped_early"] if summary else None,
                adr_fraction=summary["adr"]["fraction"] if summary and summary["adr"] else None)


def _note_validation(record: dict, results: list[dict], selection: ModelSelection, actors: list) -> None:
    """Fold finished validation results into this update's metrics; push widened ADR ranges to the actors."""
    for result in results:
        record.update({k: v for k, v in result.items() if k.startswith("validation_")})
        record["validation_best"] = selection.best["validation_return"]
        if selection.adr.enabled:
            record["adr_fraction"] = selection.adr_fraction
        if result.get("adr_widen") and actors:
            widened = selection.train_randomization()
            for actor in actors:
                actor.set_randomization.remote(widened)


def _shield_in_loop(cfg) -> dict | None:
    """The shield the actors' envs apply when training with it in the loop (`shield.train_in_loop`)."""
    if not (cfg.shield.enabled and cfg.shield.train_in_loop):
        return None
    from pipeline.safety.shield_spec import build_shield_spec

    spec = build_shield_spec(cfg)
    if cfg.shield.train_margin is not None:  # train (and select) to keep a wider clearance than the deployed shield's
        spec["margin"] = float(cfg.shield.train_margin)
    return {"spec": spec, "intervention_penalty": cfg.shield.intervention_penalty}
