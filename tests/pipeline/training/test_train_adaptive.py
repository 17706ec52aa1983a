"""The adaptive (RMA-style) route: a teacher that sees the plant, a history student distilled from it.

Real MuJoCo envs and torch; the distillation runs in-process on a few thousand steps. The end-to-end
test trains a tiny teacher on real Ray, distills, exports to ONNX (history state, parity checked inside
export) and repeats the run to show a seed fixes it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray
import torch
from torch import nn

from pipeline.config import AdaptiveConfig, ConfigError, load_config, parse_config
from pipeline.deployment.export import export_policy
from pipeline.training.adaptive import Dataset, action_error, calibrate_estimate, distill, episode_ids
from pipeline.training.checkpoint import best_checkpoint, latest_checkpoint, read_checkpoint
from pipeline.training.model import ActorCritic, DeterministicPolicy
from pipeline.training.rollout import RolloutActor, make_env
from pipeline.training.scaffold import model_spec_for
from pipeline.training.train import train
from shield.bundle import Bundle

OBS_DIM = 5


def cartpole(**adaptive):
    cfg = load_config("configs/cartpole.yaml")
    t = cfg.train
    t.sync, t.seed, t.envs_per_actor, t.rollout_length = True, 7, 4, 16
    t.adaptive = AdaptiveConfig(**adaptive)
    cfg.validation.every_updates, cfg.validation.episodes = 2, 3
    return cfg


def pinned(cfg, cart_mass: float, latency: int) -> dict:
    """The train set with the cart's mass and the latency pinned (the rest still drawn)."""
    doc = cfg.randomization["train"].model_dump(mode="json")
    doc["body_mass"]["cart"].update(low=cart_mass, high=cart_mass)
    doc["latency_steps"] = {"low": latency, "high": latency}
    return doc


def test_the_teacher_sees_the_sampled_parameters_beside_the_same_state():
    cfg = cartpole()
    train_set = cfg.randomization["train"].model_dump(mode="json")
    light, heavy = (
        make_env(cfg.task.env_id, pinned(cfg, mass, lat), privileged=train_set) for mass, lat in ((0.8, 0), (1.35, 3))
    )
    (a, _), (b, _) = light.reset(seed=3), heavy.reset(seed=3)
    assert a.shape == b.shape == light.observation_space.shape and a.shape[0] > OBS_DIM
    np.testing.assert_array_equal(a[:OBS_DIM], b[:OBS_DIM])  # the same state, the same plant observation
    assert not np.allclose(a[OBS_DIM:], b[OBS_DIM:])  # and what the teacher sees tells the plants apart
    assert np.all(np.abs(a[OBS_DIM:]) <= 1.0) and np.all(np.abs(b[OBS_DIM:]) <= 1.0)  # normalized over train
    spec, _ = model_spec_for(cfg, privileged=train_set)
    assert spec["obs_dim"] == a.shape[0]
    # The rollout exposes them too: one vector per episode, beside the policy's own observation.
    actor = RolloutActor(0, cfg.task.env_id, train_set, None, 3, 8, 0, model_spec_for(cfg, 2)[0], privileged=train_set)
    batch = actor.rollout()
    assert batch["obs"].shape[-1] == OBS_DIM + 2 * (OBS_DIM + 1)
    assert batch["privileged"].shape == (9, 3, a.shape[0] - OBS_DIM)


class ParameterTeacher(nn.Module):
    """A teacher whose action depends on the plant: a fixed stabilizing feedback plus an offset set by the
    actuator gain and the latency, which only the history can reveal to the student."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        obs, params = x[:, :OBS_DIM], x[:, OBS_DIM:]
        feedback = obs @ torch.tensor([0.6, 4.0, 0.6, 0.8, -0.6])
        return torch.clamp(feedback[:, None] + 0.15 * params[:, -2:-1] + 0.1 * params[:, -1:], -1.0, 1.0)


def test_distillation_brings_the_student_to_the_teacher_on_held_out_rollouts(tmp_path):
    cfg = cartpole(history_length=4, distill_steps=4000, distill_epochs=8)
    cfg.validation.enabled = False  # in-process only: the selection is the end-to-end test's
    cfg.task.max_episode_steps = 50  # many short episodes: many plants to learn from
    train_set = cfg.randomization["train"].model_dump(mode="json")
    teacher = ParameterTeacher()
    spec, _ = model_spec_for(cfg, 4)
    torch.manual_seed(cfg.train.seed)
    untrained = DeterministicPolicy(ActorCritic(**spec))
    student, _, figures = distill(cfg, tmp_path, teacher, train_set, progress=False)
    assert figures["env_steps"] >= 4000
    trained = DeterministicPolicy(student)
    # Held out: other episodes (another seed), driven by the trained student.
    held_out = RolloutActor(0, cfg.task.env_id, train_set, 50, 16, 50, 12345, student.spec(), privileged=train_set)
    held_out.set_weights(1, student.state_dict())
    batch = held_out.rollout()
    before, after = action_error(untrained, teacher, batch, OBS_DIM), action_error(trained, teacher, batch, OBS_DIM)
    assert after < 0.4 * before, (before, after)  # wrong labels would leave the error where it was
    # The student reads its history: the same states with the history wiped get worse answers (a student
    # blind to its history would answer the same). That it reads the plant out of it is the bench's to show.
    blind = dict(batch, obs=batch["obs"].copy())
    blind["obs"][..., OBS_DIM:] = 0.0
    assert action_error(trained, teacher, blind, OBS_DIM) > 1.15 * after


def test_the_student_reads_the_plants_latency_out_of_its_history_and_says_how_well(tmp_path):
    """The estimate head (exported as plant_estimate): trained on the teacher's privileged parameters, it must
    tell a 60 ms plant from an instant one on episodes it never saw, and its held-out R^2 (which the bundle's
    contract carries) must say which parameters it can read: here the latency, not the pinned masses."""
    cfg = cartpole(history_length=8, distill_steps=30_000)
    cfg.validation.enabled = False
    cfg.task.max_episode_steps = 50
    doc = cfg.randomization["train"].model_dump(mode="json")
    for group in ("body_mass", "joint_damping"):  # pinned: the actuator gain and the latency still vary
        for r in doc[group].values():
            r.update(low=1.0, high=1.0)
    student, _, _ = distill(cfg, tmp_path, ParameterTeacher(), doc, progress=False)
    assert [e[0] for e in student.spec()["estimates"]][-1] == "latency_steps"
    skill = {p["name"]: p["held_out_r2"] for p in json.loads((tmp_path / "estimate.json").read_text())["parameters"]}
    assert skill["body_mass.cart"] is None  # it did not vary: nothing to explain
    assert skill["latency_steps"] > 0.3, skill  # the mean of the range would score 0
    policy = DeterministicPolicy(student)
    guessed = {}
    for latency in (0, 3):
        plant = dict(doc, latency_steps={"low": latency, "high": latency})
        held_out = RolloutActor(0, cfg.task.env_id, plant, 50, 16, 50, 999, student.spec(), privileged=doc)
        held_out.set_weights(1, student.state_dict())
        x = held_out.rollout()["obs"][:-1].reshape(-1, student.input_dim)
        history = torch.from_numpy(x[:, OBS_DIM:]).reshape(len(x), 8, -1)
        with torch.no_grad():
            guessed[latency] = float(policy.plant_estimate(torch.from_numpy(x[:, :OBS_DIM]), history)[:, -1].mean())
    assert guessed[3] - guessed[0] > 1.0, guessed  # in control periods: a student blind to it answers the same


def test_the_recalibrated_estimate_of_a_parameter_the_head_cannot_see_stays_at_the_middle():
    """The head, fitted on few plants, is biased on one parameter and answers noise on another (what overfitting
    leaves); a third did not vary. Recalibrated on the even episodes (a point per plant) and scored on the odd
    ones, the first is corrected, the second held at the truths' mean (its raw R^2 is far below 0; recalibrated,
    about 0: no chance slope survives), and the third has no score."""
    rng = np.random.default_rng(0)
    plants, length = 400, 10
    episode = np.repeat(np.arange(plants), length)
    per_plant = np.stack([rng.uniform(-1, 1, plants), rng.uniform(-1, 1, plants), np.zeros(plants)], axis=1)
    truth = per_plant[episode].astype(np.float32)
    noise = rng.uniform(-1, 1, (plants * length, 1)).astype(np.float32)  # column 1: answers unrelated to the truth

    class Head:
        def encoded_estimate(self, x: torch.Tensor) -> torch.Tensor:
            seen = 0.5 * torch.from_numpy(truth[:, 0]) + 0.3  # biased and shrunk, but it sees the parameter
            return torch.stack([seen, x[:, 0], torch.zeros(len(x))], dim=1)

    result = calibrate_estimate(Head(), noise, truth, episode, ["seen", "unseen", "pinned"])
    rows = {r["name"]: r for r in result["parameters"]}
    assert result["plants"] == plants
    assert rows["seen"]["held_out_r2"] > 0.99 and rows["seen"]["scale"] == pytest.approx(2.0, rel=0.01)
    raw = 1 - np.sum((truth[:, 1] - noise[:, 0]) ** 2) / np.sum((truth[:, 1] - truth[:, 1].mean()) ** 2)
    assert raw < -0.5 and rows["unseen"]["scale"] == 0.0 and -0.05 < rows["unseen"]["held_out_r2"] <= 0.0
    assert rows["pinned"]["held_out_r2"] is None and rows["pinned"]["offset"] == 0.0


def test_episodes_are_told_apart_by_their_sampled_parameters_across_batches():
    params = np.zeros((4, 2, 1))
    params[:, 0, 0] = [0.1, 0.1, 0.7, 0.7]  # env 0: a new episode at t = 2
    params[:, 1, 0] = 0.3
    ids, last, counter = episode_ids(params, None, 0)
    assert ids.reshape(4, 2).tolist() == [[1, 2], [1, 2], [3, 2], [3, 2]] and counter == 3
    more = np.full((2, 2, 1), 0.3)
    more[:, 0, 0] = 0.7  # env 0 goes on with its episode into the next batch; env 1 too
    ids, _, counter = episode_ids(more, last, counter)
    assert ids.reshape(2, 2).tolist() == [[3, 2], [3, 2]] and counter == 3


def test_the_aggregated_dataset_holds_every_batch_in_order_as_one_concatenation_would():
    rng = np.random.default_rng(3)
    dataset, xs, ys = Dataset(), [], []
    for n in [5, 1, 37, 0, 120, 3, 300]:  # growing past its first sizes, an empty batch among them
        x, y = rng.standard_normal((n, 4)).astype(np.float32), rng.integers(0, 9, (n, 2))
        xs.append(x)
        ys.append(y)
        got_x, got_y = dataset.extend(x, y)
        np.testing.assert_array_equal(got_x, np.concatenate(xs))
        np.testing.assert_array_equal(got_y, np.concatenate(ys))
        assert got_x.dtype == np.float32 and got_y.dtype == ys[0].dtype and dataset.rows == len(got_x)


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"method": "rma", "histroy_length": 4}, "train.adaptive.histroy_length"),
        ({"method": "gru"}, "train.adaptive.method"),
        ({"distill_steps": 10**9}, "train.adaptive.distill_steps"),
    ],
)
def test_the_config_refuses_a_bad_adaptive_key_by_name(bad, named):
    raw = load_config("configs/cartpole.yaml").model_dump(mode="json")
    raw["train"]["adaptive"] = bad
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_config(raw)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_a_seed_fixes_the_distillation(tmp_path):
    cfg = cartpole(history_length=3, distill_steps=512)
    cfg.validation.enabled = False
    train_set = cfg.randomization["train"].model_dump(mode="json")
    a, b = (distill(cfg, tmp_path / f"run{k}", ParameterTeacher(), train_set, progress=False)[0] for k in range(2))
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


@pytest.mark.timeout(300)
def test_an_adaptive_run_selects_its_student_on_validation_and_exports_a_history_policy(ray_local, tmp_path):
    cfg = cartpole(history_length=3, distill_steps=384)
    cfg.task.max_episode_steps = 100  # short validation episodes
    run = train(cfg, out_dir=tmp_path / "run", steps=1024, progress=False)
    best = read_checkpoint(best_checkpoint(run.run_dir))
    assert best["model_spec"]["history_length"] == 3 and best["model_spec"]["obs_dim"] == OBS_DIM
    selection = json.loads((tmp_path / "run" / "selection.json").read_text())
    assert selection["best"]["updates"] == best["updates"] == run.best_updates
    assert run.env_steps >= 1024  # the teacher's steps and the student's, both counted
    teacher = read_checkpoint(latest_checkpoint(tmp_path / "run" / "teacher"))
    assert teacher["model_spec"]["obs_dim"] > OBS_DIM  # the teacher saw the parameters, the student does not
    # Exported like any history policy: `history` in, `next_history` out, parity checked inside export.
    exported = export_policy(run.run_dir, out_dir=tmp_path / "bundle")
    assert exported["parity_max_abs_err"] < 1e-5 and exported["state_parity_max_abs_err"] < 1e-5
    assert Bundle.load(exported["bundle"]).manifest["history_length"] == 3
    # And the plant it believes it is on: an output of its own, each parameter named with its held-out R^2.
    stated = Bundle.load(exported["bundle"]).manifest["contract"]["plant_estimate"]["parameters"]
    assert [p["name"] for p in stated] == [e[0] for e in best["model_spec"]["estimates"]]
    assert all("held_out_r2" in p for p in stated) and exported["estimate_parity_max_rel_err"] <= 1e-4
