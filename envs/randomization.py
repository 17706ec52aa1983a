"""Domain randomization sets: the YAML schema (pydantic) and the pure sampling function.

A set is stated once, in the task YAML under `randomization: {<name>: ...}`:

    train:
      body_mass:        {cart: {dist: uniform, low: 0.8, high: 1.2}}   # scales mass AND inertia
      geom_friction:    {floor: {dist: uniform, low: 0.7, high: 1.3}}  # scales the friction row
      joint_damping:    {slider: {dist: loguniform, low: 0.5, high: 2.0}}
      joint_stiffness:  {stretch: {dist: uniform, low: 0.8, high: 1.2}}   # a joint's spring
      joint_armature:   {wheel: {dist: uniform, low: 0.8, high: 1.3}}     # a geared motor's reflected inertia
      tendon_stiffness: {spring: {dist: uniform, low: 0.8, high: 1.2}}    # a tendon's spring
      actuator_gain:    {cart_force: {dist: uniform, low: 0.85, high: 1.15}}
      gravity_scale:    {dist: uniform, low: 0.98, high: 1.02}
      latency_steps:    {low: 0, high: 2}          # whole control steps, both ends included
      obs_noise_std:    0.01                       # or one std per observation element
      action_noise_std: 0.02                       # in normalized action units
      push: {body: pole, max_force: 2.0, probability: 0.01, duration_steps: 5}

Every randomized physical quantity is a positive SCALE of its nominal value,
keyed by MuJoCo element name; unknown names are rejected when the set is bound
to a model (envs.domain). `sample_domain(rset, rng)` is the only sampler.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

# The groups of per-element scales a set may randomize (`group.element` parameters), in sampling order: the one
# list every reader of a set's physical parameters iterates (sampling, synthesis, falsification, ADR, calibration).
SCALE_GROUPS = (
    "body_mass",
    "geom_friction",
    "joint_damping",
    "joint_stiffness",
    "joint_armature",
    "tendon_stiffness",
    "actuator_gain",
)


class RandomizationError(ValueError):
    """A randomization set that cannot be used; the message names the offending key or element."""


class _Range(BaseModel):
    """`low` and `high` (subclasses declare their types and bounds), with high >= low."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("high", check_fields=False)
    @classmethod
    def _high_not_below_low(cls, high, info):
        low = info.data.get("low")
        if low is not None and high < low:
            raise ValueError(f"high ({high}) must be >= low ({low})")
        return high


class ScaleRange(_Range):
    """A positive multiplicative factor on a nominal value, drawn once per episode."""

    dist: Literal["uniform", "loguniform"] = Field("uniform", description="uniform or loguniform")
    low: float = Field(gt=0, description="smallest factor (> 0)")
    high: float = Field(gt=0, description="largest factor (>= low)")

    def sample(self, rng: np.random.Generator) -> float:
        """Draw one factor."""
        if self.dist == "loguniform":
            return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return float(rng.uniform(self.low, self.high))


class StepRange(_Range):
    """An integer number of control steps drawn uniformly from low..high (both included)."""

    low: int = Field(ge=0, le=50, description="fewest control steps")
    high: int = Field(ge=0, le=50, description="most control steps (>= low)")


# The world axes a push acts along, by the name `Push.axes` gives them.
AXIS_INDEX = {"x": 0, "y": 1, "z": 2}


class Push(BaseModel):
    """Random pushes: with `probability` per control step, a force on `body` held for `duration_steps`."""

    model_config = ConfigDict(extra="forbid")
    body: str = Field(description="MuJoCo body name that is pushed")
    max_force: float = Field(gt=0, description="N, each world axis drawn uniformly in [-max_force, max_force]")
    probability: float = Field(
        ge=0,
        le=1,
        description="chance per control step, while no push is on, that one starts: pushes never overlap (with 1.0 "
        "and duration_steps as long as the episode, one force drawn at the first step is held throughout)",
    )
    duration_steps: int = Field(1, ge=1, description="control steps a push lasts")
    axes: list[Literal["x", "y", "z"]] = Field(["x", "y", "z"], description="world axes that are pushed")


def _as_list(value):
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


NoiseStd = Annotated[list[Annotated[float, Field(ge=0)]], BeforeValidator(_as_list)]


class RandomizationSet(BaseModel):
    """One named randomization set (see the module docstring for the YAML format)."""

    model_config = ConfigDict(extra="forbid")
    body_mass: dict[str, ScaleRange] = Field({}, description="by body name: scale of mass and inertia")
    geom_friction: dict[str, ScaleRange] = Field({}, description="by geom name: scale of friction")
    joint_damping: dict[str, ScaleRange] = Field({}, description="by joint name: scale of damping")
    joint_stiffness: dict[str, ScaleRange] = Field({}, description="by joint name: scale of its spring stiffness")
    joint_armature: dict[str, ScaleRange] = Field(
        {},
        description="by joint name: scale of its armature (a geared motor's reflected rotor inertia, which "
        "body_mass does not scale); the MJCF must give the joint a nonzero armature",
    )
    tendon_stiffness: dict[str, ScaleRange] = Field({}, description="by tendon name: scale of its spring stiffness")
    actuator_gain: dict[str, ScaleRange] = Field({}, description="by actuator name: scale of force per ctrl")
    gravity_scale: ScaleRange | None = Field(None, description="scale of the gravity vector")
    latency_steps: StepRange | None = Field(None, description="action delay, whole control steps")
    obs_noise_std: NoiseStd = Field([0.0], description="Gaussian obs noise std: one value or one per element")
    action_noise_std: NoiseStd = Field([0.0], description="Gaussian action noise std, normalized units")
    push: Push | None = Field(None, description="random pushes on a body")

    def is_empty(self) -> bool:
        """True when the set changes nothing."""
        return (
            not any(getattr(self, group) for group in SCALE_GROUPS)
            and self.gravity_scale is None
            and self.latency_steps is None
            and not any(self.obs_noise_std)
            and not any(self.action_noise_std)
            and self.push is None
        )


def sample_domain(rset: RandomizationSet, rng: np.random.Generator) -> dict[str, float]:
    """Draw one episode's parameters: a flat {name: value} (scales, and latency_steps as a float)."""
    params: dict[str, float] = {}
    for group in SCALE_GROUPS:
        for element, scale in getattr(rset, group).items():
            params[f"{group}.{element}"] = scale.sample(rng)
    if rset.gravity_scale is not None:
        params["gravity_scale"] = rset.gravity_scale.sample(rng)
    if rset.latency_steps is not None:
        params["latency_steps"] = float(rng.integers(rset.latency_steps.low, rset.latency_steps.high + 1))
    return params


def _format_errors(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join([prefix, *(str(p) for p in e["loc"])]) if prefix else ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{path}: {e['msg']}{shown}")
    return "invalid randomization set:\n  " + "\n  ".join(lines)


def parse_randomization(raw, where: str = "randomization") -> RandomizationSet:
    """Validate a plain dict as a RandomizationSet; errors name the key path (randomization.train.body_mass.x.low)."""
    if raw is None:
        raw = {}
    try:
        return RandomizationSet.model_validate(raw)
    except ValidationError as err:
        raise RandomizationError(_format_errors(err, where)) from None


def load_randomization_sets(path) -> dict[str, RandomizationSet]:
    """Read only the `randomization:` section of a task YAML and validate every set in it."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except OSError as err:
        raise RandomizationError(f"cannot read task config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise RandomizationError(f"task config {path} is not valid YAML: {err}") from None
    section = doc.get("randomization") if isinstance(doc, dict) else None
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise RandomizationError(f"{path}: randomization must be a mapping of set name -> set")
    return {name: parse_randomization(raw, f"randomization.{name}") for name, raw in section.items()}
