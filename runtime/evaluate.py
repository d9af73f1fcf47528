"""Held-out evaluation (the `[eval]` section): the mean cross-entropy over fixed validation batches.

Which tokens: `eval.path` (a `.bin`, read like `data.path`), else the last `eval.holdout` fraction of the
training source, which training then never sees (runtime/data/loader.py `split_tokens`; synthetic data draws
the eval tokens from another stream). Batch e of every evaluation is the same (seed, e) draw, split over
ranks and micro-batches exactly as training batches are, so `eval_loss` is the same whatever the layout
and comparable across steps. The model runs in eval mode under no_grad: routers count nothing and
the aux loss is off, so evaluation leaves no trace in training.
"""

import torch
import torch.distributed as dist
from torch import nn

from parallel.gradients import global_loss


@torch.no_grad()
def evaluate(model: nn.Module, loader, steps: int, tokens_per_batch: int, batch_loss) -> float:
    """Mean cross-entropy over the eval batches 0..steps-1 of `loader` (global, identical on every rank).

    `batch_loss(micro_batches, global_tokens)` is the training loop's forward + loss over one batch's
    micro-batches (runtime/train.py; under pipeline parallelism the schedule's forward), so evaluation runs
    the model exactly as training does; communication: one scalar all-reduce."""
    was_training = model.training
    model.eval()
    batches = [loader.batch(e) for e in range(steps)]
    total = sum(getattr(b[0], "global_labels", tokens_per_batch) for b in batches)  # document masking: trained labels
    local = sum(batch_loss(batch, total) for batch in batches)
    model.train(was_training)
    return (global_loss(local) if dist.is_initialized() else local).item()
