"""The frozen EP config each MoE layer's dispatcher is built from (parallel/ep/dispatcher.py).

`EPConfig.from_layout` reads the `[parallel]` EP knobs (docs/expert_parallel.md) of a resolved,
validated Layout (parallel/layout.py); nothing changes it afterwards.
"""

from dataclasses import dataclass

FP8 = "float8_e4m3"


@dataclass(frozen=True, kw_only=True)
class EPConfig:
    """What one dispatcher needs to know; defaults are the direct dispatch in the compute dtype."""

    ranks_per_node: int = 8  # nodes of consecutive ranks (node-deduplicated routing's plan)
    dedup: bool = False  # parallel.ep_dedup
    capacity_factor: float = 0.0  # parallel.ep_capacity_factor (> 0: fixed capacity, no host sync)
    chunks: int = 1  # parallel.ep_overlap_chunks (> 1: pieces pipelined)
    dispatch_fp8: bool = False  # parallel.ep_dispatch_dtype == "float8_e4m3"
    combine_grad_fp8: bool = False  # parallel.ep_combine_grad_dtype == "float8_e4m3"
    keep: bool = False  # parallel.ep_recompute == "keep"

    @classmethod
    def from_layout(cls, layout) -> "EPConfig":
        return cls(ranks_per_node=layout.ranks_per_node, dedup=layout.ep_dedup,
                   capacity_factor=layout.ep_capacity_factor, chunks=layout.ep_overlap_chunks,
                   dispatch_fp8=layout.ep_dispatch_dtype == FP8, combine_grad_fp8=layout.ep_combine_grad_dtype == FP8,
                   keep=layout.ep_recompute == "keep")
