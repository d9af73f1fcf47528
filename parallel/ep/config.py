"""The EP knobs, declared once: `EPConfig`, a frozen dataclass whose fields are the `[parallel]` keys.

`ParallelConfig` (parallel/layout.py) inherits these fields, so TOML and the command line set them as
`parallel.<field>` (docs/expert_parallel.md); `ParallelConfig.resolve` hands them to the `Layout` as one
`EPConfig` (`layout.ep_config`), which every reader takes from there: each MoE layer's dispatcher
(parallel/ep/dispatcher.py), the refusal table (parallel/ep/refusals.py), the projection and the memory
estimate. Nothing changes it afterwards. No torch: the config is checked before torch loads.

The dispatch knobs are the `ep_*` fields; each is "on" when it differs from its default (the default of
all of them together is the direct dispatch in the compute dtype), and an "on" knob needs ep > 1.
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal

FP8 = "float8_e4m3"
DISPATCH_DTYPES = ("compute", FP8)
RECOMPUTE_MODES = ("resend", "keep")

# EP knobs that were removed (the calibrated projection put them in no recommended row, docs/performance.md):
# a config that still sets one fails naming it (runtime/config_parser.py), with what to use instead
REMOVED_EP_KNOBS = {
    "ep_interleave": "removed (two halves per MoE block); to overlap the all-to-alls with the experts use "
                     "parallel.ep_overlap_chunks = 2",
    "ep_pair_micro_batches": "removed (paired micro-batches); delete the line: micro-batches run one after another",
    "ep_recompute_ahead": "removed (the recompute ahead); delete the line: with parallel.ep_recompute = \"keep\" "
                          "the recompute still sends nothing",
}


@dataclass(frozen=True, kw_only=True)
class EPConfig:
    """The `[parallel]` EP knobs (the help of each is the comment after it; docs/expert_parallel.md)."""

    ranks_per_node: int = 8  # ranks per node (consecutive ranks): the optimizer plan's and the EP dispatch's intra/inter-node split
    ep_dedup: bool = False  # EP: send a token once per destination node, fan out inside it, sum inside it on the way back (parallel/ep/dedup.py)
    ep_capacity_factor: float = 0.0  # EP: > 0 = fixed per-peer buffers of ceil(factor*T*K/ep) rows, no host sync, copies over it dropped (parallel/ep/capacity.py)
    ep_overlap_chunks: int = 1  # EP: > 1 = cut each layer's copies into this many pieces, one's all-to-alls in flight while another computes (parallel/ep/pieces.py)
    ep_dispatch_dtype: Literal["compute", "float8_e4m3"] = "compute"  # EP: dtype the dispatched activations cross in (float8_e4m3: per-token scale; the combine stays in the compute dtype)
    ep_recompute: Literal["resend", "keep"] = "resend"  # EP under training.activation_checkpoint: resend = the recompute reruns the all-to-alls; keep = the forward keeps what they received and the recompute reuses it (more memory, parallel/ep/keep.py)
    ep_combine_grad_dtype: Literal["compute", "float8_e4m3"] = "compute"  # EP: dtype the combine's gradient crosses in, back to the experts (float8_e4m3: per-token scale, as DeepSeek-V3; parallel/ep/direct.py)

    def check(self) -> None:
        """ValueError (one line, the key and its value) for an out-of-range node size or dispatch knob."""
        if self.ranks_per_node < 1:
            raise ValueError(f"parallel.ranks_per_node={self.ranks_per_node}: must be >= 1")
        if not (self.ep_capacity_factor >= 0 and self.ep_capacity_factor != float("inf")):
            raise ValueError(f"parallel.ep_capacity_factor={self.ep_capacity_factor}: must be finite and >= 0 (0 = off)")
        if self.ep_overlap_chunks < 1:
            raise ValueError(f"parallel.ep_overlap_chunks={self.ep_overlap_chunks}: must be >= 1 (1 = no overlap)")
        for key, choices in (("ep_dispatch_dtype", DISPATCH_DTYPES), ("ep_recompute", RECOMPUTE_MODES),
                             ("ep_combine_grad_dtype", DISPATCH_DTYPES)):
            if getattr(self, key) not in choices:
                raise ValueError(f"parallel.{key}={getattr(self, key)!r}: expected one of {choices}")

    def knobs(self) -> dict:
        """{key: value} of the dispatch knobs (the `ep_*` fields), in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EPConfig) if f.name.startswith("ep_")}

    def on(self) -> list[str]:
        """The dispatch knobs that are on (not at their default), in declaration order."""
        defaults = EPConfig()
        return [key for key, value in self.knobs().items() if value != getattr(defaults, key)]

    @property
    def dispatch_fp8(self) -> bool:
        return self.ep_dispatch_dtype == FP8

    @property
    def combine_grad_fp8(self) -> bool:
        return self.ep_combine_grad_dtype == FP8

    @property
    def keep(self) -> bool:
        """The recompute replays what the forward's exchanges received (parallel/ep/keep.py)."""
        return self.ep_recompute == "keep"

    def ep_only(self) -> "EPConfig":
        """These knobs alone, as an EPConfig (from a ParallelConfig, which carries them with the degrees)."""
        return EPConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EPConfig)})
