"""Expert parallelism: routed experts split over the `ep` axis on the expert dim.

After `apply_expert_parallel`, each GroupedExperts weight (w13 [E, 2F, D], w2 [E, D, F]) is a DTensor
Shard(0) over the ep mesh: ep rank p owns experts [p*L, (p+1)*L), L = E/ep. Its `exchange_counts`
and `forward` are swapped (same parameters, same names) for ones that
  1. exchange token counts per expert (all-to-all of ints) and queue ONE device-to-host copy of
     both split-size vectors (pinned memory, non-blocking), then return; FSDP's all-gather of the
     experts is issued meanwhile (the experts' pre-forward hook);
  1b. forward waits for that copy: the layer's only host sync, inherent to EP because NCCL's
     all-to-all takes its split sizes (and the receive buffer's size) as host integers,
  2. dispatches the expert-sorted token copies to the owning ranks (all-to-all, uneven splits),
  3. regroups the received rows by local expert and runs the model's grouped matmul,
  4. combines: the inverse all-to-all returns each output row to the rank that sent the token.
Both all-to-alls are autograd functions whose backward is the opposite all-to-all, so the expert
weights get exactly the gradient of the tokens they saw. A rank or expert with no tokens computes
an empty grouped matmul, which still yields a (zero) gradient for every local expert weight, so
all ranks reduce the same gradients.

Opt-in dispatch variants (`[parallel]` knobs, docs/expert_parallel.md), swapped in by
`apply_expert_parallel`: node-deduplicated (parallel/ep_dedup.py), fixed capacity without host sync
(parallel/ep_capacity.py), chunked overlap (parallel/ep_overlap.py; with dedup, its node hop pipelined:
parallel/ep_dedup_overlap.py), FP8 rows (parallel/ep_fp8.py; the combine's gradient too: `combine_grad_fp8`),
recompute without resending (parallel/ep_keep.py), two halves per block interleaved (parallel/ep_interleave.py);
parallel/ep_plan.py is the plan they and the projection share.

Shape letters: T token copies this rank sent (sorted by expert), R rows received, D model dim,
F expert hidden dim, E experts, L local experts (E/ep), P ep ranks.
"""

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.experts import GroupedExperts, swiglu_experts
from parallel.ep_keep import kept

EXPERT_WEIGHTS = ("w13", "w2")


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, layout=None, counts_group=None) -> None:
    """Make every GroupedExperts' weights DTensors Shard(0) on `ep_mesh` and swap its forward (the count
    exchanges on `counts_group` when given: parallel/meshes.py `_counts_group`, else on the ep group); with
    `layout.ep_dedup`, also swap every MoE's `routed` for the node-deduplicated dispatch; with
    `layout.ep_capacity_factor` > 0, the experts' dispatch for the fixed-capacity one (no host sync).

    Applied for ep == 1 too (a size-1 mesh), so expert weights have the same placements in every
    layout. Each rank keeps its own slice of the (identical) full weights: no communication."""
    if layout is not None and layout.ep_dedup:
        _apply_dedup(model, ep_mesh, layout.ranks_per_node)
    for key in ("ep_dispatch_dtype", "ep_combine_grad_dtype"):
        if layout is not None and getattr(layout, key) != "compute":
            _set_fp8(model, ep_mesh, key, getattr(layout, key))  # read by `dispatch_rows` / `combine_grad_fp8`
    if layout is not None and layout.ep_recompute == "keep":
        from models.moe import MoE

        for module in model.modules():
            if isinstance(module, (MoE, GroupedExperts)):
                module.ep_recompute = "keep"  # read by parallel/activation_checkpoint.py (parallel/ep_keep.py)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name in EXPERT_WEIGHTS:
                full = getattr(module, name)
                local = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(local, requires_grad=full.requires_grad))
            module.ep_group = ep_mesh.get_group()
            module.ep_counts_group = counts_group or module.ep_group
            module.exchange_counts = types.MethodType(expert_parallel_exchange_counts, module)
            module.forward = types.MethodType(expert_parallel_forward, module)
    if layout is not None and layout.ep_capacity_factor > 0:
        from parallel.ep_capacity import apply_capacity

        apply_capacity(model, layout.ep_capacity_factor)
    if layout is not None and layout.ep_overlap_chunks > 1 and layout.ep_dedup:
        from parallel.ep_dedup_overlap import apply_dedup_overlap

        apply_dedup_overlap(model, layout.ep_overlap_chunks)
    elif layout is not None and layout.ep_overlap_chunks > 1:
        from parallel.ep_overlap import apply_overlap

        apply_overlap(model, layout.ep_overlap_chunks)
    if layout is not None and layout.ep_interleave:
        from parallel.ep_interleave import apply_interleave

        apply_interleave(model)


def _set_fp8(model: nn.Module, ep_mesh: DeviceMesh, key: str, value: str) -> None:
    """Every MoE and GroupedExperts gets attribute `key` (parallel.ep_dispatch_dtype or ep_combine_grad_dtype)."""
    from models.moe import MoE
    from parallel.ep_fp8 import check_fp8_device

    check_fp8_device(ep_mesh.device_type, key)
    for module in model.modules():
        if isinstance(module, (MoE, GroupedExperts)):
            setattr(module, key, value)


def _apply_dedup(model: nn.Module, ep_mesh: DeviceMesh, ranks_per_node: int) -> None:
    from models.moe import MoE
    from parallel.ep_dedup import dedup_routed
    from parallel.ep_plan import Placement

    group = ep_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MoE):
            module.ep_placement = Placement(module.router.n_experts, tuple(dist.get_process_group_ranks(group)),
                                            ranks_per_node)
            module.ep_group, module.ep_rank = group, dist.get_rank(group)
            module.routed = types.MethodType(dedup_routed, module)


@dataclass
class ExchangedCounts:
    """What `expert_parallel_exchange_counts` started: the counts this rank sends and receives
    ([P, L], device), and their row sums (split sizes) on their way to the host."""
    send_counts_PL: torch.Tensor
    recv_counts_PL: torch.Tensor
    splits_2P: torch.Tensor  # host tensor: [send splits, recv splits]; valid once `ready` completed
    ready: object  # torch.cuda.Event recorded after the copy, or None (copy already complete)

    sizes: tuple | None = None  # the Python ints, once read (a recomputed forward reuses them)

    def split_sizes(self) -> tuple[list[int], list[int]]:
        """(send_splits, recv_splits) as Python ints: waits for the copy (the host sync), once."""
        if self.sizes is None:
            if self.ready is not None:
                self.ready.synchronize()
            send, recv = self.splits_2P.tolist()  # a host tensor: no further device work
            self.sizes = (send, recv)
        return self.sizes


def expert_parallel_exchange_counts(self: GroupedExperts, counts_E: torch.Tensor):
    """Drop-in GroupedExperts.exchange_counts under EP: all-to-all of the per-expert counts
    (communication: E ints), then a non-blocking copy of the split sizes to pinned host memory."""
    n_ranks = dist.get_world_size(self.ep_group)
    if n_ranks == 1:
        return counts_E
    return kept("counts", lambda: _exchange_counts(counts_E, n_ranks, self.ep_counts_group))  # parallel/ep_keep.py


def _exchange_counts(counts_E: torch.Tensor, n_ranks: int, group) -> ExchangedCounts:
    send_counts_PL = counts_E.view(n_ranks, counts_E.shape[0] // n_ranks)
    recv_counts_PL = torch.empty_like(send_counts_PL)
    dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=group)  # communication: counts
    splits_2P = torch.stack([send_counts_PL.sum(1), recv_counts_PL.sum(1)])
    ready = None
    if splits_2P.device.type == "cuda":
        host_2P = torch.empty(splits_2P.shape, dtype=splits_2P.dtype, pin_memory=True)
        host_2P.copy_(splits_2P, non_blocking=True)  # queued on the stream; the host does not wait here
        ready = torch.cuda.Event()
        ready.record()
        splits_2P = host_2P
    return ExchangedCounts(send_counts_PL, recv_counts_PL, splits_2P, ready)


def expert_parallel_forward(self: GroupedExperts, x_TD: torch.Tensor, counts) -> torch.Tensor:
    """Drop-in GroupedExperts.forward under EP: same inputs (this rank's token copies sorted by
    expert, and what `exchange_counts` returned for the counts of all E experts) and output (out_TD
    in the same order)."""
    w13, w2 = (_local(getattr(self, n)) for n in EXPERT_WEIGHTS)  # [L, 2F, D], [L, D, F]
    if not isinstance(counts, ExchangedCounts):  # ep == 1
        return swiglu_experts(x_TD, w13, w2, counts)
    recv_counts_PL = counts.recv_counts_PL
    n_ranks, n_local = recv_counts_PL.shape
    send_splits, recv_splits = counts.split_sizes()  # host sync: split sizes must be Python ints

    x_RD = dispatch_rows(self, x_TD, recv_splits, send_splits, self.ep_group)  # communication: dispatch
    # Received rows are ordered (source rank, local expert); the grouped matmul needs (local expert, ...).
    expert_of_row_R = torch.arange(n_local, device=x_TD.device).repeat(n_ranks).repeat_interleave(
        recv_counts_PL.flatten(), output_size=sum(recv_splits)  # output_size: no second host sync
    )
    order_R = torch.argsort(expert_of_row_R, stable=True)
    y_sorted_RD = swiglu_experts(x_RD[order_R], w13, w2, recv_counts_PL.sum(0))
    y_RD = y_sorted_RD[torch.argsort(order_R)]
    return _all_to_all(y_RD, send_splits, recv_splits, self.ep_group, combine_grad_fp8(self))  # communication: combine


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The local experts of an (unsharded by FSDP) expert weight; gradients flow back as Shard(0)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def dispatch_rows(module: nn.Module, x_ND: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """The dispatch all-to-all of activation rows, in FP8 when `parallel.ep_dispatch_dtype` says so
    (parallel/ep_fp8.py), else in x's dtype. A GPU dispatch backend would replace this call."""
    if getattr(module, "ep_dispatch_dtype", "compute") == "float8_e4m3":
        from parallel.ep_fp8 import fp8_all_to_all

        return fp8_all_to_all(x_ND, out_splits, in_splits, group)
    return _all_to_all(x_ND, out_splits, in_splits, group)


def combine_grad_fp8(module: nn.Module) -> bool:
    """Whether a combine's gradient crosses as FP8 rows (`parallel.ep_combine_grad_dtype`, parallel/ep_fp8.py)."""
    return getattr(module, "ep_combine_grad_dtype", "compute") == "float8_e4m3"


def _all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                grad_fp8: bool = False) -> torch.Tensor:
    """All-to-all of rows with uneven splits: in_splits[p] rows go to rank p, out_splits[p] come from it.
    `grad_fp8`: the backward sends the gradient as FP8 rows (a combine under ep_combine_grad_dtype)."""
    return _AllToAll.apply(x_ND, out_splits, in_splits, group, grad_fp8)


def receive_rows(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """The plain all-to-all of rows into a new receive buffer (no autograd)."""
    out_MD = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
    dist.all_to_all_single(out_MD, x_ND.contiguous(), out_splits, in_splits, group=group)
    return out_MD


class _AllToAll(torch.autograd.Function):
    """Autograd all-to-all; the backward sends each row's gradient back the way the row came (as FP8
    rows, encoded before and decoded after, when `grad_fp8`: parallel/ep_fp8.py)."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, grad_fp8=False):
        ctx.splits, ctx.group, ctx.grad_fp8 = (out_splits, in_splits), group, grad_fp8
        return kept("rows", lambda: receive_rows(x_ND, out_splits, in_splits, group))  # parallel/ep_keep.py

    @staticmethod
    def backward(ctx, grad_MD):
        out_splits, in_splits = ctx.splits
        if not ctx.grad_fp8:
            return receive_rows(grad_MD, in_splits, out_splits, ctx.group), None, None, None, None
        from parallel.ep_fp8 import decode, encode

        packed_NB = receive_rows(encode(grad_MD), in_splits, out_splits, ctx.group)  # FP8 gradient rows
        return decode(packed_NB, grad_MD.dtype), None, None, None, None
