"""The task registry: every task is one `TaskSpec`, and nothing else in the project branches on a task.

A task declared as data (MJCF + YAML, `envs.declaration`) compiles to a
TaskSpec; a task whose parts must stay code (the quadrotor's inner loop)
builds its TaskSpec in its own module. Either way it is registered here once,
and `task(env_id)` is the only lookup: an unknown id is an error naming the
known ones, never a fall-through to some other task's settings.
"""

from __future__ import annotations

import copy
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

CONFIG_DIR_ENV = "SIM2REAL_CONFIG_DIR"


def config_dirs() -> list[Path]:
    """Directories searched for task YAMLs: $SIM2REAL_CONFIG_DIR, then `configs/` beside the packages (a
    checkout), else the copy an installed wheel puts in <prefix>/share/sim2real/configs."""
    dirs = []
    if os.environ.get(CONFIG_DIR_ENV):
        dirs.append(Path(os.environ[CONFIG_DIR_ENV]))
    beside = Path(__file__).resolve().parent.parent / "configs"
    installed = Path(sysconfig.get_path("data")) / "share" / "sim2real" / "configs"
    dirs += [d for d in (beside, installed) if d.is_dir()][:1]
    return dirs


class UnknownTaskError(ValueError):
    """An env id that no registered task declares (or two files declare differently); the message names them."""


@dataclass(frozen=True)
class TaskSpec:
    """Everything the pipeline needs to know of one task, by value.

    `shield_model` is ``{"type": "linear", "nominal": () -> NominalModel}`` (linearized from the
    MJCF at the declared operating point) or ``{"type": "double_integrator",
    "response_time_constant": s}``; `action_scale` is physical units per unit action.
    """

    env_id: str
    name: str
    config_file: Path | None  # declared tasks: the YAML that declares them; None: <name>.yaml in config_dirs()
    make_env: Callable[..., gym.Env]  # keyword arguments of gymnasium.make (render_mode, ...) -> the bare env
    obs_dim: int
    act_dim: int
    control_period: float  # s
    episode_steps: int
    safety: dict  # {"kinematics": {position_index, velocity_index}, "constraints": [...]} over obs indices
    shield_model: dict
    action_scale: list[float]
    legacy_name: str
    make_legacy: Callable[[], Any]  # () -> batch controller float32[n, obs_dim] -> float32[n, act_dim]
    # Obs index of a set-point the adversarial policy may steer the legacy controller with, for plants
    # that fall over under a plain full-action push (the cart-pole); None: push at full action.
    steerable_setpoint: int | None = None
    # The task may end an episode before its length (a declared termination, a crash): such an episode is lost,
    # and the gate bounds how often the candidate loses one. False: only a diverged (non-finite) state ends one.
    ends_early: bool = False
    declared: bool = field(default=False)  # True when compiled from a YAML declaration
    fingerprint: str = ""  # declared tasks: hash of the declaration, so an identical copy registers as the same task
    # () -> {"observations": [{name, source, unit}], "actions": [{name, source, unit, units_per_action}]}
    describe_io: Callable[[], dict] | None = None

    @property
    def config_path(self) -> Path:
        """The task's YAML: its randomization sets (and its declaration, for declared tasks)."""
        if self.config_file is not None:
            return self.config_file
        dirs = config_dirs()
        for d in dirs:
            if (d / f"{self.name}.yaml").is_file():
                return d / f"{self.name}.yaml"
        return (dirs or [Path("configs")])[0] / f"{self.name}.yaml"

    def safety_spec(self) -> dict:
        """SAFETY plus dt (s), action bounds, obs/act sizes, action_scale and the shield model's kind."""
        spec = copy.deepcopy(self.safety)
        spec.update(
            dt=self.control_period,
            action_low=[-1.0] * self.act_dim,
            action_high=[1.0] * self.act_dim,
            obs_dim=self.obs_dim,
            act_dim=self.act_dim,
            action_scale=list(self.action_scale),
            model=self.shield_model["type"],
        )
        if self.shield_model["type"] == "linear":
            spec["substeps"] = self.nominal_model().substeps
        else:
            spec["response_time_constant"] = float(self.shield_model.get("response_time_constant", 0.0))
            # A code task's acceleration set-points go through its inner loop, which compensates gravity (the
            # quadrotor's); a declared plant's motors drive its MJCF directly: nothing is compensated.
            spec["gravity_compensated"] = not self.declared
        return spec

    def nominal_model(self):
        """The nominal plant the shield's linear model and an LQR are designed on (linear shield models only)."""
        if self.shield_model["type"] != "linear":
            raise ValueError(f"task {self.env_id}: its shield model is {self.shield_model['type']!r}, not linear")
        return self.shield_model["nominal"]()

    def describe(self) -> dict:
        """One row for `sim2real envs`."""
        return {
            "env_id": self.env_id,
            "task": self.name,
            "obs_dim": self.obs_dim,
            "act_dim": self.act_dim,
            "constraints": [c["name"] for c in self.safety["constraints"]],
            "legacy_controller": self.legacy_name,
            "legacy": self.legacy_name,
            "control_period_s": self.control_period,
            "dt": self.control_period,
            "max_episode_steps": self.episode_steps,
            "config": str(self.config_path),
            "declared": self.declared,
        }


_TASKS: dict[str, TaskSpec] = {}


def register(spec: TaskSpec) -> TaskSpec:
    """Add a task (idempotent for the same id and config file) and register its gymnasium id."""
    known = _TASKS.get(spec.env_id)
    if known is not None:
        if known.fingerprint and known.fingerprint == spec.fingerprint:
            return known  # the same declaration again (e.g. the copy a training run keeps)
        if known.config_file is None or known.config_file != spec.config_file:
            raise UnknownTaskError(
                f"task {spec.env_id} is declared twice, differently: in {known.config_path} and in {spec.config_path}"
            )
    _TASKS[spec.env_id] = spec
    if spec.env_id not in gym.registry:
        gym.register(
            id=spec.env_id,
            entry_point="envs.tasks:make_task_env",
            kwargs={"env_id": spec.env_id},
            max_episode_steps=spec.episode_steps,
        )
    return spec


def task(env_id: str) -> TaskSpec:
    """The registered task with this gymnasium id; UnknownTaskError naming the known ones otherwise."""
    try:
        return _TASKS[env_id]
    except KeyError:
        raise UnknownTaskError(
            f"unknown task env id {env_id!r}: no task declares it; known tasks: {sorted(_TASKS)} "
            f"(a gymnasium MuJoCo env such as HalfCheetah-v5 can be trained by id, but export, eval and "
            f"shadow need a task declaration: constraints, shield model and legacy controller; see "
            f"docs/how-to/own-plant.md)"
        ) from None


def find(env_id: str) -> TaskSpec | None:
    """The registered task with this id, or None (for code that also accepts plain gymnasium envs)."""
    return _TASKS.get(env_id)


def describe_io(env_id: str) -> tuple[dict | None, float | None]:
    """(the task's observations and actions as declared, its control period); (None, None) for an id no task
    declares (a plain gymnasium env), and no I/O for a task that describes none."""
    spec = _TASKS.get(env_id)
    if spec is None:
        return None, None
    return (spec.describe_io() if spec.describe_io is not None else None), float(spec.control_period)


def all_tasks() -> list[TaskSpec]:
    """Every registered task, in registration order."""
    return list(_TASKS.values())
