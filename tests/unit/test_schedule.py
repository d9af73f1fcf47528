"""LR schedules: warmup, cosine, WSD values at the boundaries, and LambdaLR resume."""

import math

import pytest
import torch

from runtime.config import TrainingConfig
from runtime.schedule import build_scheduler, lr_factor


def _factors(**kwargs):
    return [lr_factor(t, **kwargs) for t in range(kwargs["steps"])]


def test_warmup_is_linear_and_starts_above_zero():
    f = _factors(steps=100, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert f[:10] == pytest.approx([(t + 1) / 10 for t in range(10)])


def test_cosine_goes_from_one_to_min_through_the_midpoint():
    f = _factors(steps=101, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert f[10] == pytest.approx(1.0)
    assert f[100] == pytest.approx(0.1)  # the last step (steps - 1) reaches min_lr_ratio
    assert f[55] == pytest.approx(0.55)  # halfway through the decay: (1 + min) / 2
    assert f[30] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 20 / 90)))
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_wsd_is_flat_then_linear_to_min():
    f = _factors(steps=100, warmup_steps=10, schedule="wsd", min_lr_ratio=0.0, decay_fraction=0.2)
    assert f[10:81] == pytest.approx([1.0] * 71)  # stable until the last 20 steps (decay starts at 80)
    assert f[90] == pytest.approx(1 - 10 / 19)  # linear from step 80 (1.0) to step 99 (0.0)
    assert f[99] == pytest.approx(0.0)


def test_degenerate_phases():
    assert _factors(steps=5, warmup_steps=5, schedule="cosine") == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lr_factor(0, steps=1, warmup_steps=0, schedule="cosine", min_lr_ratio=0.3) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="training.schedule: expected 'cosine' or 'wsd', got 'linear'"):
        lr_factor(3, steps=10, warmup_steps=1, schedule="linear")


def test_scheduler_sets_lrs_and_resumes_from_state_dict():
    training = TrainingConfig(steps=20, warmup_steps=4, schedule="wsd", min_lr_ratio=0.1, decay_fraction=0.5)
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scheduler = build_scheduler(optimizer, training)
    seen = []
    for _ in range(12):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [0.5 * lr_factor(t, steps=20, warmup_steps=4, schedule="wsd", min_lr_ratio=0.1, decay_fraction=0.5)
                for t in range(12)]
    assert seen == pytest.approx(expected)

    fresh_optimizer = torch.optim.SGD([param], lr=0.5)
    resumed = build_scheduler(fresh_optimizer, training)
    resumed.load_state_dict(scheduler.state_dict())
    fresh_optimizer.param_groups[0]["lr"] = resumed.get_last_lr()[0]  # optimizer state restores this in a real resume
    for _ in range(3):
        assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
        for opt, sched in ((optimizer, scheduler), (fresh_optimizer, resumed)):
            opt.step()
            sched.step()
