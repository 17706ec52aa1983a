"""Shared fixtures: one trained cart-pole policy per test session.

Training is the expensive part of the suite, so the learning test, the shield's
"return kept" test and the gate's "trained candidate passes" test all use the
same run: the default config, a fixed seed, a fixed step budget.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The default config's own budget (train.total_env_steps), ~1 min on a quiet 2-core machine with validation.
# At 250k the best validation return was still being reached in the last updates (430-489 of 488), and the
# train-plant check of tests/test_train_learning.py failed 2 of 6 CI runs (0.85-0.88 of legacy, asks 0.9);
# export takes the checkpoint with the best validation return (530-782 of 782 updates at 400k).
TRAINED_STEP_BUDGET = 400_000


@pytest.fixture(scope="session")
def trained_cartpole(tmp_path_factory):
    """The default cart-pole config trained once (fixed seed and budget), and its exported (selected) bundle."""
    from pipeline.config import load_config
    from pipeline.deployment.export import export_policy
    from pipeline.training.train import train

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    base = tmp_path_factory.mktemp("trained-cartpole")
    run = train(cfg, out_dir=base / "run", steps=TRAINED_STEP_BUDGET, progress=False)
    exported = export_policy(run["run_dir"], out_dir=base / "bundle")
    return SimpleNamespace(cfg=cfg, run=run, run_dir=Path(run["run_dir"]), bundle=Path(exported["bundle"]),
                           export=exported)
