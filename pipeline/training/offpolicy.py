"""The off-policy (Ape-X) loop: an off-policy learner (SAC, TD3), sharded prioritized replay, exploring actors.

Data flow: each `ExploringActor` steps its envs with the newest published
policy plus its own exploration noise level, turns the steps into n-step
transitions and inserts them, one batch per request, straight into its replay
shard (the next one when that shard is down). The driver only sees small
reports (steps, episodes, the actor's life). The learner, in the driver,
samples prioritized minibatches from all shards (one request per shard kept in
flight, so sampling overlaps learning), takes a learner step with the importance
weights and sends the new priorities back without waiting. It learns while
learned transitions < replay_ratio x collected ones and otherwise waits for
the actors, whose requests in flight are bounded (`max_batches_in_flight`), so
the measured replay ratio follows the configured one whichever side is slower.

Fault tolerance: actors and shards are Ray actors with restarts, spread over
the cluster's nodes (SPREAD); the weight source stays on the driver's node.
A restarted shard comes back empty: its restart and the transitions it held
are counted (`shard_restarts`, `transitions_lost`). Checkpoints hold the
learner, counters and (with replay.checkpoint) a snapshot of every shard.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.training.actor_pool import ActorPool, WeightSource, ray_for_run
from pipeline.training.learner import learner_threads
from pipeline.training.metrics import MetricsLogger
from pipeline.training.replay import NStepBuilder, ReplayClient, ReplayShard, load_snapshot, save_snapshot
from pipeline.training.rollout import RolloutActor
from pipeline.training.sac import SquashedGaussianActor, policy_from_checkpoint
from pipeline.training.scaffold import (
    FINAL_RETURN_WINDOW,
    ReplayFigures,
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

REPLAY_DIR = "replay"


def exploration_levels(base: float, alpha: float, num_actors: int) -> list[float]:
    """Ape-X: actor i explores with base^(1 + alpha * i / (N - 1)); one actor gets `base`."""
    if num_actors == 1:
        return [base]
    return [base ** (1 + alpha * i / (num_actors - 1)) for i in range(num_actors)]


class ExploringActor(RolloutActor):
    """A rollout actor that explores at its own level and inserts n-step transitions into replay."""

    def __init__(
        self,
        index,
        env_id,
        randomization,
        max_episode_steps,
        num_envs,
        chunk_steps,
        seed,
        model_spec,
        weight_source,
        shard_names,
        noise_std,
        n_step,
        gamma,
        stochastic,
        shield=None,
    ):
        super().__init__(
            index,
            env_id,
            randomization,
            max_episode_steps,
            num_envs,
            chunk_steps,
            seed,
            model_spec,
            weight_source,
            shield,
        )
        self.model = SquashedGaussianActor(**model_spec).eval()
        self.stochastic = bool(stochastic)  # sample the policy (SAC), or act on its mean (TD3: the noise explores)
        self.noise_std = float(noise_std)
        self.noise_rng = np.random.default_rng(self._seed_seq.spawn(1)[0])
        self.nstep = NStepBuilder(num_envs, n_step, gamma, model_spec["obs_dim"], model_spec["act_dim"])
        # Looked up by name so a restarted actor finds them without handles in its constructor arguments.
        self.shards = [ray.get_actor(name) for name in shard_names]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.lost = 0

    def rollout(self, weights=None) -> dict:
        """Step every env `chunk_steps` times, insert the finished transitions; return a small report."""
        self._refresh_weights(weights)
        M = self.num_envs
        chunks, episodes = [], []
        for _ in range(self.T):
            obs = self.obs.copy()
            with torch.no_grad():
                action, _ = self.model.sample(
                    self.model.normalize(torch.from_numpy(obs)), self.torch_gen, deterministic=not self.stochastic
                )
            action = action.numpy()
            if self.noise_std > 0:
                action = np.clip(action + self.noise_std * self.noise_rng.standard_normal(action.shape), -1, 1)
            env_action = self.model.to_env(action)
            rewards, terminated, truncated = np.zeros(M), np.zeros(M, bool), np.zeros(M, bool)
            next_obs, ok = obs.copy(), np.ones(M, bool)
            for i in range(M):
                try:
                    o, r, term, trunc, info = self.envs[i].step(env_action[i])
                except Exception:  # the broken env's pending transitions go with it
                    self.obs[i], ok[i] = self._recreate(i), False
                    self.nstep.pending[i].clear()
                    continue
                rewards[i], terminated[i], truncated[i], next_obs[i] = r, term, trunc and not term, o
                self.ep_return[i] += r
                self.ep_cost[i] += float(info.get("cost", 0.0))
                self.ep_len[i] += 1
                if term or trunc:
                    episodes.append((float(self.ep_return[i]), float(self.ep_cost[i]), int(self.ep_len[i])))
                    self.ep_return[i] = self.ep_cost[i] = self.ep_len[i] = 0
                    o = self._reset(i)
                self.obs[i] = o
            chunks.append(self.nstep.step(obs, action, rewards, next_obs, terminated, truncated, active=ok))
        batch = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        inserted = self._insert(batch)
        return dict(
            actor=self.index,
            life=self.life,
            reconstructed=self.reconstructed,
            node_id=self.node_id,
            version=self.version,
            steps=self.T * M,
            inserted=inserted,
            lost=self.lost,
            env_restarts=self.env_restarts,
            episodes=np.asarray(episodes, np.float64).reshape(-1, 3),
        )

    def _insert(self, batch: dict) -> int:
        """Into this actor's shard, or the next live one; transitions nobody took are counted as lost."""
        for k in range(len(self.shards)):
            shard = self.shards[(self.index + k) % len(self.shards)]
            try:
                return ray.get(shard.add.remote(batch), timeout=30)
            except (RayActorError, ActorUnavailableError, GetTimeoutError):
                continue
        self.lost += len(batch["reward"])
        return 0


class OffPolicyLearner(Protocol):
    """An off-policy learner behind this loop: one step per prioritized minibatch, new priorities back."""

    stochastic_actor: bool  # whether actors sample the policy (else they act on its mean plus their noise)
    version: int

    def __init__(self, model_spec: dict, settings: Any, gamma: float, device: torch.device) -> None: ...

    def update(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, float], np.ndarray]: ...

    def cpu_weights(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def train_offpolicy(
    cfg,
    *,
    learner_cls: type[OffPolicyLearner],
    settings_of: Callable[[Any], Any],
    out_dir=None,
    steps=None,
    actors=None,
    envs_per_actor=None,
    ray_address=None,
    resume=None,
    progress=True,
    callback: Callable[[dict], bool] | None = None,
) -> TrainResult:
    """Train an off-policy learner; `train.train` documents the arguments. `settings_of(cfg.train)` is the
    learner's section (train.sac, train.td3).

    `callback(state)` is called before the first learner step and after every metrics
    record (every log_every learner steps) with dict(updates, env_steps, learner,
    actors, shards, metrics); returning True stops the run (with a final checkpoint).
    """
    start_wall = time.perf_counter()
    cfg, run_dir, ckpt, model_spec, randomization, device = start_run(
        cfg, out_dir, resume, steps, actors, envs_per_actor
    )
    tc, sc, rc = cfg.train, settings_of(cfg.train), cfg.train.replay
    learner = learner_cls(model_spec, sc, tc.gamma, device)
    env_steps, learned, episodes_total, prior_wall = 0, 0, 0, 0.0
    restarts_before = dict(actor=0, shard=0, lost=0)
    if ckpt is not None:
        learner.load_state_dict(ckpt["learner"])
        torch.set_rng_state(ckpt["torch_rng_state"])
        env_steps, learned = int(ckpt["env_steps"]), int(ckpt["learned_samples"])
        episodes_total, prior_wall = int(ckpt["episodes"]), float(ckpt["wall_s"])
        restarts_before = dict(ckpt["restarts"])

    with (
        learner_threads(device, tc.num_actors * cfg.ray.actor_num_cpus),
        ray_for_run(
            ray_address_for(cfg, ray_address),
            tc.num_actors * cfg.ray.actor_num_cpus + rc.num_shards * rc.shard_num_cpus,
        ),
    ):
        run_id = uuid.uuid4().hex[:12]
        # The weight source stays with the driver: losing another node must not lose it.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        weight_source = (
            ray.remote(num_cpus=0)(WeightSource)
            .options(name=f"sim2real-weights-{run_id}", scheduling_strategy=here)
            .remote()
        )
        publisher = WeightPublisher(learner, weight_source)
        publisher.publish()  # nothing waits for it to boot here (onpolicy.py's start-up order): checked below

        shard_names = [f"sim2real-replay-{run_id}-{k}" for k in range(rc.num_shards)]
        shard_cls = ray.remote(ReplayShard)
        shards = [
            shard_cls.options(
                name=name,
                num_cpus=rc.shard_num_cpus,
                max_restarts=cfg.ray.max_actor_restarts,
                max_task_retries=0,
                scheduling_strategy="SPREAD",
            ).remote(
                k, max(1, rc.capacity // rc.num_shards), model_spec["obs_dim"], model_spec["act_dim"], rc.alpha, tc.seed
            )
            for k, name in enumerate(shard_names)
        ]
        replay = ReplayClient(shards, sc.batch_size, sc.prefetch_batches, tc.seed)
        restored = load_snapshot(run_dir / REPLAY_DIR, shards) if ckpt is not None else 0
        replay.poll()

        updates = learner.version
        actor_seed = actor_seed_for(tc.seed, updates)
        actor_cls = ray.remote(ExploringActor).options(
            num_cpus=cfg.ray.actor_num_cpus,
            max_restarts=cfg.ray.max_actor_restarts,
            max_task_retries=0,
            scheduling_strategy="SPREAD",
        )
        noise = exploration_levels(sc.exploration_noise, sc.exploration_alpha, tc.num_actors)
        exploring_actors = [
            actor_cls.remote(
                i,
                cfg.task.env_id,
                randomization,
                cfg.task.max_episode_steps,
                tc.envs_per_actor,
                tc.rollout_length,
                actor_seed,
                model_spec,
                f"sim2real-weights-{run_id}",
                shard_names,
                noise[i],
                sc.n_step,
                tc.gamma,
                learner_cls.stochastic_actor,
                shield=shield_in_loop(cfg),
            )
            for i in range(tc.num_actors)
        ]
        selection = None
        if cfg.validation.enabled:
            # Evaluated like the on-policy loop's, on what export ships: every off-policy learner acts with a
            # squashed-Gaussian actor's mean. The learner steps once per minibatch, so the cadence counts metrics
            # records (validation.every_updates of them, log_every learner steps each).
            selection = ModelSelection(
                cfg,
                run_dir,
                model_spec,
                shield_in_loop(cfg),
                run_identity(cfg),
                every=cfg.validation.every_updates * sc.log_every,
                deployable=policy_from_checkpoint,
            )
            selection.start()
        ray.get(weight_source.latest.remote())  # published before the first batch is asked for
        pool = ActorPool(exploring_actors, tc.max_batches_in_flight)
        logger = MetricsLogger(run_dir, tc.total_env_steps, model_spec["act_dim"], env_steps, progress)

        lost_by_actor = [0] * tc.num_actors

        def counters() -> dict:
            return dict(
                actor=restarts_before["actor"] + pool.restarts,
                shard=restarts_before["shard"] + replay.restarts,
                lost=restarts_before["lost"] + replay.transitions_lost + sum(lost_by_actor),
            )

        def checkpoint() -> None:
            if rc.checkpoint:
                save_snapshot(run_dir / REPLAY_DIR, shards)
            write_run_checkpoint(
                run_dir,
                cfg,
                learner,
                model_spec,
                env_steps=env_steps,
                episodes=episodes_total,
                wall_s=prior_wall + time.perf_counter() - start_wall,
                learned_samples=learned,
                restarts=counters(),
            )

        recent_returns: deque[float] = deque(maxlen=FINAL_RETURN_WINDOW)
        episodes_since_log: list[np.ndarray] = []
        lags: list[int] = []
        nodes: dict[str, set] = dict(actors=set(), shards=set())
        loop_start, steps_at_start, learned_at_start = time.perf_counter(), env_steps, learned
        learner_time, last_log = 0.0, (time.perf_counter(), env_steps, learned, 0, 0)
        stats: dict = {}
        last_record: dict | None = None

        def log_record() -> dict:
            nonlocal last_log, last_record
            now = time.perf_counter()
            shard_stats = replay.poll()
            nodes["shards"].update(s["node_id"] for s in shard_stats)
            inserted = sum(s["inserted"] for s in shard_stats)
            sampled = sum(s["sampled"] for s in shard_stats)
            t0, steps0, learned0, inserted0, sampled0 = last_log
            dt = max(now - t0, 1e-9)
            c = counters()
            record = dict(
                updates=learner.version,
                env_steps=env_steps,
                env_steps_per_s=(env_steps - steps0) / dt,
                learner_steps_per_s=(learned - learned0) / sc.batch_size / dt,
                learner_utilization=learner_time / max(now - loop_start, 1e-9),
                replay_ratio=learned / max(env_steps, 1),
                replay_ratio_target=sc.replay_ratio,
                replay_size=sum(s["size"] for s in shard_stats),
                replay_shards_up=len(shard_stats),
                replay_insert_per_s=max(0, inserted - inserted0) / dt,
                replay_sample_per_s=max(0, sampled - sampled0) / dt,
                priority_max=max((s["max_priority"] for s in shard_stats), default=0.0),
                priority_mass_total=sum(s["total_mass"] for s in shard_stats),
                policy_lag_mean=float(np.mean(lags)) if lags else 0.0,
                policy_lag_max=max(lags, default=0),
                actor_restarts=c["actor"],
                shard_restarts=c["shard"],
                transitions_lost=c["lost"],
                **{k: v for k, v in stats.items() if k != "learner_s"},
            )
            add_episode_figures(
                record,
                np.concatenate(episodes_since_log) if episodes_since_log else np.zeros((0, 3)),
                episodes_total,
                recent_returns,
            )
            episodes_since_log.clear()
            last_log = (now, env_steps, learned, inserted, sampled)
            lags.clear()
            if selection is not None:
                version = learner.version
                selection.note(record, selection.after_update(version, env_steps, version, learner.cpu_weights()), [])
            logger.log(record)
            last_record = record
            return record

        def state(metrics: dict) -> dict:
            return dict(
                updates=learner.version,
                env_steps=env_steps,
                learner=learner,
                actors=exploring_actors,
                shards=shards,
                metrics=metrics,
                nodes=nodes,
            )

        try:
            if callback:
                callback(state({}))
            pool.start()
            stop = False
            while env_steps < tc.total_env_steps and not stop:
                # Learn while learned < replay_ratio x (collected - learning_starts); else wait for the actors.
                due = env_steps >= max(sc.learning_starts, 1) and learned < sc.replay_ratio * (
                    env_steps - sc.learning_starts
                )
                beta = rc.beta + (1.0 - rc.beta) * min(1.0, env_steps / tc.total_env_steps)
                batch = replay.sample(beta) if due else {}
                if not batch:  # not due, or every shard down or empty: collect
                    for r in pool.collect(1):
                        env_steps += r["steps"]
                        lost_by_actor[r["actor"]] = r["lost"]
                        nodes["actors"].add(r["node_id"])
                        lags.append(learner.version - r["version"])  # learner steps behind, at the chunk's start
                        episodes_total += len(r["episodes"])
                        recent_returns.extend(r["episodes"][:, 0].tolist())
                        if len(r["episodes"]):
                            episodes_since_log.append(r["episodes"])
                    continue
                stats, priorities = learner.update(batch)
                learner_time += stats["learner_s"]
                learned += len(batch["reward"])
                replay.update_priorities(batch, priorities)
                if learner.version % sc.publish_every == 0:
                    publisher.publish()
                if learner.version % sc.log_every == 0:
                    record = log_record()
                    stop = bool(callback and callback(state(record)))
                    if selection is not None and selection.stop_reason:
                        print(
                            f"sim2real train: stopping early at update {learner.version}: {selection.stop_reason}",
                            file=sys.stderr,
                        )
                        stop = True
                if learner.version % sc.checkpoint_every == 0:
                    checkpoint()
            settled = pool.settle()  # actors Ray restarted after their last batch (a node lost late in the run)
            if settled or learner.version % sc.log_every or learner.version == 0:  # what happened since the last record
                log_record()
            checkpoint()
            if selection is not None:
                # The final weights compete too; their score goes to selection.json (as in the on-policy loop).
                weights = learner.cpu_weights()
                selection.after_update(learner.version, env_steps, learner.version, weights, final=True)
                (run_dir / "selection.json").write_text(json.dumps(selection.summary(), indent=2))
        except KeyboardInterrupt:
            checkpoint()
            raise
        finally:
            logger.close()
            pool.kill_all()
            if selection is not None:
                selection.close()
            for shard in shards:
                ray.kill(shard)
            ray.kill(weight_source)

    loop_s = time.perf_counter() - loop_start
    c = counters()
    return TrainResult(
        run_dir=str(run_dir),
        algorithm=tc.algorithm,
        env_steps=env_steps,
        updates=learner.version,
        final_return=final_return_of(recent_returns),
        wall_s=time.perf_counter() - start_wall,
        env_steps_per_s=(env_steps - steps_at_start) / loop_s,
        learner_utilization=learner_time / loop_s,
        actor_restarts=c["actor"],
        **entropy_figures(last_record, model_spec["act_dim"]),
        **selection_figures(selection),
        replay=ReplayFigures(
            replay_ratio=learned / max(env_steps, 1),
            learned_samples=learned,
            learner_samples_per_s=(learned - learned_at_start) / loop_s,
            shard_restarts=c["shard"],
            transitions_lost=c["lost"],
            replay_restored=restored,
            nodes={k: sorted(v) for k, v in nodes.items()},
        ),
    )
