"""The task config: one validated pydantic model per `configs/<task>.yaml`.

Every field is documented once, here; `sim2real config` prints them.
Unknown keys, wrong types and impossible values are errors whose message names
the key's dotted path (e.g. ``train.lr``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from envs.declaration import PlantDeclaration
from envs.randomization import RandomizationSet


class ConfigError(ValueError):
    """A config file is missing, unreadable or invalid; the message names the key."""


class Section(BaseModel):
    """Base for every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskConfig(Section):
    """Which simulated plant this config trains and evaluates."""

    name: str = Field(
        description="Short task name: the registry folder models/<name>/ and `serve --registry NAME`.",
        pattern=r"^[a-z][a-z0-9_-]*$",
    )
    env_id: str = Field(description="Gymnasium id of the plant, e.g. sim2real/CartPoleRail-v0.")
    max_episode_steps: int | None = Field(None, gt=0, description="Override of the env's episode length (steps).")


class AdrConfig(Section):
    """Automatic domain randomization: `train` ranges start narrow and widen toward their declared bounds."""

    enabled: bool = Field(False, description="Widen the train ranges step by step while validation holds up.")
    start_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Width of the first ranges, as a fraction of the declared ones "
        "(around the nominal value 1.0, or the range's middle when 1.0 lies outside it).",
    )
    step: float = Field(
        0.25, gt=0, le=1, description="Fraction added to the width after each validation that holds up."
    )
    keep_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Widen only while the latest validation return is >= this "
        "fraction of the best seen at the current width.",
    )


class OffPolicyConfig(Section):
    """What every off-policy learner with Ape-X actors reads; rollout_length = env steps per actor request."""

    lr: float = Field(3e-4, gt=0, description="Adam learning rate (actor, critics and, for SAC, the temperature).")
    batch_size: int = Field(256, ge=1, description="Transitions per learner step, drawn from all replay shards.")
    replay_ratio: float = Field(
        64.0, gt=0, description="Transitions learned per transition collected (batch_size / env steps per update)."
    )
    learning_starts: int = Field(2000, ge=0, description="Env steps collected before the first learner step.")
    n_step: int = Field(3, ge=1, description="Steps summed into each transition's return (n-step TD targets).")
    tau: float = Field(0.005, gt=0, le=1, description="Polyak rate of the target networks per learner step.")
    exploration_noise: float = Field(
        0.3,
        ge=0,
        description="Ape-X levels: actor i adds N(0, s_i^2) to its actions, s_i = this^(1 + "
        "exploration_alpha * i / (num_actors - 1)) (normalized action units).",
    )
    exploration_alpha: float = Field(
        7.0, ge=0, description="Spread of the per-actor exploration levels (Ape-X uses 7)."
    )
    prefetch_batches: int = Field(
        4,
        ge=1,
        description="Minibatches fetched from the shards per request (fewer round trips; priorities that much staler).",
    )
    publish_every: int = Field(10, ge=1, description="Broadcast actor weights every N learner steps.")
    log_every: int = Field(50, ge=1, description="Write a metrics record every N learner steps.")
    checkpoint_every: int = Field(
        5000, ge=1, description="Checkpoint (learner and replay snapshot) every N learner steps, and at the end."
    )


class SacConfig(OffPolicyConfig):
    """Off-policy SAC learner and its Ape-X actors (train.algorithm: sac)."""

    init_temperature: float = Field(0.2, gt=0, description="Initial entropy temperature; tuned toward target_entropy.")
    target_entropy: float | None = Field(None, description="Entropy target (nats); None: -act_dim.")


class Td3Config(OffPolicyConfig):
    """Off-policy TD3 learner (deterministic actor, twin critics, target smoothing), Ape-X actors (algorithm: td3)."""

    policy_noise: float = Field(
        0.2, ge=0, description="Std of the noise on the target action (target policy smoothing, normalized units)."
    )
    noise_clip: float = Field(0.5, ge=0, description="The target action's noise is clipped to +-this.")
    policy_delay: int = Field(2, ge=1, description="Critic steps per actor (and target) update.")


class ReplayConfig(Section):
    """Sharded prioritized replay (off-policy algorithms)."""

    capacity: int = Field(
        200_000, ge=1, description="Transitions kept over all shards (each holds capacity / num_shards)."
    )
    num_shards: int = Field(2, ge=1, description="Replay shards (Ray actors, spread over the cluster's nodes).")
    alpha: float = Field(0.6, ge=0, description="Prioritization exponent: P(i) ~ p_i^alpha (0 = uniform).")
    beta: float = Field(
        0.4, ge=0, le=1, description="Importance-weight exponent at the start; annealed to 1 at total_env_steps."
    )
    shard_num_cpus: float = Field(
        0.25, ge=0, description="CPUs reserved per shard (fractional leaves room for restarts after a node loss)."
    )
    checkpoint: bool = Field(
        True, description="Save the shards' contents with every checkpoint (replay/shard_<k>.npz) for --resume."
    )


class TrainCommon(Section):
    """What the training scaffold reads for every algorithm: budget, actors, network size, discount, device."""

    if TYPE_CHECKING:  # each algorithm's model sets it, as a Literal that tags the union below
        algorithm: str

    seed: int = Field(0, ge=0, description="Master seed: actors, envs and the learner derive theirs from it.")
    total_env_steps: int = Field(400_000, gt=0, description="Stop after this many env steps (all actors together).")
    num_actors: int = Field(2, ge=1, description="Ray rollout actors.")
    envs_per_actor: int = Field(8, ge=1, description="Envs stepped as a vector inside each actor.")
    rollout_length: int = Field(32, ge=2, description="Steps per trajectory batch (time dimension T).")
    max_batches_in_flight: int = Field(
        4, ge=1, description="Back-pressure: at most this many batches requested and not yet consumed."
    )
    hidden_sizes: list[int] = Field([64, 64], min_length=1, description="MLP hidden layer widths (policy and value).")
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Learner device; auto picks CUDA when torch sees it."
    )


class AdaptiveConfig(Section):
    """An adaptive policy trained RMA-style: a privileged teacher, distilled into a history policy."""

    method: Literal["rma"] = Field(
        "rma",
        description="rma: train a sim-only teacher that also sees the episode's sampled domain parameters "
        "(normalized to [-1, 1] over the train ranges), then distill it DAgger-style into a policy that "
        "sees only the observation and its last `history_length` (observation, sent action) pairs.",
    )
    history_length: int = Field(8, ge=1, le=64, description="The student's history: past (observation, action) pairs.")
    distill_steps: int = Field(
        100_000,
        gt=0,
        description="Env steps of student rollouts for distillation, out of train.total_env_steps "
        "(the teacher gets the rest).",
    )
    distill_lr: float = Field(1e-3, gt=0, description="Adam learning rate of the student's regression.")
    distill_epochs: int = Field(4, ge=1, description="Passes over the aggregated dataset after each rollout batch.")
    action_noise: float = Field(
        0.1, ge=0, description="Std of the student's exploration noise while it collects states (normalized units)."
    )


class VtraceTrainConfig(TrainCommon):
    """What IMPALA and APPO share: V-trace targets, on-policy actors with a bounded policy lag, validation.

    The defaults of `lr`, `lr_schedule`, `batches_per_update`, `num_epochs`, `num_minibatches` (and APPO's
    `clip_param`) are the settings every shipped plant trains with, so a declared plant that sets no `train:`
    key starts from what learned there. One Adam step of 3e-4 per batch (the IMPALA paper's single pass) left a
    gravity-loaded arm's policy where it started over 200k steps; four passes in four minibatches learn it.
    """

    sync: bool = Field(
        False, description="Actors wait for fresh weights after every batch (policy lag 0), for comparison."
    )
    batches_per_update: int = Field(
        2, ge=1, description="Actor batches stacked into one learner update (sync mode: all actors' batches)."
    )
    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    lr_schedule: Literal["constant", "linear"] = Field(
        "linear",
        description="linear: anneal the learning rate toward "
        "5% of `lr` at total_env_steps, so late updates refine instead of unlearning.",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    value_coef: float = Field(0.5, ge=0, description="Value loss weight.")
    clip_rho_threshold: float = Field(1.0, gt=0, description="V-trace rho-bar (value targets).")
    clip_pg_rho_threshold: float = Field(1.0, gt=0, description="V-trace rho-bar for policy-gradient advantages.")
    num_epochs: int = Field(4, ge=1, description="Passes of SGD over each batch.")
    num_minibatches: int = Field(
        4, ge=1, description="Adam steps per epoch; minibatches split the env axis (whole traces)."
    )
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip.")
    checkpoint_every: int = Field(
        50, ge=1, description="Write an atomic checkpoint every N learner updates (and at the end)."
    )
    log_std_init: float = Field(-0.5, description="Initial log standard deviation of the Gaussian policy.")
    history_length: int = Field(
        0,
        ge=0,
        le=64,
        description="Past (observation, sent action) pairs the policy sees besides the "
        "current observation (implicit system identification, RMA-style); 0: memoryless MLP. "
        "The exported ONNX graph then takes a `history` input and the edge keeps one history per plant.",
    )
    adr: AdrConfig = Field(default_factory=AdrConfig, description="Automatic domain randomization of the `train` set.")
    adaptive: AdaptiveConfig | None = Field(
        None,
        description="Train an adaptive policy (train.adaptive.method) instead of a plain one; unset: off. "
        "Export, eval and shadow take it like any history policy.",
    )

    @model_validator(mode="after")
    def _adaptive_fits(self):
        if self.adaptive is not None:
            if self.history_length:
                raise ValueError("train.history_length must be 0 with train.adaptive (set adaptive.history_length)")
            if self.adaptive.distill_steps >= self.total_env_steps:
                raise ValueError(
                    f"train.adaptive.distill_steps ({self.adaptive.distill_steps}) must be below "
                    f"train.total_env_steps ({self.total_env_steps}): the teacher trains on the rest"
                )
        return self


class ImpalaTrainConfig(VtraceTrainConfig):
    """IMPALA: V-trace actor-critic, on-policy actors with a bounded policy lag."""

    algorithm: Literal["impala"] = Field(description="impala: V-trace actor-critic.")


class AppoTrainConfig(VtraceTrainConfig):
    """APPO: V-trace targets and PPO's clipped surrogate (the default)."""

    algorithm: Literal["appo"] = Field("appo", description="appo: V-trace targets + clipped surrogate.")
    clip_param: float = Field(0.3, gt=0, description="APPO surrogate clip epsilon.")
    kl_coef: float = Field(
        0.0, ge=0, description="APPO: weight of the KL(behaviour || current) penalty; 0 disables it."
    )


class SacTrainConfig(TrainCommon):
    """SAC, Ape-X exploring actors, sharded prioritized replay; export takes the best checkpoint on validation."""

    algorithm: Literal["sac"] = Field(description="sac: off-policy soft actor-critic (train.sac, train.replay).")
    sac: SacConfig = Field(default_factory=SacConfig, description="SAC learner settings.")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="Replay settings.")


class Td3TrainConfig(TrainCommon):
    """TD3, Ape-X exploring actors, sharded prioritized replay; export takes the best checkpoint on validation."""

    algorithm: Literal["td3"] = Field(description="td3: off-policy twin delayed DDPG (train.td3, train.replay).")
    td3: Td3Config = Field(default_factory=Td3Config, description="TD3 learner settings.")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="Replay settings.")


# `train:` is one of these, chosen by `train.algorithm` (default appo); each refuses a key it would not read.
# pipeline/training/algorithms.py maps every `algorithm` to its learner (a test holds the two equal).
TRAIN_CONFIGS: tuple[type[TrainCommon], ...] = (AppoTrainConfig, ImpalaTrainConfig, SacTrainConfig, Td3TrainConfig)
DEFAULT_ALGORITHM = "appo"


def _tag(model: type[TrainCommon]) -> str:
    return get_args(model.model_fields["algorithm"].annotation)[0]


def _algorithm_of(value: Any) -> str:
    return (
        value.get("algorithm", DEFAULT_ALGORITHM)
        if isinstance(value, dict)
        else getattr(value, "algorithm", DEFAULT_ALGORITHM)
    )


if TYPE_CHECKING:  # the checker sees what every member has in common
    TrainConfig = TrainCommon
else:  # pydantic sees the union of the table's models, told apart by train.algorithm
    TrainConfig = Annotated[
        Union[tuple(Annotated[m, Tag(_tag(m))] for m in TRAIN_CONFIGS)],  # noqa: UP007 (built from the table)
        Discriminator(
            _algorithm_of, custom_error_type="train_algorithm", custom_error_message="unknown train.algorithm"
        ),
    ]
ALGORITHM_NAMES: tuple[str, ...] = tuple(_tag(m) for m in TRAIN_CONFIGS)


class ValidationConfig(Section):
    """Model selection during training: the deterministic policy on the `validation` randomization set."""

    enabled: bool = Field(
        True, description="Evaluate during training; export takes the best checkpoint by validation return."
    )
    domains: str = Field(
        "validation", description="Randomization set evaluated (held apart from train's seeds and reality)."
    )
    every_updates: int = Field(
        20,
        ge=1,
        description="Submit an evaluation every N learner updates (one in flight at a time; "
        "the learner does not wait for it except with train.sync). Off-policy algorithms (sac, td3) step "
        "their learner once per minibatch: for them N counts metrics records (train.<algorithm>.log_every "
        "learner steps each).",
    )
    episodes: int = Field(8, ge=1, description="Episodes per evaluation, stepped together as one batch.")
    seed: int = Field(
        2000, ge=0, description="First episode seed of every evaluation (the same seeds each time, so returns compare)."
    )
    patience: int = Field(
        0, ge=0, description="Stop training after this many evaluations without a new best (0: never stop early)."
    )
    min_improvement: float = Field(
        0.0, ge=0, description="A new best must beat the old one by more than this (return units)."
    )


class RayConfig(Section):
    """Where Ray runs and what each part asks of it."""

    address: str | None = Field(
        None, description="Ray cluster address; None starts a local instance (RAY_ADDRESS overrides)."
    )
    actor_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per rollout actor.")
    max_actor_restarts: int = Field(3, ge=0, description="Ray restarts a dead rollout actor up to this many times.")


class ShieldConfig(Section):
    """The CBF safety shield around the policy (built into the bundle's shield.json)."""

    enabled: bool = Field(True, description="Wrap the policy in the CBF shield when evaluating and serving.")
    gain: float = Field(
        0.3,
        gt=0,
        le=1,
        description="Default discrete-time class-K gain: h(x+) >= (1 - gain) h(x); larger lets the plant approach a "
        "boundary faster.",
    )
    gains: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(
        {}, description="Per-constraint gain overrides, by constraint name (each in (0, 1])."
    )
    margin: float | None = Field(
        None,
        ge=0,
        description="Safety margin in each constraint's units (m for positions), covering model error and sensor "
        "noise. "
        "None: synthesized (sim2real shield synthesize); set, synthesis checks it covers what it measures.",
    )
    brake_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of the nominal full-action deceleration the braking-distance barrier counts on; the rest "
        "absorbs mass, gain and disturbance mismatch. "
        "None (and no brake_accel): the braking each constraint measurably has, synthesized.",
    )
    input_gain_error: float | None = Field(
        None,
        ge=0,
        lt=0.9,
        description="Relative error of the input's effect (actuator gain over mass) the CBF conditions hold for: (1 "
        "+- this) x nominal. "
        "None: synthesized from the measured input-gain range (low/high in the certificate).",
    )
    brake_accel: (
        list[
            Annotated[float, Field(gt=0)]
            | Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=2, max_length=2)]
        ]
        | None
    ) = Field(
        None,
        description="Braking acceleration per position of the task's kinematics (units/s^2), each a number or [toward "
        "-, toward +] where the plant brakes harder one way: the acceleration it can make toward each side, so the "
        "first brakes a motion toward + (gravity helps a quadrotor brake a climb: its first is the larger), as "
        "`shield synthesize` prints it; overrides brake_fraction.",
    )
    keepout_steering: bool = Field(
        True,
        description="Keep-out zones (cylinders, spheres) credit the plant's sideways speed: it may pass a zone "
        "rather than stop before it (shield/barrier.py). Needs each axis's authority to brake and hold against the "
        "disturbance at once (checked).",
    )
    disturbance_accel: list[Annotated[float, Field(ge=0)]] | None = Field(
        None,
        description="Bound on an unknown additive acceleration per position (units/s^2: wind, gravity-compensation "
        "error, the linear model's error) the conditions are robust to; None: synthesized from the "
        "measured model error.",
    )
    latency_steps: int | None = Field(
        None,
        ge=0,
        description="Control steps of actuation latency the shield predicts through; None: the largest latency_steps "
        "of every randomization set.",
    )
    latency_min_steps: int | None = Field(
        None,
        ge=0,
        description="The fewest latency steps the plant may have: every latency from it to latency_steps is a case of "
        "the shield's prediction (more conservative, a little more compute per case). None: the fewest "
        "any randomization set admits (a set without latency_steps admits 0).",
    )
    ambient_disturbance_accel: list[Annotated[float, Field(ge=0)]] | None = Field(
        None,
        description="Additive acceleration per position (units/s^2) present in every domain that no randomization set "
        "states (e.g. the quadrotor's built-in wind); counted in the envelope check.",
    )
    model_ranges: dict[str, Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=2, max_length=2)]] = Field(
        {},
        description="Ranges [low, high] of randomized parameters the envelope check cannot derive (damping, friction, "
        "armature: `joint_damping.<joint>`, `geom_friction.<geom>`, `joint_armature.<joint>`; `gravity_scale` for a "
        "linear or declared double-integrator model), for which the guarantee was established by falsification; a set "
        "outside them is refused, and so is a key no set randomizes.",
    )
    synthesis_samples: int = Field(
        4000,
        ge=100,
        description="States x actions per randomization set at which synthesis measures the nominal model's error "
        "(more: a tighter confidence on the bound).",
    )
    train_in_loop: bool = Field(False, description="Train with the shield filtering the actions the env receives.")
    intervention_penalty: float = Field(
        0.0, ge=0, description="Reward subtracted on each step the shield changes the action (training in the loop)."
    )
    train_margin: float | None = Field(
        None,
        ge=0,
        description="Margin of the shield in the training loop and in model selection (train_in_loop); None: `margin`. "
        "Wider than `margin`, the policy learns to keep that clearance itself, so the deployed shield seldom has to "
        "act.",
    )


# The retrain flow's episode seeds: night n (version n) uses the block starting at shadow.seed + (n - 1) * this.
# A gate that looks at the same plants every night keeps promoting whichever candidates happen to suit those plants;
# a fresh block each night makes every night's confidence its own. Blocks never overlap: max_episodes is well
# under the stride.
NIGHT_SEED_STRIDE = 1_000_000
# One more lost episode in fifty than legacy, at most: tight enough that the mean return cannot hide a pole dropped
# now and then (a loss costs the cart-pole ~370 of its ~450), loose enough to decide within a few hundred episodes.
LOST_RATE_TOLERANCE = 0.02


class GateConfig(Section):
    """Promotion gate: paired statistical decisions against legacy and production, and safety checks
    (pipeline/evaluation/gate.py, pipeline/evaluation/gate_statistics.py)."""

    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        description="One-sided confidence of every bound the gate decides on "
        "(paired return differences, rate bounds), over all its sequential looks together. Below 0.95 the "
        "report and the verdict name it as loosened.",
    )
    min_return_ratio: float = Field(
        1.0,
        gt=0,
        description="Against legacy: the lower confidence bound on the mean paired "
        "return difference (candidate - legacy, same seeds and domains) must exceed "
        "(x - 1)|R_l|, R_l legacy's mean return. 1.0: no worse than legacy (equal is not "
        "enough); below 1 allows a margin, which the report names as loosened by this key.",
    )
    min_return_ratio_production: float = Field(
        1.0,
        gt=0,
        description="The same rule against the production version "
        "(run in the same paired episodes); a candidate that does not clear it "
        "is registered but production is kept.",
    )
    max_episodes: int = Field(
        320,
        ge=1,
        le=NIGHT_SEED_STRIDE // 10,
        description="Episode budget per policy: shadow.episodes, then the sample doubled at each look (10, 20, "
        "40, ..), until every bound decides or this many ran; still undecided is `inconclusive`. A lost-episode "
        "bound needs a few hundred (gate.max_lost_rate_increase); a decided gate stops early.",
    )
    min_episodes: int = Field(
        20,
        ge=2,
        description="Fewest paired episodes a return comparison may pass on (it may fail "
        "on fewer): a skew of the returns the sample has not yet shown cannot be corrected for. Below 20 the "
        "report and the verdict name it as loosened.",
    )
    max_seconds: float | None = Field(
        None,
        gt=0,
        description="Wall-clock budget of the sequential evaluation (s); no "
        "batch starts that would likely end past it. None: the episode budget only.",
    )
    max_lost_rate_increase: float = Field(
        LOST_RATE_TOLERANCE,
        ge=0,
        le=1,
        description="Most the share of episodes the candidate loses may exceed legacy's, on the same episodes; an "
        "episode is lost when the task ends it early (a dropped pole, a crash) or it leaves the safe set. The exact "
        "upper bound on the difference of the two rates must be at most this at gate.confidence. With none lost "
        "that takes ln(alpha / 2) / ln(1 - x) episodes (at 0.02, 95 % and 6 looks: 270), so gate.max_episodes must "
        f"allow it. Above {LOST_RATE_TOLERANCE} the report names it as loosened; 1 turns the check off. A task that "
        "cannot end an episode early passes it while the candidate loses none.",
    )
    max_violations: int = Field(
        0,
        ge=0,
        description="Most constraint-violating steps (info cost) allowed for the candidate driving, all episodes "
        "together (an absolute count, not a rate).",
    )
    max_intervention_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Largest share of steps the shield may change the "
        "candidate's action, judged on its exact upper confidence bound (gate.confidence).",
    )
    max_latency_p99_us: float | None = Field(
        None,
        gt=0,
        description="Candidate per-action latency p99 (policy + shield), microseconds; "
        "the worse of the shadow and counterfactual passes. Default: a tenth of the task's control period "
        "(2000 us at 50 Hz, 200 us at 500 Hz), so the policy and shield leave the loop most of its period. "
        "A pass run on this machine is judged on the acting thread's CPU time (what the policy and shield cost; "
        "a shared machine's wall clock also measures its other work), a field log on its logged wall clock; "
        "the wall-clock p99 is reported beside it.",
    )
    waive: list[str] = Field(
        [],
        description="Checks (by key, e.g. gate.min_return_ratio) a decision may pass without; any other check that "
        "could not run makes the decision `inconclusive`.",
    )
    max_falsification_cases: int = Field(
        0,
        ge=0,
        description="Shielded violations `falsify` may find before the gate fails (the flow runs it before the gate).",
    )


class FalsifyConfig(Section):
    """`sim2real falsify`: the search for a shielded violation inside the config's envelope (a gate step)."""

    candidates: int = Field(
        600,
        gt=0,
        validation_alias=AliasChoices("candidates", "max_candidates", "certify_candidates"),
        description="Candidates one search evaluates: the retrain flow's before its gate, `sim2real falsify`'s and "
        "`shield synthesize`'s before it certifies. A count, not a clock: for a seed, the same search and verdict on "
        "any machine however loaded, only slower on a busy one (a clock's budget searches less the busier the "
        "machine). About a minute at most per shipped plant on a quiet core. (Read as well under its earlier names, "
        "max_candidates and certify_candidates.)",
    )
    budget_s: float | None = Field(
        None,
        gt=0,
        description="An optional wall-clock cap (s) on the retrain flow's and `sim2real falsify`'s search: it ends at "
        "whichever of this and `candidates` comes first, and the gate's line and the summary say when the clock cut "
        "it short. Unset (the default), the verdict does not depend on how busy the machine is. `shield synthesize` "
        "does not read it (its --budget-s caps its search, and its certificate then says so).",
    )
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the search (which corners, draws and episodes); the retrain flow's night N searches "
        "from seed + N - 1.",
    )
    episode_steps: int | None = Field(
        None,
        gt=0,
        description="Steps per searched episode (default: the plant's own episode, plant.episode_steps or "
        "task.max_episode_steps): shorter ones search faster, and miss a violation that takes "
        "longer to build up (a slow plant driven into a corner).",
    )
    episodes_per_candidate: int = Field(
        2, ge=1, description="Episodes (seeds) run for each searched domain and attack."
    )
    corner_share: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Share of the candidates spent on corners (each range at one end, times the policies tried), "
        "drawn at random once there are more than that share can run; every corner runs while they number at most "
        "half of `candidates`. A tenth goes to random draws, the rest to the optimizer.",
    )


class ShadowConfig(Section):
    """Shadow-mode evaluation beside the legacy controller."""

    episodes: int = Field(
        10,
        ge=1,
        description="Episodes per batch of every pass (shadow, counterfactual, production); the "
        "gate looks after each batch, up to gate.max_episodes.",
    )
    domains: str = Field("reality", description="Randomization set name (or YAML file) the shadow passes run on.")
    agreement_tolerance: float = Field(
        0.1, gt=0, description="Actions agree when every |legacy - candidate| <= this (normalized units)."
    )
    seed: int = Field(
        1000,
        ge=0,
        description="First episode seed of `sim2real shadow` and of the retrain flow's first night; held out from "
        "training seeds. Night n of the flow (the candidate it registers as version n) starts at "
        f"seed + (n - 1) * {NIGHT_SEED_STRIDE}: fresh plants every night, so no night's decision rests on the "
        "plants an earlier night's candidate was chosen on.",
    )


class CalibrationConfig(Section):
    """Real-to-sim calibration from field logs (`sim2real calibrate`, `sim2real run --from-log`)."""

    known: dict[str, Annotated[float, Field(gt=0)]] = Field(
        {},
        description="Scales measured on the bench, by parameter name (e.g. joint_damping.slider: 1.2 from the "
        "motor's back-EMF constant): held fixed. Kinematic logs only pin ratios of masses, dampings "
        "and gains; one known force-unit parameter fixes their common scale.",
    )
    horizon_steps: int = Field(
        15,
        ge=2,
        le=200,
        description="Control steps per prediction window (keep it shorter than the plant's open-loop divergence time).",
    )
    min_log_seconds: float = Field(10.0, gt=0, description="Shortest usable log, s of control.")


# Float `train.*` keys a restart from a checkpoint does not honour: they set only the initial state (the
# checkpoint's weights and temperature win) or a resource reservation, so searching them would search nothing.
NOT_SEARCHABLE = frozenset({"log_std_init", "adr.start_fraction", "sac.init_temperature", "replay.shard_num_cpus"})


def searchable_keys(train_model: type[BaseModel], prefix: str = "") -> list[str]:
    """The `train.*` keys `tune.searchable` may name for one algorithm's `train:` model: its float fields
    (nested sections' as `section.key`), less NOT_SEARCHABLE."""
    keys = []
    for name, field in train_model.model_fields.items():
        sub, _ = _submodel(field.annotation)
        if sub is not None:
            keys += searchable_keys(sub, f"{prefix}{name}.")
        elif float in (field.annotation, *get_args(field.annotation)) and prefix + name not in NOT_SEARCHABLE:
            keys.append(prefix + name)
    return keys


class SearchRange(Section):
    """The range a population search draws and perturbs one hyperparameter in."""

    low: float = Field(description="Smallest value tried.")
    high: float = Field(description="Largest value tried (perturbations are clipped to [low, high]).")
    log: bool = Field(False, description="Draw uniformly in log space (learning rates, coefficients spanning decades).")

    @model_validator(mode="after")
    def _ordered(self) -> SearchRange:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0, got {self.low}")
        return self


class TuneConfig(Section):
    """`sim2real tune`: population-based training (Ray Tune's PBT) over the `train:` hyperparameters named here."""

    population: int = Field(4, ge=2, description="Members trained at once (each a full training run on Ray).")
    perturbation_interval: int = Field(
        4,
        ge=1,
        description="Reports between a member's exploit/explore steps (a member reports its latest validation "
        "return and a checkpoint every validation.every_updates learner updates).",
    )
    quantile_fraction: float = Field(
        0.25,
        gt=0,
        le=0.5,
        description="Members in this bottom share (by validation return) copy one of the top share's checkpoint.",
    )
    resample_probability: float = Field(
        0.25,
        ge=0,
        le=1,
        description="On explore, redraw a hyperparameter from its range with this probability, else scale it by "
        "0.8 or 1.2.",
    )
    budget_s: float | None = Field(
        None, gt=0, description="Wall-clock budget of the whole search (s); None: until every member's budget is spent."
    )
    max_failures: int = Field(
        2, ge=0, description="Times a member whose process dies is restarted from its last checkpoint."
    )
    searchable: dict[str, SearchRange] = Field(
        default_factory=dict,
        description="The `train.*` keys the search explores, by key (e.g. lr, entropy_coef): float hyperparameters "
        "the chosen train.algorithm reads.",
    )


class Config(Section):
    """A task config: everything the CLI and the flows need for one task."""

    task: TaskConfig
    plant: dict[str, Any] | None = Field(
        None,
        description="The task declared as data beside its MJCF (format: envs/declaration.py); absent for a task whose "
        "parts must stay code (the quadrotor).",
    )
    randomization: dict[str, RandomizationSet] = Field(
        description="Named domain-randomization sets; `train` is used for training, `reality` is held out for shadow "
        "evaluation."
    )
    train: TrainConfig = Field(
        default_factory=AppoTrainConfig, description="Training: the algorithm and what it reads."
    )
    ray: RayConfig = RayConfig()
    shield: ShieldConfig = ShieldConfig()
    gate: GateConfig = GateConfig()
    shadow: ShadowConfig = ShadowConfig()
    falsify: FalsifyConfig = FalsifyConfig()
    validation: ValidationConfig = ValidationConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    tune: TuneConfig = TuneConfig()

    @model_validator(mode="after")
    def _needs_train_and_reality(self) -> Config:
        missing = [name for name in ("train", "reality") if name not in self.randomization]
        if missing:
            raise ValueError(f"randomization: missing set(s) {missing}; both 'train' and 'reality' are required")
        if self.validation.enabled and self.validation.domains not in self.randomization:
            raise ValueError(
                f"validation.domains: no randomization set {self.validation.domains!r} "
                f"(have {sorted(self.randomization)}); add it or set validation.enabled: false"
            )
        if self.validation.enabled and self.validation.domains == self.shadow.domains:
            raise ValueError(
                f"validation.domains: {self.validation.domains!r} is the gate's held-out set (shadow.domains); "
                f"selecting a model on it would leak the gate's domains into training"
            )
        return self

    @model_validator(mode="after")
    def _tune_searches_what_train_reads(self) -> Config:
        readable = searchable_keys(type(self.train))  # the chosen algorithm's model: its row of the table
        for key in self.tune.searchable:
            if key not in readable:
                known = any(key in searchable_keys(m) for m in TRAIN_CONFIGS)
                why = f"not read by train.algorithm {self.train.algorithm!r}" if known else "not a searchable train key"
                raise ValueError(f"tune.searchable.{key}: {why}; searchable: {', '.join(readable)}")
        return self

    def observation_names(self, indices) -> list[str]:
        """The declared name of each observation index (`obs[i]` where the plant declares none: a code task)."""
        obs = (self.plant or {}).get("observations") or []
        return [
            obs[o]["name"] if o < len(obs) and isinstance(obs[o], dict) and "name" in obs[o] else f"obs[{o}]"
            for o in indices
        ]

    def action_names(self, act_dim: int) -> list[str]:
        """The declared name of each action (its actuator's; `action[j]` where the plant declares none)."""
        acts = (self.plant or {}).get("actuators") or []
        return [
            acts[j]["name"] if j < len(acts) and isinstance(acts[j], dict) and "name" in acts[j] else f"action[{j}]"
            for j in range(act_dim)
        ]

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the validated config (identifies a training setup).

        A declared plant's MJCF enters by name and content (sha256 of its bytes), not by the
        absolute path `load_config` resolved, so the hash is the same wherever the checkout lives
        and changes when the MJCF does.
        """
        data = self.model_dump(mode="json")
        data.pop("tune")  # how a search is run is not the setup of a run: a member's hyperparameters are in train
        plant = data.get("plant")
        if isinstance(plant, dict) and isinstance(plant.get("mjcf"), str):
            from envs.declaration import mjcf_identity

            plant["mjcf"] = mjcf_identity(plant["mjcf"])
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        msg = e["msg"]
        if loc[:1] == ["train"] and len(loc) > 1 and loc[1] in ALGORITHM_NAMES:
            algorithm = loc.pop(1)  # the union's tag: the user wrote train.<key>, not train.<algorithm>.<key>
            if (
                e["type"] == "extra_forbidden"
                and len(loc) == 2
                and any(loc[1] in m.model_fields for m in TRAIN_CONFIGS)
            ):
                msg = (
                    f"not read by train.algorithm {algorithm!r}; remove it (`sim2real config` lists what each "
                    f"algorithm reads)"
                )
        if e["type"] == "train_algorithm":
            loc, msg = (
                ["train", "algorithm"],
                f"unknown algorithm {_algorithm_of(e['input'])!r}; one of {', '.join(ALGORITHM_NAMES)}",
            )
        elif e["type"] == "extra_forbidden" and not msg.startswith("not read"):
            msg = "unknown key"
        elif e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        path = ".".join(loc)
        lines.append(f"  {path}: {msg}" if path else f"  {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<dict>") -> Config:
    """Validate a config mapping; raise ConfigError naming every bad key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def _check_task(cfg: Config, path: Path) -> None:
    """The task must be registered (a code task, or the `plant:` this file declares, checked against its MJCF)."""
    import envs
    from envs.declaration import DeclarationError

    try:
        if cfg.plant is not None:
            spec = envs.check_task_file(path)
            if spec.env_id != cfg.task.env_id or spec.name != cfg.task.name:
                raise DeclarationError(
                    f"task: {cfg.task.name}/{cfg.task.env_id} differs from the declared {spec.name}/{spec.env_id}"
                )
        elif cfg.task.env_id.startswith("sim2real/"):
            envs.task(cfg.task.env_id)  # any other id is a plain gymnasium env, trainable by id
    except (DeclarationError, envs.UnknownTaskError) as err:
        raise ConfigError(f"invalid config {path}:\n  {err}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate `configs/<task>.yaml`. The default config (`pipeline.DEFAULT_CONFIG`), given relative to
    a working directory that has no `configs/`, is the shipped one (the checkout's, or an install's copy): a command
    run outside the checkout with no --config otherwise failed on a file `sim2real envs` lists."""
    from pipeline import DEFAULT_CONFIG

    path = Path(path)
    if str(path) == DEFAULT_CONFIG and not path.exists():
        from envs.registry import config_dirs

        path = next((d / path.name for d in config_dirs() if (d / path.name).is_file()), path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    if isinstance(data, dict) and isinstance(data.get("plant"), dict) and isinstance(data["plant"].get("mjcf"), str):
        # Absolute, so the copy a training run keeps (runs/<run>/config.yaml) still finds the MJCF.
        data["plant"]["mjcf"] = str((path.parent / data["plant"]["mjcf"]).resolve())
    cfg = parse_config(data, str(path))
    _check_task(cfg, path)
    return cfg


def _submodel(annotation) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds, directly, optionally, in a list ('[]') or in a dict by name ('.<name>')."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1], ".<>"
    for arg in args:  # X | None
        sub, suffix = _submodel(arg)
        if sub is not None:
            return sub, suffix
    return None, ""


def type_name(annotation) -> str:
    """A field's type as a reader of the YAML sees it: `float`, `list[str]`, `'box' | 'halfspace'`, `section`."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return "section" if issubclass(annotation, BaseModel) else annotation.__name__
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Annotated:
        return type_name(args[0])
    if args and origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if args:  # a union
        return " | ".join(type_name(a) for a in args)
    return str(annotation)


# What the keys of a map of sections name, for the reference: randomization.<set>.body_mass.<body>.low
_KEY_NAMES = {
    "randomization": "set",
    "body_mass": "body",
    "geom_friction": "geom",
    "joint_damping": "joint",
    "joint_stiffness": "joint",
    "joint_armature": "joint",
    "tendon_stiffness": "tendon",
    "actuator_gain": "actuator",
    "targets": "target",
}


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every config field, for `sim2real config` and the reference docs.

    A section's keys follow it (`train.sac.tau`); a list of sections is written `plant.observations[].joint`,
    a map of named ones `randomization.<name>.body_mass`. The `plant:` section is the declaration's schema
    (envs.declaration.PlantDeclaration). `train:` lists every algorithm's keys once, each marked with the
    algorithms that read it when not all do.
    """
    rows: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        members = [get_args(a)[0] if get_origin(a) is Annotated else a for a in get_args(field.annotation)]
        variants = [a for a in members if isinstance(a, type) and issubclass(a, TrainCommon)]
        if variants:  # the union train.algorithm picks from
            rows.append(
                (
                    key,
                    "section",
                    "",
                    f"{field.description} One of: "
                    + "; ".join(f"{_tag(m)}: {(m.__doc__ or '').strip()}" for m in variants),
                )
            )
            rows.extend(_train_rows(variants, key + "."))
            continue
        annotation = PlantDeclaration | None if (model is Config and name == "plant") else field.annotation
        sub, suffix = _submodel(annotation)
        if sub is not None:
            kind = {"": "section", "[]": "list of sections", ".<>": "sections by name"}[suffix]
            suffix = suffix.replace("<>", f"<{_KEY_NAMES.get(name, 'name')}>")
            rows.append((key, kind, "", field.description or (sub.__doc__ or "").strip().splitlines()[0]))
            rows.extend(describe_fields(sub, key + suffix + "."))
        else:
            default = "" if field.is_required() else repr(field.get_default(call_default_factory=True))
            rows.append((key, type_name(annotation), default, field.description or ""))
    return rows


def _train_rows(variants: list[type[TrainCommon]], prefix: str) -> list[tuple[str, str, str, str]]:
    """Every algorithm's `train.*` rows, each key once, with the algorithms that read it when not all do."""
    readers: dict[str, list[str]] = {}
    described: dict[str, tuple[str, str, str, str]] = {}
    for m in variants:
        for row in describe_fields(m, prefix):
            if row[0] == prefix + "algorithm":
                names = [_tag(v) for v in variants]
                row = (
                    row[0],
                    " | ".join(map(repr, names)),
                    repr(DEFAULT_ALGORITHM),
                    "One of " + ", ".join(names) + ".",
                )
            described.setdefault(row[0], row)
            readers.setdefault(row[0], []).append(_tag(m))
    order = sorted(described, key=lambda k: k != prefix + "algorithm")  # the key that picks the others first
    return [
        (k, t, v, d if len(readers[k]) == len(variants) or k.count(".") > 1 else f"{d} ({', '.join(readers[k])} only)")
        for k, t, v, d in (described[k] for k in order)
    ]
