"""Held-out evaluation (the `[eval]` section): the mean cross-entropy over fixed validation batches.

Which tokens: `eval.path` (a `.bin`, read like `data.path`), else the last `eval.holdout` fraction of the
training source, which training then never sees (runtime/data.py `split_tokens`; synthetic data draws
the eval tokens from another stream). Batch e of every evaluation is the same (seed, e) draw, split over
ranks and micro-batches exactly as training batches are, so `eval_loss` is the same whatever the layout
and comparable across steps. The model runs in eval mode under no_grad: routers count nothing and
the aux loss is off, so evaluation leaves no trace in training.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel.gradients import global_loss


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    interval: int = 100  # evaluate every N optimizer steps and after the last one (0 = never)
    steps: int = 4  # global batches (of data.batch_size sequences) per evaluation
    path: str = ""  # a .bin of held-out tokens; empty = the last eval.holdout of the training source
    holdout: float = 0.05  # fraction of the training source held out for evaluation when eval.path is empty

    def __post_init__(self):
        if self.interval < 0 or self.steps < 1:
            raise ValueError(f"eval.interval={self.interval} must be >= 0 and eval.steps={self.steps} >= 1")
        if not 0 < self.holdout < 1:
            raise ValueError(f"eval.holdout={self.holdout} must be in (0, 1)")

    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to evaluate after `step` optimizer steps are done."""
        return self.enabled() and (step % self.interval == 0 or step == total_steps)

    def train_holdout(self) -> float:
        """The fraction the TRAINING loader must leave out of its source."""
        return self.holdout if self.enabled() and not self.path else 0.0

    def data(self, data_config):
        """The DataConfig the eval loader reads."""
        if not self.path:
            return data_config
        return dataclasses.replace(data_config, source="bin", path=self.path, sources=())  # a mixture's too


@torch.no_grad()
def evaluate(model: nn.Module, loader, steps: int, tokens_per_batch: int, micro_batch_loss) -> float:
    """Mean cross-entropy over the eval batches 0..steps-1 of `loader` (global, identical on every rank).

    `micro_batch_loss(micro_batch, global_tokens)` is the training loop's forward + loss (runtime/train.py),
    so evaluation runs the model exactly as training does; communication: one scalar all-reduce."""
    was_training = model.training
    model.eval()
    batches = [loader.batch(e) for e in range(steps)]
    total = sum(getattr(b[0], "global_labels", tokens_per_batch) for b in batches)  # document masking: trained labels
    local = sum(micro_batch_loss(micro, total) for batch in batches for micro in batch)
    model.train(was_training)
    return (global_loss(local) if dist.is_initialized() else local).item()
