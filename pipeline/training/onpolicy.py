"""The on-policy loop (IMPALA, APPO): Ray rollout actors, a V-trace learner, validation-based selection.

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
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable

import numpy as np
import ray
import torch

from pipeline.training.actor_pool import ActorPool, WeightSource, ray_for_run
from pipeline.training.learner import Learner, PolicyLoss, learner_threads
from pipeline.training.metrics import MetricsLogger
from pipeline.training.rollout import RolloutActor
from pipeline.training.scaffold import (
    FINAL_RETURN_WINDOW,
    TrainResult,
    WeightPublisher,
    actor_seed_for,
    add_episode_figures,
    entropy_figures,
    final_return_of,
    ray_address_for,
    shield_in_loop,
    start_run,
    write_run_checkpoint,
)
from pipeline.training.selection import ModelSelection, run_identity, selection_figures


def train_vtrace(
    cfg,
    *,
    policy_loss: PolicyLoss,
    out_dir=None,
    steps=None,
    actors=None,
    envs_per_actor=None,
    ray_address=None,
    resume=None,
    progress=True,
    callback: Callable[[dict], bool] | None = None,
    privileged=None,
) -> TrainResult:
    """Train with V-trace and `policy_loss` (IMPALA's or APPO's); `train.train` documents the arguments.

    `privileged` (a randomization set: the ranges to normalize over) trains a sim-only teacher that also
    sees each episode's sampled domain parameters (adaptive.py distills it into a deployable student).

    `callback(state)` is called once before the first update and after every update with
    dict(updates, env_steps, learner, actors, metrics).
    """
    start_wall = time.perf_counter()
    cfg, run_dir, ckpt, model_spec, randomization, device = start_run(
        cfg, out_dir, resume, steps, actors, envs_per_actor, cfg.train.history_length, privileged
    )
    tc = cfg.train
    learner = Learner(model_spec, tc, device, policy_loss, log_std_init=tc.log_std_init)
    updates, env_steps, episodes_total, prior_wall = 0, 0, 0, 0.0
    if ckpt is not None:
        learner.load_state_dict(ckpt["learner"])
        torch.set_rng_state(ckpt["torch_rng_state"])
        updates, env_steps = int(ckpt["updates"]), int(ckpt["env_steps"])
        episodes_total, prior_wall = int(ckpt["episodes"]), float(ckpt["wall_s"])

    actor_cpus = tc.num_actors * cfg.ray.actor_num_cpus
    with learner_threads(device, actor_cpus), ray_for_run(ray_address_for(cfg, ray_address), actor_cpus):
        # Start-up order, so the first batch comes as soon as it can: nothing waits for the weight
        # source to boot (it imports only Ray; a named actor is registered when `.remote()` returns,
        # so the rollout actors find it by name), and the rollout actors (the slowest to boot: torch,
        # MuJoCo, their envs) are created before the validation actor.
        weight_source_name = f"sim2real-weights-{uuid.uuid4().hex[:12]}"
        selection = None
        if cfg.validation.enabled:
            selection = ModelSelection(
                cfg,
                run_dir,
                model_spec,
                shield_in_loop(cfg),
                run_identity(cfg),
                privileged,
            )
            randomization = selection.train_randomization()  # ADR: the narrow start
        actor_seed = actor_seed_for(tc.seed, updates)
        weight_source = ray.remote(num_cpus=0)(WeightSource).options(name=weight_source_name).remote()
        actor_cls = ray.remote(RolloutActor).options(
            num_cpus=cfg.ray.actor_num_cpus, max_restarts=cfg.ray.max_actor_restarts, max_task_retries=0
        )
        rollout_actors = [
            actor_cls.remote(
                i,
                cfg.task.env_id,
                randomization,
                cfg.task.max_episode_steps,
                tc.envs_per_actor,
                tc.rollout_length,
                actor_seed,
                model_spec,
                weight_source_name,
                shield=shield_in_loop(cfg),
                privileged=privileged,
            )
            for i in range(tc.num_actors)
        ]
        if selection is not None:
            selection.start()
        publisher = WeightPublisher(learner, weight_source)
        publisher.publish()
        ray.get(weight_source.latest.remote())  # published before the first batch is asked for
        pool = ActorPool(rollout_actors, tc.max_batches_in_flight)
        logger = MetricsLogger(run_dir, tc.total_env_steps, model_spec["act_dim"], env_steps, progress)

        def checkpoint() -> None:
            wall_s = prior_wall + time.perf_counter() - start_wall
            write_run_checkpoint(
                run_dir, cfg, learner, model_spec, env_steps=env_steps, episodes=episodes_total, wall_s=wall_s
            )

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
                record = dict(
                    updates=updates,
                    env_steps=env_steps,
                    env_steps_per_s=(env_steps - rate_window[0][1]) / window_s if window_s > 0 else 0.0,
                    learner_samples_per_s=stats["samples"] / stats["learner_s"],
                    learner_utilization=learner_time / elapsed,
                    policy_lag_mean=float(np.mean(lags)),
                    policy_lag_max=int(max(lags)),
                    actor_restarts=pool.restarts,
                    env_restarts=int(sum(env_restarts_of)),
                    **{k: v for k, v in stats.items() if k not in ("samples", "learner_s")},
                )
                add_episode_figures(record, episodes, episodes_total, recent_returns)
                if selection is not None:
                    selection.note(
                        record,
                        selection.after_update(updates, env_steps, learner.version, publisher.weights),
                        rollout_actors,
                    )
                logger.log(record)
                if updates % tc.checkpoint_every == 0:
                    checkpoint()
                if callback and callback(
                    dict(updates=updates, env_steps=env_steps, learner=learner, actors=rollout_actors, metrics=record)
                ):
                    break
                if selection is not None and selection.stop_reason:
                    print(
                        f"sim2real train: stopping early at update {updates}: {selection.stop_reason}", file=sys.stderr
                    )
                    break
            if (
                pool.settle() and record is not None
            ):  # actors Ray restarted after their last batch: the last record says so
                logger.log(dict(record, actor_restarts=pool.restarts))
            checkpoint()
            if selection is not None:
                # The final weights compete too; their score goes to selection.json (metrics.jsonl keeps one row per
                # update).
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

    loop_s = time.perf_counter() - loop_start
    return TrainResult(
        run_dir=str(run_dir),
        algorithm=tc.algorithm,
        env_steps=env_steps,
        updates=updates,
        final_return=final_return_of(recent_returns),
        wall_s=time.perf_counter() - start_wall,
        env_steps_per_s=(env_steps - steps_at_start) / loop_s,
        learner_utilization=learner_time / loop_s,
        actor_restarts=pool.restarts,
        **entropy_figures(record, model_spec["act_dim"]),
        **selection_figures(selection),
    )
