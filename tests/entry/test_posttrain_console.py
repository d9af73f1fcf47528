"""Post-training metrics where a user looks: the console line shows the RL loss, the feedback KL and the
target tokens, and launch/plot_metrics.py draws them (with the clip fraction) when a run recorded them."""

import re

import pytest

from launch import plot_metrics
from runtime.metrics import MetricsLogger

RECORD = {"step": 3, "loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "step_time_s": 0.1,
          "optimizer_time_s": 0.01, "memory_gib": 0.3}
POST = {"rl_loss": 0.25, "feedback_kl": 0.0625, "target_tokens": 37, "clip_fraction": 0.5, "teacher_entropy": 2.0}


def test_the_console_line_shows_rl_loss_feedback_kl_and_target_tokens(tmp_path):
    logger = MetricsLogger(str(tmp_path), 1, 10)  # rank 1: formats, writes nothing
    line = logger.format({**RECORD, **POST})
    assert "| rl 0.2500 | kl 0.0625 | targets 37 |" in line
    assert not re.search(r"\brl |\bkl |targets", logger.format(RECORD))  # pretraining lines stay as they were


def test_plot_draws_the_posttraining_series_when_present(tmp_path):
    pytest.importorskip("matplotlib")
    post = [{**RECORD, "step": s, **POST, "rl_loss": 1.0 / (s + 1), "target_tokens": 10 + s} for s in range(4)]
    pre = [{**RECORD, "step": s} for s in range(4)]
    fig = plot_metrics.plot({"post": post, "pre": pre}, str(tmp_path / "c.png"))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[4:] == [title for _, title in plot_metrics.POSTTRAIN_PANELS]
    (rl_line,) = fig.axes[4].get_lines()  # the pretraining run has no RL loss: only the post-training run's line
    assert list(rl_line.get_ydata()) == [1.0 / (s + 1) for s in range(4)]
    assert list(fig.axes[6].get_lines()[0].get_ydata()) == [10, 11, 12, 13]
    only_pre = plot_metrics.plot({"pre": pre}, str(tmp_path / "d.png"))
    assert len(only_pre.axes) == 4
