"""The EP dispatcher: each MoE layer's one object for moving its token copies to their experts and back.

`apply_expert_parallel` makes every GroupedExperts weight a DTensor Shard(0) on the ep mesh and gives
every MoE layer a `Dispatcher` built once from the frozen `EPConfig` (parallel/ep/config.py). The layer
calls it (models/moe.py `LocalDispatcher`, the interface):

    route(moe, x_TD, weights_TK, experts_TK)   sort copies by expert; exchange; the experts' call; combine
      exchange(counts_E)                       the count all-to-all and its split sizes' copy to the host
      run(experts, x_ND, counts)               inside the experts' FSDP unit: dispatch all-to-all ->
                                               grouped matmul on the local experts -> combine all-to-all

`run` is one of (chosen at build time, never swapped later): the direct dispatch
(parallel/ep/direct.py), fixed capacity without host sync (parallel/ep/capacity.py), or n pieces
pipelined (parallel/ep/pieces.py). `DedupDispatcher` routes node-deduplicated (parallel/ep/dedup.py; in
pieces: parallel/ep/pieces.py). What the dispatcher holds (no module carries it): the group,
the wire dtypes, the timeline tests and benchmarks record, the drop counters, and while a checkpointed
region runs under `ep_recompute = "keep"` its tape (parallel/ep/keep.py).
"""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.experts import GroupedExperts, swiglu_experts
from models.moe import LocalDispatcher, MoE
from parallel.ep import capacity, dedup, pieces
from parallel.ep.config import EPConfig
from parallel.ep.direct import direct_run, exchange_counts, local_weight
from parallel.ep.keep import kept
from parallel.ep.plan import Placement

EXPERT_WEIGHTS = ("w13", "w2")


class Dispatcher(LocalDispatcher):
    """One MoE layer's EP dispatch over `group` (module docstring)."""

    def __init__(self, config: EPConfig, group):
        self.config, self.group = config, group
        self.n_ranks = dist.get_world_size(group)
        self.mirror_counts = dist.get_backend(group) == "fake"  # the dry run (direct.exchange_counts)
        self.timeline = None  # a list while a test or benchmark records (event, piece, time.perf_counter())
        self.drop_counts = None  # fixed capacity: [dropped, routed] (device), from the first forward on
        self.tape = None  # parallel/ep/keep.py: the Tape of the checkpointed call running now, handed in by
        # its region's runner (parallel/activation_checkpoint.py); every exchange below goes through it
        self._run = self._choose_run()

    def _choose_run(self):
        if self.n_ranks == 1:
            return lambda x_ND, counts, w13, w2, training: swiglu_experts(x_ND, w13, w2, counts)
        if self.config.ep_capacity_factor > 0:
            return lambda x_ND, counts, w13, w2, training: capacity.capacity_run(self, x_ND, counts, w13, w2,
                                                                                    training)
        if self.config.ep_overlap_chunks > 1 and not self.config.ep_dedup:
            return lambda x_ND, counts, w13, w2, training: pieces.pieces_run(self, x_ND, counts, w13, w2)
        return lambda x_ND, counts, w13, w2, training: direct_run(self, x_ND, counts, w13, w2)

    def exchange(self, counts_E: torch.Tensor):
        """The direct dispatch's count exchange (one host sync, later); the other runs exchange their own."""
        c = self.config
        if self.n_ranks == 1 or c.ep_capacity_factor > 0 or (c.ep_overlap_chunks > 1 and not c.ep_dedup):
            return counts_E
        return kept(self.tape, "counts",
                    lambda: exchange_counts(counts_E, self.n_ranks, self.group, self.mirror_counts))

    def run(self, experts: GroupedExperts, x_ND: torch.Tensor, counts) -> torch.Tensor:
        w13, w2 = (local_weight(getattr(experts, n)) for n in EXPERT_WEIGHTS)  # [L, 2F, D], [L, D, F]
        return self._run(x_ND, counts, w13, w2, experts.training)

    def mark(self, event: str, piece: int) -> None:
        """Record (event, piece, time) when a test or benchmark set `timeline` to a list."""
        if self.timeline is not None:
            self.timeline.append((event, piece, time.perf_counter()))


class DedupDispatcher(Dispatcher):
    """Node-deduplicated routing (parallel/ep/dedup.py), its node hop in pieces when `config.ep_overlap_chunks` > 1
    (parallel/ep/pieces.py); the fan-out inside a node is the direct dispatch."""

    def __init__(self, config: EPConfig, group, placement: Placement):
        super().__init__(config, group)
        self.placement, self.rank = placement, dist.get_rank(group)

    def route(self, moe: MoE, x_TD, weights_TK, experts_TK) -> torch.Tensor:
        if self.config.ep_overlap_chunks > 1:
            return pieces.pipelined_route(self, moe, x_TD, weights_TK, experts_TK)
        return dedup.dedup_route(self, moe, x_TD, weights_TK, experts_TK)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, config: EPConfig) -> None:
    """Make every GroupedExperts' weights DTensors Shard(0) on `ep_mesh` and give every MoE layer its
    dispatcher. Applied for ep == 1 too (a size-1 mesh), so expert weights have the same
    placements in every layout. Each rank keeps its own slice of the (identical) full weights: no
    communication."""
    group = ep_mesh.get_group()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name in EXPERT_WEIGHTS:
                full = getattr(module, name)
                local = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(local, requires_grad=full.requires_grad))
    for block in model.layers:
        if isinstance(block.feed_forward, MoE):
            block.feed_forward.dispatcher = build_dispatcher(config, group, block.feed_forward.router.n_experts)


def build_dispatcher(config: EPConfig, group, n_experts: int) -> Dispatcher:
    if not config.ep_dedup:
        return Dispatcher(config, group)
    placement = Placement(n_experts, tuple(dist.get_process_group_ranks(group)), config.ranks_per_node)
    return DedupDispatcher(config, group, placement)


def dispatchers(model: nn.Module) -> list[Dispatcher]:
    """Every MoE layer's EP dispatcher, in block order (none before `apply_expert_parallel`)."""
    return [m.dispatcher for m in model.modules() if isinstance(m, MoE) and isinstance(m.dispatcher, Dispatcher)]


def read_drop_counts(model: nn.Module) -> torch.Tensor | None:
    """[dropped, routed] token copies summed over this rank's MoE layers since the last call (device,
    float64), or None when no layer drops (parallel/ep/capacity.py); resets the counters."""
    dropping = [d for d in dispatchers(model) if d.config.ep_capacity_factor > 0]
    if not dropping:
        return None
    counters = [d.drop_counts for d in dropping if d.drop_counts is not None]
    if not counters:
        return torch.zeros(2, dtype=torch.float64)
    total = torch.stack(counters).sum(0).double()
    for c in counters:
        c.zero_()
    return total
