"""A simulated plant's shadow log: the legacy controller drives a fixed-parameter twin, rows in the log schema.

Used where a plant with known parameters must stand in for the field: the
benchmark, the tests, and the excitation plan (`calibrate --plan`), which
predicts the confidence a probing log would give before anyone records it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def simulated_log(
    cfg,
    scales: dict[str, float],
    latency: int,
    path: str | Path,
    *,
    steps: int = 3000,
    seed: int = 7,
    like: str = "reality",
    probe=None,
    env_id: str | None = None,
) -> Path:
    """Write `steps` control steps of the legacy controller on a plant with `scales` (and `like`'s noise, pushes).

    probe: optional callable (step, rng) -> extra normalized action added to the legacy one
    (the excitation of a plan); the logged action is what was sent, the plant adds its noise.
    Episodes that end (the pole falls) restart; each starts a new episode number in the log.
    env_id: the plant when it is not the config's own twin (another MJCF: an unmodelled change);
    the legacy controller and the log's task stay the config's.
    """
    import gymnasium as gym

    import envs
    from pipeline.calibration.twin import fixed_set, task_facts
    from shield.shadowlog import write_shadow_log

    like_set = cfg.randomization.get(like) or cfg.randomization["train"]
    env = gym.make(
        env_id or cfg.task.env_id,
        randomization=fixed_set(scales, latency=latency, like=like_set),
        max_episode_steps=steps,
        disable_env_checker=True,
    )
    legacy = envs.legacy_controller(cfg.task.env_id)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    rows_obs, rows_u, episode, step = [], [], [], []
    ep, k = 0, 0
    for i in range(steps):
        u = np.asarray(legacy(np.asarray(obs, np.float32)[None])[0], np.float64)
        if probe is not None:
            u = np.clip(u + probe(i, rng), -1.0, 1.0)
        rows_obs.append(np.asarray(obs, np.float64))
        rows_u.append(u)
        episode.append(ep)
        step.append(k)
        obs, _, terminated, truncated, _ = env.step(u.astype(np.float32))
        k += 1
        if terminated or truncated:
            ep, k = ep + 1, 0
            obs, _ = env.reset(seed=seed + ep)
    env.close()
    n = len(rows_u)
    u = np.stack(rows_u)
    dt = float(task_facts(cfg.task.env_id)["control_period_s"])
    cols = {
        "t": np.arange(n) * dt,
        "episode": np.asarray(episode),
        "step": np.asarray(step),
        "obs": np.stack(rows_obs),
        "legacy_action": u,
        "candidate_raw": u,
        "candidate_action": u,
        "intervened": np.zeros(n, bool),
        "fallback": np.zeros(n, bool),
        "h": np.zeros((n, 1)),
        "latency_us": np.zeros(n),
        "reward": np.full(n, np.nan),
        "cost": np.full(n, np.nan),
    }
    return write_shadow_log(path, cols, {"task": cfg.task.name, "control_period_s": dt, "source": "simulated"})
