"""How a completion is sampled (runtime/generate.py does it): a torch-free config, so launch/generate.py
refuses a bad --temperature, --top-p or --max-new-tokens before torch loads (launch/precheck.py)."""

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()  # a sequence ends after emitting one of these

    def __post_init__(self):
        # temperature inf would make sampling a uniform draw; nan is refused by name, not by a comparison
        finite = math.isfinite(self.temperature) and math.isfinite(self.top_p)
        if not (finite and self.temperature >= 0 and 0 < self.top_p <= 1 and self.max_new_tokens >= 1):
            raise ValueError(f"sampling: temperature={self.temperature} must be finite and >= 0, top_p={self.top_p} "
                             f"in (0, 1], max_new_tokens={self.max_new_tokens} >= 1")
