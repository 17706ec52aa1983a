"""The shipped config of a training algorithm on a budget that learns a little, for tests of every path."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# Gate thresholds a barely trained policy can meet, for tests of the flow's wiring (retries, registry, artifacts),
# not of the bar: a 1 % return ratio, any intervention rate and latency, and no lost-episode bound, within 40
# episodes (the shipped bar has tests of its own: tests/pipeline/evaluation/test_gate_*.py).
WIRING_GATE = {
    "min_return_ratio": 0.01,
    "max_intervention_rate": 1.0,
    "max_latency_p99_us": 1e6,
    "max_lost_rate_increase": 1.0,
    "max_episodes": 40,
}


def small_config(tmp_path: Path, algorithm: str, **sections) -> Path:
    """The shipped config of `algorithm` (impala: cartpole.yaml switched to it) on a small budget; `sections`
    update top-level sections (e.g. gate={...}) after that."""
    shipped = {"sac": "cartpole_sac.yaml", "td3": "cartpole_td3.yaml"}.get(algorithm, "cartpole.yaml")
    data = yaml.safe_load((ROOT / "configs" / shipped).read_text())
    data["task"]["max_episode_steps"] = 100
    data["train"].update(algorithm=algorithm, num_actors=1, device="cpu")
    if "replay" in data["train"]:
        data["train"][algorithm].update(learning_starts=500, replay_ratio=8.0, log_every=10, checkpoint_every=10_000)
        data["train"]["replay"].update(num_shards=1)
        data["validation"] = {"every_updates": 1, "episodes": 2}  # an evaluation at every metrics record
    else:
        for appo_only in ("clip_param", "kl_coef"):
            data["train"].pop(appo_only, None)
        data["train"].update(envs_per_actor=4, batches_per_update=1)
        data["validation"].update(every_updates=5, episodes=2)
    for key, values in sections.items():
        data.setdefault(key, {}).update(values)
    path = tmp_path / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
