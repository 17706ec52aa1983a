"""`train(cfg)`: the task's policy trained by the algorithm `train.algorithm` names (algorithms.py's table).

Every algorithm's loop starts Ray (or joins a cluster), runs its rollout actors and learner, and writes
one run directory: config.yaml (the resolved config), metrics.jsonl, TensorBoard events,
checkpoints/ckpt_<updates>.pt (+ checkpoints/best.pt and selection.json where the algorithm selects on
validation), and returns a `TrainResult` (scaffold.py).
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.training.adaptive import train_adaptive
from pipeline.training.algorithms import algorithm
from pipeline.training.scaffold import TrainResult


def is_adaptive(cfg) -> bool:
    """Whether `cfg` trains an adaptive policy (train.adaptive); off-policy configs have no such key."""
    return getattr(cfg.train, "adaptive", None) is not None


def train(
    cfg,
    *,
    out_dir=None,
    steps=None,
    actors=None,
    envs_per_actor=None,
    ray_address=None,
    resume=None,
    progress=True,
    callback: Callable[[dict], bool] | None = None,
) -> TrainResult:
    """Train the task's policy with `cfg.train.algorithm`.

    `steps` is the total env-step budget of the run (a resumed run counts the steps it
    already has); `actors` and `envs_per_actor` override train.num_actors and
    train.envs_per_actor; `ray_address` (else $RAY_ADDRESS, else ray.address) joins a
    cluster instead of starting a local Ray; `resume` is a run directory to continue from
    its latest checkpoint. `callback(state)` is called before the first learner step and
    after every metrics record with a dict (updates, env_steps, learner, actors, metrics,
    and the loop's own parts); when it returns True the run stops early (e.g. a return
    threshold was reached), with a final checkpoint as usual. With `train.adaptive` the run trains a
    privileged teacher and distills it into a history policy (adaptive.py).
    """
    train_run = train_adaptive if is_adaptive(cfg) else algorithm(cfg.train.algorithm).train
    return train_run(
        cfg,
        out_dir=out_dir,
        steps=steps,
        actors=actors,
        envs_per_actor=envs_per_actor,
        ray_address=ray_address,
        resume=resume,
        progress=progress,
        callback=callback,
    )
