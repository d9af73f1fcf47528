"""The `[metrics]` section (no torch: the config tree imports it; runtime/metrics.py writes the metrics)."""

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    tensorboard: bool = False  # also write TensorBoard event files under run.dir/tb (needs the tensorboard extra)
    max_logit: bool = False  # record the step's largest attention logit (max_logit) without QK-clip (docs/metrics.md)

    def __post_init__(self):
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("metrics.tensorboard=true needs the tensorboard package (pip install -e '.[tensorboard]')")
