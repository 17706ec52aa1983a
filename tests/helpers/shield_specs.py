"""Synthetic shield specs for the shield's unit tests (no env needed)."""

from __future__ import annotations


def planar_double_integrator(
    latency_steps: int = 0,
    response_time_s: float = 0.0,
    margin: float = 0.02,
    input_gain_error: float = 0.0,
    keepout_steering: bool = False,
) -> dict:
    """A point mass in the plane: obs [px, py, vx, vy], action = acceleration set-point / 4 m/s^2."""
    return {
        "schema_version": 1,
        "task": "planar",
        "obs_dim": 4,
        "act_dim": 2,
        "dt": 0.05,
        "action_low": [-1.0, -1.0],
        "action_high": [1.0, 1.0],
        "state_index": [0, 1, 2, 3],
        "model": {
            "type": "double_integrator",
            "accel_per_action": [[4.0, 0.0], [0.0, 4.0]],
            "response_time_s": response_time_s,
        },
        "kinematics": {
            "position_index": [0, 1],
            "velocity_index": [2, 3],
            "brake_accel": [2.5, 2.5],
            "keepout_steering": keepout_steering,
        },
        "constraints": [
            {"name": "fence", "type": "box", "index": [0, 1], "low": [-2.0, -2.0], "high": [2.0, 2.0], "gain": 0.3},
            {"name": "diagonal_wall", "type": "halfspace", "a": [1.0, 1.0, 0.0, 0.0], "b": 3.0, "gain": 0.5},
            {"name": "pillar", "type": "cylinder", "index": [0, 1], "center": [0.5, -0.5], "radius": 0.3, "gain": 0.4},
            {"name": "speed_limit", "type": "box", "index": [2], "low": [-3.0], "high": [3.0], "gain": 0.8},
        ],
        "latency_steps": latency_steps,
        "margin": margin,
        "input_gain_error": input_gain_error,
        "assumptions": {
            "max_latency_s": 0.05 * latency_steps,
            "max_accel_error": 0.5,
            "max_obs_noise": 0.005,
            "statement": "test plant",
        },
    }


def assert_kept_on_reality(cfg, spec: dict, seed: int, episodes: int = 3) -> None:
    """The adversary and the legacy controller, shielded by `spec`, leave no limit on `reality`, while the bare
    adversary does (so the check can fail): a declared plant's shield held, in a few episodes."""
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from shield.spec import ShieldSpec

    shield_spec = ShieldSpec.from_dict(spec)
    for name in ("adversarial", "legacy"):
        policy = reference_policy(name, cfg, shield_spec, seed=seed)
        run = evaluate(cfg, policy, domains="reality", episodes=episodes, seed=seed, shield=True, spec=shield_spec)
        assert run["violations"] == 0, (name, run)
    adversary = reference_policy("adversarial", cfg, shield_spec, seed=seed)
    bare = evaluate(cfg, adversary, domains="reality", episodes=2, seed=seed, shield=False, spec=shield_spec)
    assert bare["violations"] > 0
