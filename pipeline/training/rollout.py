"""Rollout side of the actor-learner split: env creation and the rollout actor.

`RolloutActor` steps M randomized envs with a CPU copy of the policy and
returns fixed-length, time-major trajectory batches as numpy arrays (they go
through the Ray object store zero-copy). It asks the `WeightSource`
(actor_pool.py) for the newest published weights between batches, so it never
waits for the learner.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch

from pipeline.training.actor_pool import ray_restarted
from pipeline.training.model import ActorCritic
from shield.policy import HistoryBuffer

# Recreating an env that keeps raising is pointless; the actor gives up after this many.
MAX_ENV_RESTARTS = 100


def make_env(
    env_id: str,
    randomization: Any = None,
    max_episode_steps: int | None = None,
    shield: dict | None = None,
    privileged: Any = None,
) -> gym.Env:
    """Create one env by gymnasium id with a domain-randomization set applied.

    `randomization` is None, a set name ("train") or a set as a dict/RandomizationSet.
    Our tasks take it as a `gymnasium.make` argument; any other MuJoCo env
    (e.g. HalfCheetah-v5) is wrapped by `envs.randomize` when a set is given.
    `shield` ({"spec": shield.json dict, "intervention_penalty": float}) puts the
    CBF shield in the loop, as on the edge box. `privileged` (a randomization set: the ranges to
    normalize over) appends the episode's sampled parameters to the observation, outermost, so the
    shield still reads the plant's own observation (a sim-only teacher's input).
    """
    import envs  # noqa: F401  (registers the sim2real/* ids)

    kwargs = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    if env_id.startswith("sim2real/"):
        env = gym.make(env_id, randomization=randomization, **kwargs)
    else:
        env = gym.make(env_id, **kwargs)
        if randomization is not None and not isinstance(randomization, str):
            env = envs.randomize(env, randomization)
    if shield is not None:
        from pipeline.safety.shielded_env import ShieldedEnv

        env = ShieldedEnv(env, shield["spec"], intervention_penalty=shield["intervention_penalty"])
    if privileged is not None:
        env = envs.wrappers.PrivilegedObservation(env, privileged)
    return env


def preflight(cfg) -> None:
    """Build the task's env under every randomization set, reset it and step it once, and (a sim2real task) ask
    its legacy controller for one observation's action: a set naming an element the plant lacks, noise of the
    wrong length, an initial state the env cannot draw or a legacy controller of the wrong shape fails here as a
    ConfigError naming its key, before a run directory or a Ray actor exists."""
    from envs.declared_env import InitialStateError
    from pipeline.config import ConfigError

    env_id, obs = cfg.task.env_id, None
    for name, rset in cfg.randomization.items():
        try:
            env = make_env(env_id, rset.model_dump(mode="json"), cfg.task.max_episode_steps)
            try:
                obs, _ = env.reset(seed=0)
                low, high = env.action_space.low, env.action_space.high
                env.step(np.clip(np.zeros(env.action_space.shape), low, high).astype(env.action_space.dtype))
            finally:
                env.close()
        except InitialStateError as err:  # the starts, not the set, are what to change
            raise ConfigError(str(err)) from None
        except Exception as err:  # whatever the env raised, the set is what to change
            raise ConfigError(
                f"randomization.{name}: the task's env cannot run with this set: {type(err).__name__}: {err}"
            ) from None
    if obs is None or not env_id.startswith("sim2real/"):
        return
    import envs

    act_dim = int(np.prod(env.action_space.shape))
    try:
        legacy = envs.legacy_controller(env_id)
        action = np.asarray(legacy(np.asarray(obs, np.float32)[None]))
    except Exception as err:
        raise ConfigError(
            f"plant.legacy: the legacy controller cannot answer an observation: {type(err).__name__}: {err}"
        ) from None
    if action.shape != (1, act_dim):
        raise ConfigError(
            f"plant.legacy: the legacy controller returned shape {action.shape} for one observation "
            f"(float32[1, {len(obs)}]); it must return float32[n, act_dim] = [1, {act_dim}]"
        )


def plant_notes(cfg, draws: int = 1000) -> tuple[str | None, list[str]]:
    """What `config --check` says of a declared plant, from one env: where plant.initial_state draws starts past a
    limit (None: it draws none), how many, past which constraint and by how much, and that such a start is drawn
    again; and where a set-point range reaches past a limit on what tracks it
    (`PlantDeclaration.targets_past_limits`: accepted in silence, such targets end episodes held by the shield)."""
    if not cfg.task.env_id.startswith("sim2real/"):
        return None, []
    env = make_env(cfg.task.env_id, None, cfg.task.max_episode_steps)
    try:
        plant = env.unwrapped
        outside, worst = plant.starts_outside(draws) if hasattr(plant, "starts_outside") else (0, {})
        decl = getattr(plant, "decl", None)
    finally:
        env.close()
    targets = decl.targets_past_limits() if decl is not None else []
    if not outside:
        return None, targets
    past = ", ".join(f"{name} by up to {value:.4g}" for name, value in worst.items())
    return (
        f"{outside} of {draws} starts drawn from plant.initial_state lie past a limit ({past}); each such start "
        "is drawn again, so every episode starts inside the constraints. Narrow plant.initial_state to the starts "
        "the plant really has inside its limits: a box mostly outside them wastes draws and hides where it starts"
    ), targets


class PolicyInputs:
    """The network inputs of M envs: observation + (history policies) the last H (obs, sent action) pairs.

    Uses the edge's `HistoryBuffer`, so training sees exactly the layout the
    exported graph gets on the plant. For a memoryless policy the input is the observation.
    Env observations wider than `obs_dim` (privileged parameters appended) are cut to the policy's own.
    """

    def __init__(self, num_envs: int, obs_dim: int, act_dim: int, history_length: int):
        self.obs_dim = obs_dim
        self.history = HistoryBuffer(num_envs, history_length, obs_dim, act_dim) if history_length else None

    def of(self, obs: np.ndarray, rows=slice(None)) -> np.ndarray:
        """float32[m, input_dim] for obs float32[m, obs_dim] of the given rows."""
        obs = np.asarray(obs, np.float32)[:, : self.obs_dim]
        if self.history is None:
            return obs
        hist = self.history.array[rows]
        return np.concatenate([obs, hist.reshape(hist.shape[0], -1)], axis=1).astype(np.float32)

    def record(self, obs: np.ndarray, sent: np.ndarray) -> None:
        """After a step of every env: the observation each acted on and the action it really got."""
        if self.history is not None:
            self.history.push(np.asarray(obs)[:, : self.obs_dim], sent)

    def clear(self, i: int) -> None:
        """Env i starts a new episode."""
        if self.history is not None:
            self.history.clear(i)


def sent_action(info: dict, action: np.ndarray) -> np.ndarray:
    """The action the plant really got: the shield's when it is in the loop, else the one given."""
    return np.asarray(info.get("shield_action", action), np.float32)


class RolloutActor:
    """Steps `num_envs` envs with the current policy; `rollout()` returns one batch of T steps.

    Terminated episodes cut the value bootstrap (discount 0). Truncated ones
    (time limit) also get discount 0 but the batch carries the final
    observation in `final_obs` and `truncated`, so the learner adds
    gamma * V(final_obs) to that step's reward: a time limit is not a failure.

    With `privileged` (make_env's), envs whose observation carries the sampled domain parameters
    beyond the policy's own `obs_dim` return them too, as `privileged` float32[T + 1, M, P]: what a
    teacher labels a student's visited states with.
    """

    def __init__(
        self,
        index: int,
        env_id: str,
        randomization: Any,
        max_episode_steps: int | None,
        num_envs: int,
        rollout_length: int,
        seed: int,
        model_spec: dict,
        weight_source: str | None = None,
        shield: dict | None = None,
        privileged: Any = None,
    ):
        torch.set_num_threads(1)  # one core per actor; torch's thread pool would fight the others
        restarted = ray_restarted()
        # A restarted actor must not replay the episodes its previous life already sent.
        self._seed_seq = np.random.SeedSequence([seed, index, int(time.time_ns() % 2**32) if restarted else 0])
        self._env_args = (env_id, randomization, max_episode_steps, shield, privileged)
        self.index, self.num_envs, self.T = index, num_envs, rollout_length
        self.life = uuid.uuid4().hex  # changes when Ray restarts this actor; the driver counts restarts by it
        self.reconstructed = bool(restarted)  # a restart even when the driver never saw the life before it
        self.model = ActorCritic(**model_spec).eval()
        self.inputs = PolicyInputs(num_envs, self.model.obs_dim, self.model.act_dim, self.model.history_length)
        self.version = -1
        # Looked up by name, not passed as a handle, so a restarted actor finds it without
        # depending on constructor arguments kept in the object store.
        self.weight_source = ray.get_actor(weight_source) if weight_source else None
        sampling_seq, envs_seq = self._seed_seq.spawn(2)  # independent streams: action noise, env resets
        self.torch_gen = torch.Generator().manual_seed(int(sampling_seq.generate_state(1)[0]))
        self.env_seeds = envs_seq.generate_state(num_envs).tolist()
        self.envs = [make_env(*self._env_args) for _ in range(num_envs)]
        self.obs = np.stack([self._reset(i, seed=self.env_seeds[i]) for i in range(num_envs)])
        self.ep_return = np.zeros(num_envs)
        self.ep_cost = np.zeros(num_envs)
        self.ep_len = np.zeros(num_envs, dtype=np.int64)
        self.env_restarts = 0
        self.domain_changes = 0

    def _reset(self, i: int, seed: int | None = None) -> np.ndarray:
        obs, _ = self.envs[i].reset(seed=seed)
        self.inputs.clear(i)
        return np.asarray(obs, dtype=np.float32)

    def set_randomization(self, randomization: Any) -> None:
        """Train on new domain ranges from now on (ADR): every env is rebuilt; episodes in progress are dropped."""
        self.domain_changes += 1
        self._env_args = (self._env_args[0], randomization, *self._env_args[2:])
        seeds = np.random.SeedSequence([*self._seed_seq.entropy, self.domain_changes]).generate_state(self.num_envs)
        for i in range(self.num_envs):
            self.envs[i].close()
            self.envs[i] = make_env(*self._env_args)
            self.obs[i] = self._reset(i, seed=int(seeds[i]))
        self.ep_return[:] = self.ep_cost[:] = self.ep_len[:] = 0

    def _recreate(self, i: int) -> np.ndarray:
        """Replace env i after it raised; the episode in progress is dropped."""
        self.env_restarts += 1
        if self.env_restarts > MAX_ENV_RESTARTS:
            raise RuntimeError(f"rollout actor {self.index}: envs raised {self.env_restarts} times; giving up")
        try:
            self.envs[i].close()
        except Exception:  # the broken env may fail to close too; it is discarded either way
            pass
        self.envs[i] = make_env(*self._env_args)
        self.ep_return[i] = self.ep_cost[i] = self.ep_len[i] = 0
        return self._reset(i, seed=int(self._seed_seq.spawn(1)[0].generate_state(1)[0]))

    def set_weights(self, version: int, state_dict: dict) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version

    def _refresh_weights(self, weights: tuple[int, list] | None) -> None:
        if weights is None and self.weight_source is not None:
            weights = ray.get(self.weight_source.latest.remote())
        if weights is not None and weights[0] > self.version and weights[1] is not None:
            self.set_weights(weights[0], ray.get(weights[1][0]))

    def life_info(self) -> tuple[str, bool]:
        """Which life of this actor answers (a new one after every restart by Ray), and whether Ray restarted it."""
        return self.life, self.reconstructed

    def rollout(self, weights: tuple[int, list] | None = None) -> dict:
        """Collect T steps from every env. `weights` pins a version (sync mode); else the newest is used."""
        self._refresh_weights(weights)
        T, M, in_dim = self.T, self.num_envs, self.model.input_dim
        act_dim = self.model.act_dim
        # obs/final_obs hold the network inputs (observation + history for a history policy).
        obs_buf = np.zeros((T + 1, M, in_dim), np.float32)
        env_obs = np.zeros((T + 1, *self.obs.shape), np.float32)
        final_obs = np.zeros((T, M, in_dim), np.float32)
        actions = np.zeros((T, M, act_dim), np.float32)
        logp = np.zeros((T, M), np.float32)
        behaviour_mean = np.zeros((T, M, act_dim), np.float32)
        rewards = np.zeros((T, M), np.float32)
        costs = np.zeros((T, M), np.float32)
        terminated = np.zeros((T, M), bool)
        truncated = np.zeros((T, M), bool)
        episodes: list[tuple[float, float, int]] = []
        low, high = self.model.action_low.numpy(), self.model.action_high.numpy()

        for t in range(T):
            env_obs[t] = self.obs
            obs_buf[t] = self.inputs.of(self.obs)
            with torch.no_grad():
                dist, _ = self.model.distribution(torch.from_numpy(obs_buf[t]))
                sample = dist.mean + dist.stddev * torch.randn(dist.mean.shape, generator=self.torch_gen)
                logp[t] = dist.log_prob(sample).sum(-1).numpy()
                behaviour_mean[t] = dist.mean.numpy()
            actions[t] = sample.numpy()
            env_actions = np.clip(actions[t], low, high)
            sent, stepped, ended, recreated = env_actions.copy(), self.obs.copy(), [], []
            for i in range(M):
                try:
                    o, r, term, trunc, info = self.envs[i].step(env_actions[i])
                except Exception:
                    # Cut the trace here (discount 0, no reward) and go on with a fresh env.
                    self.obs[i] = self._recreate(i)
                    terminated[t, i] = True
                    recreated.append(i)
                    continue
                sent[i] = sent_action(info, env_actions[i])
                rewards[t, i] = r
                costs[t, i] = float(info.get("cost", 0.0))
                self.ep_return[i] += r
                self.ep_cost[i] += costs[t, i]
                self.ep_len[i] += 1
                terminated[t, i], truncated[t, i] = term, trunc and not term
                self.obs[i] = o
                if term or trunc:
                    ended.append(i)
                    episodes.append((float(self.ep_return[i]), float(self.ep_cost[i]), int(self.ep_len[i])))
                    self.ep_return[i] = self.ep_cost[i] = self.ep_len[i] = 0
            self.inputs.record(stepped, sent)  # before the resets below clear the ended envs' histories
            for i in ended:
                final_obs[t, i] = self.inputs.of(self.obs[i : i + 1], rows=slice(i, i + 1))[0]
                self.obs[i] = self._reset(i)
            for i in recreated:
                self.inputs.clear(i)
        obs_buf[T] = self.inputs.of(self.obs)
        env_obs[T] = self.obs
        extra = {}
        if env_obs.shape[-1] > self.model.obs_dim:
            extra["privileged"] = env_obs[..., self.model.obs_dim :]

        return dict(
            **extra,
            obs=obs_buf,
            actions=actions,
            behaviour_logp=logp,
            rewards=rewards,
            costs=costs,
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            behaviour_mean=behaviour_mean,
            behaviour_log_std=self.model.log_std.detach().numpy().copy(),
            version=self.version,
            actor=self.index,
            life=self.life,
            reconstructed=self.reconstructed,
            episodes=np.asarray(episodes, np.float64).reshape(-1, 3),
            env_restarts=self.env_restarts,
        )
