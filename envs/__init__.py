"""MuJoCo tasks, domain randomization, latency/noise wrappers, legacy controllers and safety specs.

Importing `envs` registers every task with gymnasium: the code task
`sim2real/QuadrotorGeofence-v0`, and each task declared as data (a YAML with a
`plant:` section beside its MJCF, as every other task in configs/ is) found by
`envs.tasks.config_dirs()` or listed in $SIM2REAL_TASKS. `envs` knows nothing
of training, Ray or ONNX.
"""

from envs.registry import TaskSpec, UnknownTaskError, find, task
from envs.tasks import (
    check_task_file,
    describe_tasks,
    legacy_controller,
    measured_response,
    nominal_model,
    register_task_file,
    register_tasks,
    resolve_randomization,
    safety_spec,
    task_config_path,
)
from envs.wrappers import randomize

register_tasks()

TASKS = {row["env_id"]: row for row in describe_tasks()}

__all__ = [
    "TASKS",
    "TaskSpec",
    "UnknownTaskError",
    "check_task_file",
    "describe_tasks",
    "find",
    "legacy_controller",
    "measured_response",
    "nominal_model",
    "randomize",
    "register_task_file",
    "resolve_randomization",
    "safety_spec",
    "task",
    "task_config_path",
]
