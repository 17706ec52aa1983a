"""The one episode runner: eval, shadow and the bench report the same figures; one domain resolver; gymnasium ids."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from pipeline.commands.eval import run as eval_cli
from pipeline.config import ConfigError, load_config
from pipeline.evaluation.episodes import DomainsError, resolve_domains, timed
from pipeline.evaluation.evaluate import evaluate
from pipeline.evaluation.shadow import evaluate_candidate, run_shadow
from shield.runtime import EdgeRuntime
from tests.helpers.cli_args import cli_args
from tests.helpers.shadow_candidates import CARTPOLE_CONFIG, cartpole_config, write_random_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_random_bundle(tmp_path_factory.mktemp("episodes") / "bundle", cartpole_config())


def test_eval_shadow_and_bench_report_identical_figures(bundle, capsys, tmp_path):
    """Same bundle, domains and seeds: `sim2real eval`, the shadow's counterfactual pass and bench_shield's
    `evaluate(cfg, EdgeRuntime.load(bundle, shield=False), shield=True)` agree to the last bit."""
    cfg = cartpole_config(episodes=3, max_episode_steps=120)
    short = tmp_path / "short.yaml"
    doc = yaml.safe_load(CARTPOLE_CONFIG.read_text())
    doc["task"]["max_episode_steps"] = 120
    short.write_text(yaml.safe_dump(doc, sort_keys=False))  # set order is draw order
    args = cli_args(
        "eval", bundle=str(bundle), config=str(short), domains="reality", episodes=3, seed=cfg.shadow.seed, json=True
    )
    assert eval_cli(args) == 0
    by_eval = json.loads(capsys.readouterr().out)
    _, cf, shadow = evaluate_candidate(EdgeRuntime.load(bundle), cfg, domains="reality")
    by_bench = evaluate(
        cfg, EdgeRuntime.load(bundle, shield=False), domains="reality", episodes=3, seed=cfg.shadow.seed, shield=True
    )
    assert shadow["seeds"] == by_eval["seeds"] == by_bench["seeds"] == [1000, 1001, 1002]
    assert shadow["candidate_returns"] == by_eval["returns"] == by_bench["returns"]
    assert shadow["candidate_violations"] == by_eval["violations"] == by_bench["violations"]
    assert shadow["candidate_intervention_rate"] == by_eval["intervention_rate"] == by_bench["intervention_rate"]
    assert shadow["candidate_steps"] == by_eval["steps"] == by_bench["steps"]
    assert len(set(by_eval["returns"])) == 3  # three different episodes: the comparison is not vacuous


def test_shadow_runs_on_nominal_domains_and_honours_shadow_domains(bundle, tmp_path):
    cfg = cartpole_config(episodes=1, max_episode_steps=50)
    cfg.gate.max_latency_p99_us = 1e6
    nominal = run_shadow(bundle, cfg, domains="nominal", report_dir=tmp_path / "nominal")
    assert nominal["metrics"]["domains"] == "nominal" and nominal["metrics"]["steps"] > 0
    cfg.shadow.domains = "train"
    assert run_shadow(bundle, cfg, report_dir=tmp_path / "default")["metrics"]["domains"] == "train"


def test_one_domain_resolver():
    cfg = cartpole_config()
    assert resolve_domains(cfg, "nominal") is None and resolve_domains(cfg, None) is None
    assert resolve_domains(cfg, "reality") is cfg.randomization["reality"]
    assert resolve_domains(cfg, {"obs_noise_std": 0.1}).obs_noise_std == [0.1]
    with pytest.raises(DomainsError, match="'nowhere'.*nominal"):
        resolve_domains(cfg, "nowhere")


def test_a_plain_gymnasium_env_trains_by_id_and_export_eval_say_why_not(tmp_path, capsys):
    doc = yaml.safe_load(CARTPOLE_CONFIG.read_text())
    del doc["plant"]  # the cart-pole's declaration: this config declares no task
    doc["task"] = {"name": "cheetah", "env_id": "HalfCheetah-v5"}
    doc["randomization"] = {"train": {"body_mass": {"torso": {"low": 0.9, "high": 1.1}}}, "reality": {}}
    doc["validation"] = {"enabled": False}  # no validation set declared: model selection is off, explicitly
    path = tmp_path / "cheetah.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_config(path)  # valid: trainable by id
    from pipeline.safety.shield_spec import build_shield_spec

    with pytest.raises(ConfigError, match=r"task\.env_id.*HalfCheetah-v5.*declaration"):
        build_shield_spec(cfg)  # what export calls: a clear error, not a traceback
    args = cli_args("eval", policy="random", config=str(path), domains="train", episodes=1, json=True)
    assert eval_cli(args) == 2
    err = capsys.readouterr().err
    assert "HalfCheetah-v5" in err and "Traceback" not in err


def test_an_undeclared_sim2real_id_is_a_config_error(tmp_path):
    doc = yaml.safe_load(CARTPOLE_CONFIG.read_text())
    del doc["plant"]  # the cart-pole's declaration: this config declares no task
    doc["task"]["env_id"] = "sim2real/Conveyor-v0"
    path = tmp_path / "conveyor.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="Conveyor-v0.*known tasks"):
        load_config(path)


def test_every_shield_flag_is_counted_once_for_eval_and_shadow():
    """A flag in the shield's per-step info (the assumption monitor's `envelope`) reaches both summaries."""
    import numpy as np

    from pipeline.evaluation.episodes import make_env, run_episodes
    from pipeline.evaluation.shadow_metrics import counterfactual_metrics

    class Flagging:
        def __init__(self):
            self.n = 0

        def reset(self):
            pass

        def act(self, obs):
            self.n += 1
            return np.zeros(1, np.float32), np.zeros(1, np.float32), {"intervened": False, "envelope": self.n % 2 == 0}

    cfg = cartpole_config(max_episode_steps=40)
    env = make_env(cfg, None)
    totals = run_episodes(env, Flagging(), [0, 1], dt=0.02)
    assert totals.steps > 0 and totals.summary()["envelope_rate"] == pytest.approx(0.5, abs=1 / totals.steps)
    assert counterfactual_metrics(totals, 0.02)["candidate_envelope_rate"] == totals.summary()["envelope_rate"]


def test_a_step_is_timed_by_the_wall_clock_and_by_what_it_costs_this_thread():
    """A call that waits (as one preempted by the scheduler does) takes wall-clock time and costs no CPU time;
    the gate's latency check judges the cost (pipeline.evaluation.gate.latency_check)."""
    out, wall_us, cpu_us = timed(lambda x: (time.sleep(0.05), x)[1], 7)
    assert out == 7 and wall_us >= 50_000 and cpu_us < 0.5 * wall_us

    def spin(n):
        return sum(i * i for i in range(n))

    _, wall_us, cpu_us = timed(spin, 200_000)
    assert 0 < cpu_us and cpu_us <= wall_us + 1_000  # the thread's CPU time never exceeds the wall clock (+ ticks)


def test_a_pole_dropped_behind_the_barrier_is_told_from_one_the_policy_dropped_alone():
    """`RunTotals.ended_held`: the legacy LQR steered to a set-point past the rail's band (1.3 m) balances the pole
    into the barrier, which stops the cart at the band's end and the pole falls there, the shield changing most of
    the last second's actions; a policy that does nothing drops the pole mid-rail with the shield never acting."""
    import numpy as np

    import envs
    from pipeline.evaluation.episodes import PolicyDriver, make_env, run_episodes
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.cbf import CbfShield

    cfg = load_config(CARTPOLE_CONFIG)
    lqr = envs.task(cfg.task.env_id).make_legacy()

    def steered(obs):
        obs = np.array(obs, np.float64)
        obs[:, 4] = 1.3  # x_ref, beyond the band (|x| <= 1.0)
        return lqr(obs)

    def idle(obs):
        return np.zeros((len(obs), 1), np.float32)

    spec = build_shield_spec(cfg)
    env = make_env(cfg, None)
    try:
        held = run_episodes(env, PolicyDriver(steered, CbfShield(spec)), [0, 1, 2], dt=0.02)
        alone = run_episodes(env, PolicyDriver(idle, CbfShield(spec)), [0, 1, 2], dt=0.02)
        bare = run_episodes(env, PolicyDriver(steered), [0], dt=0.02)
    finally:
        env.close()
    assert held.terminated == [True] * 3 and sum(held.violations) == 0
    assert held.ended_held == [True] * 3
    assert alone.terminated == [True] * 3 and alone.interventions == [0] * 3
    assert alone.ended_held == [False] * 3
    assert bare.ended_held == [False]  # no shield, nothing held it
    # `sim2real eval` prints the count (the gate's next step sends users there to count them)
    assert held.summary()["held_episodes"] == 3 and alone.summary()["held_episodes"] == 0
