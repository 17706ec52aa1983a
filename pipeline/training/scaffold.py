"""What every training loop shares, whatever the algorithm: the run directory, its checkpoints and resume, the
model's shape, Ray's address, actor seeds, weight publishing, the shield in the loop, episode figures and the one
result.

An algorithm's loop (onpolicy.py, offpolicy.py) calls `start_run` first and returns a `TrainResult`;
algorithms.py says which loop runs which algorithm.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import ray
import torch
import yaml
from gymnasium.spaces import Box

from pipeline.training.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from pipeline.training.learner import resolve_device
from pipeline.training.metrics import is_entropy_collapsed
from pipeline.training.rollout import make_env, preflight

# final_return = mean return of this many most recent episodes.
FINAL_RETURN_WINDOW = 20


@dataclass
class ReplayFigures:
    """An off-policy run's replay and fault figures."""

    replay_ratio: float  # transitions learned per transition collected
    learned_samples: int
    learner_samples_per_s: float
    shard_restarts: int
    transitions_lost: int  # held by a shard that died, or taken by none
    replay_restored: int  # transitions a resumed run found in the replay snapshot
    nodes: dict[str, list[str]]  # Ray node ids that ran actors and shards


@dataclass
class TrainResult:
    """What a training run returns, whatever the algorithm: the CLI prints it, the flow registers parts of it."""

    run_dir: str
    algorithm: str
    env_steps: int
    updates: int  # learner steps (an off-policy learner steps once per minibatch)
    final_return: float | None  # mean return of the last FINAL_RETURN_WINDOW training episodes
    wall_s: float  # s, this life of the run (a resumed run counts from its restart)
    env_steps_per_s: float
    learner_utilization: float  # share of the loop's wall time spent in learner updates
    actor_restarts: int
    entropy: float | None = None  # the policy's last measured entropy (nats, summed over action dimensions)
    entropy_collapsed: bool = False  # entropy below metrics.ENTROPY_COLLAPSE_NATS at the end of the run
    # Validation-based selection (algorithms that select on validation, with validation.enabled):
    best_updates: int | None = None
    best_validation_return: float | None = None
    stopped_early: str | None = None
    adr_fraction: float | None = None
    replay: ReplayFigures | None = None
    stall_note: str | None = None  # the best validation came early and nothing later beat it (selection.py)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for --json and the flow's persisted results)."""
        return dataclasses.asdict(self)


class WeightLearner(Protocol):
    """What the scaffold needs of any learner: a version and its weights on the CPU."""

    version: int

    def cpu_weights(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RunStart(NamedTuple):
    """What `start_run` hands the loop."""

    cfg: Any  # the config with the command line's overrides
    run_dir: Path
    checkpoint: dict | None  # the checkpoint a resumed run continues from
    model_spec: dict
    randomization: dict  # the `train` set, as plain data
    device: torch.device


def with_overrides(cfg, steps: int | None, actors: int | None, envs_per_actor: int | None):
    """A copy of cfg with the command line's overrides of train.*, each validated like the YAML value."""
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


def model_spec_for(cfg, history_length: int | None = None, privileged: Any = None) -> tuple[dict, dict]:
    """(model_spec, train randomization) from one probe env; the spec names history_length when one is given.
    `privileged` (make_env's) widens the observation by the sampled domain parameters."""
    randomization = cfg.randomization["train"].model_dump(mode="json")
    env = make_env(cfg.task.env_id, randomization, cfg.task.max_episode_steps, privileged=privileged)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not (
            isinstance(obs_space, Box)
            and isinstance(act_space, Box)
            and len(obs_space.shape) == 1
            and len(act_space.shape) == 1
        ):
            raise ValueError(
                f"{cfg.task.env_id}: needs flat Box observations and actions, got {obs_space} and {act_space}"
            )
        spec = dict(
            obs_dim=obs_space.shape[0],
            act_dim=act_space.shape[0],
            hidden_sizes=list(cfg.train.hidden_sizes),
            action_low=act_space.low.astype(float).tolist(),
            action_high=act_space.high.astype(float).tolist(),
        )
        if history_length is not None:
            spec["history_length"] = history_length
    finally:
        env.close()
    return spec, randomization


def algorithm_of(ckpt: dict) -> str:
    """The algorithm that wrote a checkpoint (on-policy checkpoints of older runs carry none: APPO's network)."""
    return ckpt.get("algorithm", "appo")


def start_run(
    cfg, out_dir, resume, steps, actors, envs_per_actor, history_length: int | None = None, privileged: Any = None
) -> RunStart:
    """What every training loop does first: apply the overrides, find the run directory and the checkpoint
    to resume (refused when another algorithm or model wrote it), probe the model's shape, write the
    resolved config.yaml and seed torch."""
    if resume is not None:
        run_dir = Path(resume)
        ckpt = read_checkpoint(latest_checkpoint(run_dir))
    else:
        # The second alone named two runs started in the same second alike: a random tail keeps them apart.
        stamp = f"{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"
        run_dir = Path(out_dir) if out_dir else Path("runs") / f"{cfg.task.name}-{stamp}"
        ckpt = None
    cfg = with_overrides(cfg, steps, actors, envs_per_actor)
    preflight(cfg)  # a set or a legacy controller that cannot run fails here, before the run directory exists
    model_spec, randomization = model_spec_for(cfg, history_length, privileged)
    if ckpt is not None and (algorithm_of(ckpt) != cfg.train.algorithm or ckpt["model_spec"] != model_spec):
        raise ValueError(
            f"cannot resume {run_dir}: its checkpoint ({algorithm_of(ckpt)}, model {ckpt['model_spec']}) "
            f"does not match the config's train.algorithm {cfg.train.algorithm!r} and model {model_spec}"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    return RunStart(cfg, run_dir, ckpt, model_spec, randomization, device)


def write_run_checkpoint(
    run_dir: Path,
    cfg,
    learner: WeightLearner,
    model_spec: dict,
    *,
    env_steps: int,
    episodes: int,
    wall_s: float,
    learned_samples: int | None = None,
    restarts: dict | None = None,
) -> None:
    """The loop's checkpoint: the learner, its weights and the run's counters; `wall_s` in s over all of the
    run's lives. An off-policy loop adds its `learned_samples` and its restart counters."""
    # learner.version, not the loop's count: after an interrupt they can differ and the weights are the truth.
    state = dict(
        algorithm=cfg.train.algorithm,
        learner=learner.state_dict(),
        model=learner.cpu_weights(),
        model_spec=model_spec,
        updates=learner.version,
        env_steps=env_steps,
    )
    if learned_samples is not None:
        state["learned_samples"] = learned_samples
    state.update(
        episodes=episodes,
        wall_s=wall_s,
        torch_rng_state=torch.get_rng_state(),
        env_id=cfg.task.env_id,
        task=cfg.task.name,
        config_hash=cfg.config_hash(),
    )
    if restarts is not None:
        state["restarts"] = restarts
    write_checkpoint(run_dir, learner.version, state)


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
        record.update(
            episode_return=float(episodes[:, 0].mean()),
            episode_cost=float(episodes[:, 1].mean()),
            episode_length=float(episodes[:, 2].mean()),
            episodes=episodes_total,
        )


def final_return_of(recent_returns: deque) -> float | None:
    return float(np.mean(recent_returns)) if recent_returns else None


def entropy_figures(record: dict | None, act_dim: int) -> dict:
    """TrainResult's entropy fields from the last metrics record."""
    entropy = None if record is None else record.get("entropy")
    return dict(entropy=entropy, entropy_collapsed=is_entropy_collapsed(entropy, act_dim))


class WeightPublisher:
    """Puts the learner's weights into the object store and tells the WeightSource (actor_pool.py)."""

    def __init__(self, learner: WeightLearner, weight_source):
        self.learner, self.weight_source = learner, weight_source
        self.latest: tuple[int, list] | None = None
        self.weights: dict | None = None

    def publish(self) -> tuple[int, list]:
        weights = self.weights = self.learner.cpu_weights()  # kept: validation evaluates (and best.pt stores) these
        latest = self.latest = (self.learner.version, [ray.put(weights)])  # the driver owns the ref: kept alive
        self.weight_source.publish.remote(*latest)
        return latest


def shield_in_loop(cfg) -> dict | None:
    """The shield the actors' envs apply when training with it in the loop (`shield.train_in_loop`)."""
    if not (cfg.shield.enabled and cfg.shield.train_in_loop):
        return None
    from pipeline.safety.shield_spec import build_shield_spec

    spec = build_shield_spec(cfg)
    if cfg.shield.train_margin is not None:  # train (and select) to keep a wider clearance than the deployed shield's
        spec["margin"] = float(cfg.shield.train_margin)
    return {"spec": spec, "intervention_penalty": cfg.shield.intervention_penalty}
