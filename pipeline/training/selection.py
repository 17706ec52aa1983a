"""Model selection during training: validation evaluations, the best checkpoint, early stopping, ADR.

`ValidationActor` (a Ray actor) runs the deterministic policy (the mean
action, as export ships it) for a fixed set of seeded episodes on the
`validation` randomization set, all episodes stepped together as one batch.
`ModelSelection` (driver side) submits an evaluation every
`validation.every_updates` learner updates, at most one in flight, and reads
results without waiting (async training) or waits for each (`train.sync`, so
a seeded sync run decides the same things at the same updates). A new best
validation return writes `checkpoints/best.pt` with the weights evaluated and
a `selection` record saying why; export takes that checkpoint.

ADR (`train.adr`): the train ranges start at `start_fraction` of their width
and widen by `step` after each evaluation whose return is >= `keep_fraction`
x the best so far; the ranges reached go into the metrics and the manifest.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from envs.randomization import SCALE_GROUPS, RandomizationSet
from pipeline.config import AdrConfig
from pipeline.training.checkpoint import best_checkpoint, read_checkpoint, write_best
from pipeline.training.model import ActorCritic
from pipeline.training.rollout import PolicyInputs, make_env, sent_action

# Evaluations a run needs before a best in its first quarter, beaten by none after, is called a stall.
STALL_EVALUATIONS = 8


class ValidationActor:
    """Evaluates published weights on the validation domains: `evaluate(version, [ref]) -> dict`."""

    def __init__(
        self,
        env_id: str,
        randomization: Any,
        max_episode_steps: int | None,
        episodes: int,
        seed: int,
        model_spec: dict,
        shield: dict | None = None,
        deployable: Callable[[dict], torch.nn.Module] | None = None,
        privileged: Any = None,
    ):
        """`deployable` (an algorithm's checkpoint -> deterministic policy, memoryless): evaluate the policy export
        ships from the published weights; None: the weights are an ActorCritic's, acting with its clipped mean.
        `privileged`: a teacher's validation envs append the sampled domain parameters (adaptive.py)."""
        torch.set_num_threads(1)
        self.envs = [make_env(env_id, randomization, max_episode_steps, shield, privileged) for _ in range(episodes)]
        self.seeds = [seed + k for k in range(episodes)]
        self.model_spec, self.deployable = model_spec, deployable
        self.model = ActorCritic(**model_spec).eval() if deployable is None else None

    def evaluate(self, version: int, wrapped_ref: list) -> dict:
        """Mean return (and per-episode returns, costs, shield interventions) of the deterministic policy."""
        weights = ray.get(wrapped_ref[0]) if isinstance(wrapped_ref[0], ray.ObjectRef) else wrapped_ref[0]
        if self.deployable is None:
            self.model.load_state_dict(weights)
            model = self.model
            low, high = model.action_low.numpy(), model.action_high.numpy()
            dims = (model.obs_dim, model.act_dim, model.history_length)
            return dict(
                version=version,
                **run_episodes(lambda x: np.clip(model(x)[0].numpy(), low, high), dims, self.envs, self.seeds),
            )
        policy = self.deployable({"model_spec": self.model_spec, "model": weights})
        dims = (policy.obs_dim, policy.act_dim, 0)
        return dict(version=version, **run_episodes(lambda x: policy(x).numpy(), dims, self.envs, self.seeds))

    def close(self) -> None:
        for env in self.envs:
            env.close()


@torch.no_grad()
def run_episodes(
    act: Callable[[torch.Tensor], np.ndarray], dims: tuple[int, int, int], envs: list, seeds: list[int]
) -> dict:
    """One seeded episode per env, stepped together, by the deterministic `act` (network input -> action in the
    bounds; no sampling); dims: (obs_dim, act_dim, history_length) of its input."""
    n = len(envs)
    inputs = PolicyInputs(n, *dims)
    obs = np.stack([np.asarray(env.reset(seed=s)[0], np.float32) for env, s in zip(envs, seeds)])
    returns, costs, steps, interventions = np.zeros(n), np.zeros(n), np.zeros(n, np.int64), 0
    active = np.ones(n, bool)
    while active.any():
        actions = act(torch.from_numpy(inputs.of(obs)))
        sent, acted = actions.copy(), obs.copy()
        for i in np.flatnonzero(active):
            o, r, term, trunc, info = envs[i].step(actions[i])
            sent[i] = sent_action(info, actions[i])
            interventions += bool(info.get("shield", {}).get("intervened", False))
            returns[i] += r
            costs[i] += float(info.get("cost", 0.0))
            steps[i] += 1
            obs[i] = o
            active[i] = not (term or trunc)
        inputs.record(acted, sent)
    return dict(
        return_mean=float(returns.mean()),
        returns=returns.tolist(),
        cost=float(costs.sum()),
        steps=int(steps.sum()),
        intervention_rate=interventions / max(int(steps.sum()), 1),
    )


def adr_set(rset: RandomizationSet, fraction: float) -> RandomizationSet:
    """`rset` with every range narrowed to `fraction` of its width around nominal (1.0, clipped into the range).

    fraction 1 is the declared set; 0 is the nominal plant (latency at its low
    end, no noise, no pushes). Noise stds and push forces scale by `fraction`.
    """
    f = float(np.clip(fraction, 0.0, 1.0))
    if f == 1.0:
        return rset.model_copy(deep=True)  # exactly the declared set (no round trip through log/exp)
    data = rset.model_dump(mode="json")

    def narrow(r: dict) -> dict:
        lo, hi = r["low"], r["high"]
        centre = min(max(1.0, lo), hi)
        if r.get("dist") == "loguniform":
            c, a, b = math.log(centre), math.log(lo), math.log(hi)
            return {**r, "low": math.exp(c + f * (a - c)), "high": math.exp(c + f * (b - c))}
        return {**r, "low": centre + f * (lo - centre), "high": centre + f * (hi - centre)}

    for group in SCALE_GROUPS:
        data[group] = {name: narrow(r) for name, r in data[group].items()}
    if data.get("gravity_scale"):
        data["gravity_scale"] = narrow(data["gravity_scale"])
    if data.get("latency_steps"):
        lat = data["latency_steps"]
        lat["high"] = lat["low"] + int(round(f * (lat["high"] - lat["low"])))
    data["obs_noise_std"] = [f * v for v in data["obs_noise_std"]]
    data["action_noise_std"] = [f * v for v in data["action_noise_std"]]
    if data.get("push"):
        if f == 0:
            data["push"] = None
        else:
            data["push"]["max_force"] *= f
    return RandomizationSet.model_validate(data)


class ModelSelection:
    """Driver side of validation: submits evaluations, keeps the best checkpoint, decides early stops and ADR steps."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        model_spec: dict,
        shield: dict | None,
        checkpoint_meta: dict,
        privileged: Any = None,
        *,
        every: int | None = None,
        deployable: Callable[[dict], torch.nn.Module] | None = None,
    ):
        """`every`: learner updates between evaluations (default validation.every_updates); `deployable` and
        `privileged`: see `ValidationActor` (a privileged teacher is validated on privileged observations)."""
        self.privileged = privileged
        self.cfg, self.run_dir, self.meta = cfg, Path(run_dir), checkpoint_meta
        self.vc = cfg.validation
        # The off-policy algorithms' configs have neither: no ADR, and their learner never waits for the actors.
        self.adr = getattr(cfg.train, "adr", None) or AdrConfig(enabled=False)
        self.sync = bool(getattr(cfg.train, "sync", False))
        self.every = int(every or self.vc.every_updates)
        self.model_spec, self.deployable = model_spec, deployable
        self.pending = None  # (ObjectRef, updates, env_steps, weights)
        self.history: list[dict] = []
        self.best: dict | None = None
        self.since_best = 0
        self.stop_reason: str | None = None
        self.adr_fraction = self.adr.start_fraction if self.adr.enabled else 1.0
        if best_checkpoint(self.run_dir) is not None:  # a resumed run must beat what its first life kept
            kept = read_checkpoint(best_checkpoint(self.run_dir))["selection"]
            self.best = {
                k: v
                for k, v in kept.items()
                if k
                in (
                    "updates",
                    "env_steps",
                    "validation_return",
                    "validation_cost",
                    "validation_intervention_rate",
                    "adr_fraction",
                )
            }
            self.adr_fraction = kept.get("adr_fraction", self.adr_fraction)
        self.shield = shield
        self.actor = None

    def start(self) -> None:
        """Start the evaluation actor (after the rollout actors: they are on the critical path)."""
        actor = ray.remote(ValidationActor).options(num_cpus=0, max_restarts=1)
        self.actor = actor.remote(
            self.cfg.task.env_id,
            self.cfg.randomization[self.vc.domains].model_dump(mode="json"),
            self.cfg.task.max_episode_steps,
            self.vc.episodes,
            self.vc.seed,
            self.model_spec,
            self.shield,
            self.deployable,
            self.privileged,
        )

    def train_randomization(self) -> dict:
        """The train set at the current ADR width (the declared set when ADR is off)."""
        rset = self.cfg.randomization["train"]
        return (adr_set(rset, self.adr_fraction) if self.adr.enabled else rset).model_dump(mode="json")

    def after_update(
        self, updates: int, env_steps: int, version: int, weights: dict, final: bool = False
    ) -> list[dict]:
        """Call after every learner update (final=True at the end); returns the evaluations that finished."""
        done = self._poll(block=self.sync or final)
        evaluated = any(h["updates"] == updates for h in self.history)
        due = not evaluated and (final or updates % self.every == 0)
        if due and self.pending is None and (final or self.stop_reason is None):
            ref = self.actor.evaluate.remote(version, [weights])
            self.pending = (ref, updates, env_steps, weights)
            if self.sync or final:
                done += self._poll(block=True)
        return done

    def _poll(self, block: bool) -> list[dict]:
        if self.pending is None:
            return []
        ref, updates, env_steps, weights = self.pending
        if not block and not ray.wait([ref], timeout=0)[0]:
            return []
        self.pending = None
        try:
            result = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
            # Training goes on without this evaluation; the best so far stays the best.
            print(
                f"sim2real train: validation at update {updates} failed ({type(err).__name__}); skipped",
                file=sys.stderr,
            )
            return []
        record = dict(
            updates=updates,
            env_steps=env_steps,
            validation_return=result["return_mean"],
            validation_cost=result["cost"],
            validation_intervention_rate=result["intervention_rate"],
            adr_fraction=self.adr_fraction,
        )
        self.history.append(record)
        improved = self.best is None or result["return_mean"] > self.best["validation_return"] + self.vc.min_improvement
        if improved:
            self.best, self.since_best = record, 0
            why = (
                f"best mean validation return {result['return_mean']:.2f} over {self.vc.episodes} episodes on "
                f"'{self.vc.domains}' (seeds {self.vc.seed}..{self.vc.seed + self.vc.episodes - 1}), at evaluation "
                f"{len(self.history)} of the run; a checkpoint that is kept was not beaten by more than "
                f"{self.vc.min_improvement:g} by any later one"
            )
            selection = dict(
                record,
                why=why,
                domains=self.vc.domains,
                episodes=self.vc.episodes,
                returns=result["returns"],
                train_randomization=self.train_randomization(),
            )
            write_best(
                self.run_dir,
                dict(
                    model=weights,
                    model_spec=self.model_spec,
                    selection=selection,
                    updates=updates,
                    env_steps=env_steps,
                    **self.meta,
                ),
            )
        else:
            self.since_best += 1
            if self.vc.patience and self.since_best >= self.vc.patience:
                self.stop_reason = (
                    f"validation return did not beat {self.best['validation_return']:.2f} "
                    f"(update {self.best['updates']}) in {self.since_best} evaluations"
                )
        record["adr_widen"] = self._adr_step(result["return_mean"])
        return [record]

    def note(self, record: dict, results: list[dict], actors: list) -> None:
        """Fold finished evaluations (`after_update`'s) into a metrics record; push widened ADR ranges to `actors`."""
        for result in results:
            record.update({k: v for k, v in result.items() if k.startswith("validation_")})
            record["validation_best"] = self.best["validation_return"]
            if self.adr.enabled:
                record["adr_fraction"] = self.adr_fraction
            if result.get("adr_widen") and actors:
                widened = self.train_randomization()
                for actor in actors:
                    actor.set_randomization.remote(widened)

    def _adr_step(self, latest: float) -> bool:
        """Widen the train ranges when the latest validation return holds up against the best."""
        if not self.adr.enabled or self.adr_fraction >= 1.0:
            return False
        best = self.best["validation_return"]
        holds = latest >= (self.adr.keep_fraction * best if best >= 0 else best / self.adr.keep_fraction)
        if holds:
            self.adr_fraction = min(1.0, self.adr_fraction + self.adr.step)
        return holds

    def stall_note(self) -> str | None:
        """Where the run's best validation came in its first quarter and every later evaluation scored lower: what
        that was, and what to try (None otherwise, or with fewer than STALL_EVALUATIONS evaluations)."""
        history, best = self.history, self.best
        if best is None or len(history) < STALL_EVALUATIONS:
            return None
        at = next(i for i, r in enumerate(history) if r is best)
        later = history[at + 1 :]
        if at + 1 > len(history) / 4 or not later:
            return None
        returns = [r["validation_return"] for r in later]
        rates = [r["validation_intervention_rate"] for r in later if r.get("validation_intervention_rate") is not None]
        shield = (
            f", with the shield changing {min(rates):.0%}..{max(rates):.0%} of the policy's validation steps"
            if rates and max(rates) > 0.1
            else ""
        )
        return (
            f"the best validation return ({best['validation_return']:.1f}) came at evaluation {at + 1} of "
            f"{len(history)} ({best['env_steps']} env steps); every later one was lower ({min(returns):.1f}.."
            f"{max(returns):.1f}){shield}: training did not improve on it. Try a lower train.lr or more "
            f"train.total_env_steps; where the shield changes most of what the policy does, the shield leaves it "
            f"little room (`sim2real shield synthesize` says CONSERVATIVE where legacy meets the same)"
        )

    def summary(self) -> dict:
        """What the run selected and why, for train()'s result, selection.json and the manifest."""
        return dict(
            enabled=True,
            domains=self.vc.domains,
            evaluations=len(self.history),
            best=self.best,
            stopped_early=self.stop_reason,
            history=self.history,
            adr=dict(
                enabled=self.adr.enabled, fraction=self.adr_fraction, train_randomization=self.train_randomization()
            )
            if self.adr.enabled
            else None,
        )

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)


def selection_figures(selection: ModelSelection | None) -> dict:
    """TrainResult's validation fields: the selected checkpoint's update and return, an early stop, ADR's width."""
    best = selection.best if selection is not None else None
    return dict(
        best_updates=best["updates"] if best else None,
        best_validation_return=best["validation_return"] if best else None,
        stopped_early=selection.stop_reason if selection is not None else None,
        adr_fraction=selection.adr_fraction if selection is not None and selection.adr.enabled else None,
        stall_note=selection.stall_note() if selection is not None else None,
    )


def run_identity(cfg) -> dict:
    """What a run's selected checkpoint records of where it came from: task, env, config hash, algorithm."""
    return dict(
        env_id=cfg.task.env_id, task=cfg.task.name, config_hash=cfg.config_hash(), algorithm=cfg.train.algorithm
    )
