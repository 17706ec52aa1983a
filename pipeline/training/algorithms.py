"""The one table of training algorithms: name -> (its `train:` config model, its training loop, its deployable policy).

Only this module names an algorithm. A row says which loop trains it (onpolicy.py's V-trace loop with a
policy loss, or offpolicy.py's Ape-X loop with a learner class), and how a checkpoint it wrote becomes the
deterministic policy export ships. `pipeline.config` holds each algorithm's config model (where every
field is documented once); a test holds the table and the config's algorithms equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn

from pipeline.config import AppoTrainConfig, ImpalaTrainConfig, SacTrainConfig, Td3TrainConfig, TrainCommon
from pipeline.training import model, sac, td3
from pipeline.training.learner import appo_policy_loss, impala_policy_loss
from pipeline.training.offpolicy import train_offpolicy
from pipeline.training.onpolicy import train_vtrace
from pipeline.training.scaffold import TrainResult


@dataclass(frozen=True)
class Algorithm:
    """One row: what `train.algorithm: <name>` means."""

    name: str
    config: type[TrainCommon]  # the `train:` model: the keys it reads, and no others
    train: Callable[..., TrainResult]  # train(cfg, *, out_dir, steps, ..., callback) -> TrainResult
    deployable: Callable[[dict], nn.Module]  # checkpoint -> the deterministic policy export ships
    tunable: bool = True  # `sim2real tune` runs its loop as PBT members


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "appo", AppoTrainConfig, partial(train_vtrace, policy_loss=appo_policy_loss), model.policy_from_checkpoint
        ),
        Algorithm(
            "impala",
            ImpalaTrainConfig,
            partial(train_vtrace, policy_loss=impala_policy_loss),
            model.policy_from_checkpoint,
        ),
        Algorithm(
            "sac",
            SacTrainConfig,
            partial(train_offpolicy, learner_cls=sac.SacLearner, settings_of=lambda tc: tc.sac),
            sac.policy_from_checkpoint,
            tunable=False,
        ),
        Algorithm(
            "td3",
            Td3TrainConfig,
            partial(train_offpolicy, learner_cls=td3.Td3Learner, settings_of=lambda tc: tc.td3),
            sac.policy_from_checkpoint,
            tunable=False,
        ),
    )
}


def algorithm(name: str) -> Algorithm:
    """The row of `name` (train.algorithm, or the `algorithm` a checkpoint records)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"train.algorithm: unknown algorithm {name!r}; one of {', '.join(ALGORITHMS)}") from None
