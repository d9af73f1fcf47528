"""The pipeline knobs, declared once: `PipelineConfig`, a frozen dataclass whose fields are `[parallel]` keys.

`ParallelConfig` (parallel/layout.py) inherits these fields, as it does the EP knobs (parallel/ep/config.py),
so TOML and the command line set them as `parallel.<field>`; `ParallelConfig.resolve` hands them to the
`Layout` as one `PipelineConfig` (`layout.pp_config`), which parallel/pp/plan.py, the stages and the schedule
read. No torch: the config is checked before torch loads.
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev", "gpipe")
RESHARD_CHOICES = ("auto", "true", "false")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The `[parallel]` pipeline knobs (the help of each is the comment after it; docs/pretraining.md)."""

    pp: int = 1  # pipeline parallelism: the outermost axis, pp stages of world/pp consecutive ranks, both layouts inside each
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "zbv", "dualpipev", "gpipe"] = "1f1b"  # torch.distributed.pipelining schedule; its micro-batches are training.grad_accum
    pp_stages_per_rank: int = -1  # stages each rank runs: -1 = the schedule's (1 for 1f1b and gpipe, 2 for the others)
    pp_layers: tuple[int, ...] = ()  # blocks per stage, pp x stages per rank numbers; empty = spread evenly, the embedding and the head each weighing a block
    reshard_after_forward: Literal["auto", "true", "false"] = "auto"  # FSDP frees gathered weights after each forward; auto = true without pp, false with it (zero-bubble schedules refuse true)

    def check(self) -> None:
        """ValueError (one line, the key and its value) for an out-of-range pipeline knob."""
        if self.pp < 1:
            raise ValueError(f"parallel.pp={self.pp}: must be >= 1 (1 = no pipeline parallelism)")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule={self.pp_schedule!r}: expected one of "
                             f"{', '.join(map(repr, SCHEDULES))}")
        if self.pp_stages_per_rank == 0 or self.pp_stages_per_rank < -1:
            raise ValueError(f"parallel.pp_stages_per_rank={self.pp_stages_per_rank}: must be >= 1, or -1 (the "
                             f"schedule's)")
        if any(n < 0 for n in self.pp_layers):
            raise ValueError(f"parallel.pp_layers={list(self.pp_layers)}: layers per stage must be >= 0")
        if self.reshard_after_forward not in RESHARD_CHOICES:
            raise ValueError(f"parallel.reshard_after_forward={self.reshard_after_forward!r}: expected one of "
                             f"{', '.join(map(repr, RESHARD_CHOICES))}")
        if self.pp == 1 and (self.pp_layers or self.pp_stages_per_rank > 1):
            key, value = (("pp_layers", list(self.pp_layers)) if self.pp_layers
                          else ("pp_stages_per_rank", self.pp_stages_per_rank))
            raise ValueError(f"parallel.{key}={value} with parallel.pp=1: set parallel.pp > 1 or leave it unset")

    def pp_only(self) -> "PipelineConfig":
        """These knobs alone, as a PipelineConfig (from a ParallelConfig, which carries them with the rest)."""
        return PipelineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PipelineConfig)})
