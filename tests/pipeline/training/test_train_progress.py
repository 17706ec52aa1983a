"""Training progress as a log file sees it: whole lines, no carriage returns, and a collapsed entropy said so."""

import io

from pipeline.progress import LINES, Progress
from pipeline.training.metrics import ENTROPY_COLLAPSE_NATS, MetricsLogger
from pipeline.training.scaffold import entropy_figures


def test_progress_off_a_terminal_is_a_plain_line_each_tenth():
    stream = io.StringIO()  # not a terminal
    progress = Progress(1000, "step", desc="train", stream=stream)
    for n in range(0, 1001, 7):
        progress.update_to(n, {"episode_return": n // 10})
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == LINES  # one a tenth (100, 200, ... 900), and where it ended
    assert lines[-1].startswith("train: 994/1000 step (99 %)")
    assert all(line.startswith("train: ") and "episode_return" in line for line in lines)


def test_a_collapsed_entropy_is_marked_in_the_progress_line_and_the_result(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=100, act_dim=2)
    logger.log(dict(updates=1, env_steps=50, entropy=2 * ENTROPY_COLLAPSE_NATS + 0.5))  # above, per dimension
    logger.log(dict(updates=2, env_steps=100, entropy=2 * ENTROPY_COLLAPSE_NATS - 0.5))  # below
    logger.close()
    lines = capsys.readouterr().err.splitlines()
    assert "collapsed" not in lines[0] and "collapsed: < -1.5 nats per action dimension" in lines[1]
    assert entropy_figures(dict(entropy=-2.0), act_dim=2) == dict(entropy=-2.0, entropy_collapsed=False)
    assert entropy_figures(dict(entropy=-4.0), act_dim=2) == dict(entropy=-4.0, entropy_collapsed=True)
    assert entropy_figures(None, act_dim=1) == dict(entropy=None, entropy_collapsed=False)  # TD3 reports none


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """A run that died two updates past its checkpoint logged them; its resumed life logs them again. TensorBoard
    showed both (two points at each of those steps) until the resumed logger purged past the checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, total_steps=500, act_dim=1, progress=False)
    for step in (100, 200, 300, 400, 500):  # the checkpoint was written at 300
        first.log(dict(updates=step // 100, env_steps=step, episode_return=1.0))
    first.close()
    resumed = MetricsLogger(tmp_path, total_steps=500, act_dim=1, start_steps=300, progress=False)
    for step in (400, 500):
        resumed.log(dict(updates=step // 100, env_steps=step, episode_return=2.0))
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/episode_return")]
    assert shown == [(100, 1.0), (200, 1.0), (300, 1.0), (400, 2.0), (500, 2.0)]
