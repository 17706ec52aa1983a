"""MuJoCo tasks, domain randomization, latency/noise wrappers, legacy controllers and safety specs.

Importing `envs` registers `sim2real/CartPoleRail-v0` and `sim2real/QuadrotorGeofence-v0`
with gymnasium. `envs` knows nothing of training, Ray or ONNX.
"""

from envs.tasks import (
    LEGACY_NAMES,
    describe_tasks,
    legacy_controller,
    register_tasks,
    safety_spec,
    task_config_path,
)

register_tasks()

TASKS = {row["env_id"]: row for row in describe_tasks()}


def randomize(env, rset):
    """Wrap any gymnasium MuJoCo env with domain randomization (RandomizationSet or dict, by element name)."""
    from envs.wrappers import randomize as _randomize

    return _randomize(env, rset)


__all__ = [
    "LEGACY_NAMES",
    "TASKS",
    "describe_tasks",
    "legacy_controller",
    "randomize",
    "safety_spec",
    "task_config_path",
]
