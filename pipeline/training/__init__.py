"""Training: Ray rollout actors, the V-trace learner, checkpoints and metrics."""
