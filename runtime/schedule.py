"""Learning-rate schedules: linear warmup, then cosine decay or warmup-stable-decay (WSD).

`lr_factor(step, ...)` is the multiplier of the peak learning rate for the update made at optimizer step
`step` (0-based), for `torch.optim.lr_scheduler.LambdaLR`:
  warmup  step < warmup_steps:  (step + 1) / warmup_steps   (the first update is already non-zero)
  cosine: from 1 at step warmup_steps down to min_lr_ratio at the last step (steps - 1)
  wsd:    1 until the last `decay_fraction * steps` steps, then linear down to min_lr_ratio at the last
          step (Hu et al., MiniCPM, arXiv 2404.06395; the stable phase lets a run be extended or branched).
"""

import functools
import math

import torch


def lr_factor(step: int, *, steps: int, warmup_steps: int, schedule: str = "cosine", min_lr_ratio: float = 0.0,
              decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak learning rate at optimizer step `step`; pure."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = _progress(step, warmup_steps, steps - 1)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_start = max(warmup_steps, steps - round(decay_fraction * steps))
        return 1 - (1 - min_lr_ratio) * _progress(step, decay_start, steps - 1)
    raise ValueError(f"training.schedule: expected 'cosine' or 'wsd', got {schedule!r}")


def _progress(step: int, start: int, end: int) -> float:
    """0 at `start`, 1 at `end` (and after), linear between; 1 if the phase is empty."""
    if end <= start:
        return 1.0 if step >= start else 0.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


def build_scheduler(optimizer: torch.optim.Optimizer, training) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over every parameter group of `optimizer`, configured by a `TrainingConfig`.

    Call `scheduler.step()` once after each optimizer step; the lr of step t is `peak * lr_factor(t)`.
    """
    factor = functools.partial(lr_factor, steps=training.steps, warmup_steps=training.warmup_steps,
                               schedule=training.schedule, min_lr_ratio=training.min_lr_ratio,
                               decay_fraction=training.decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int, peak_lr: float) -> None:
    """After loading a checkpoint: continue at `step` with THIS config's schedule and peak lr.

    LambdaLR's saved state holds the old peak (`base_lrs`) and the lr of the next step computed under the
    old schedule; the lr is a pure function of (config, step), so recompute it rather than trust them.
    Same arithmetic as LambdaLR (peak * factor(step)): an unchanged config resumes bitwise."""
    scheduler.base_lrs = [peak_lr] * len(scheduler.base_lrs)
    scheduler.last_epoch = step
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = peak_lr, peak_lr * factor(step)
