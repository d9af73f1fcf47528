"""Expert parallelism: routed experts split over the `ep` axis on the expert dim.

After `apply_expert_parallel`, each GroupedExperts weight (w1 [E, F, D], w2 [E, D, F], w3 [E, F, D])
is a DTensor Shard(0) over the ep mesh: ep rank p owns experts [p*L, (p+1)*L), L = E/ep. Its
`forward` is swapped (same parameters, same names) for one that
  1. exchanges token counts per expert (all-to-all of ints, then one host sync for the split sizes),
  2. dispatches the expert-sorted token copies to the owning ranks (all-to-all, uneven splits),
  3. regroups the received rows by local expert and runs the model's grouped matmul,
  4. combines: the inverse all-to-all returns each output row to the rank that sent the token.
Both all-to-alls are autograd functions whose backward is the opposite all-to-all, so the expert
weights get exactly the gradient of the tokens they saw. A rank or expert with no tokens computes
an empty grouped matmul, which still yields a (zero) gradient for every local expert weight, so
all ranks reduce the same gradients.

Shape letters: T token copies this rank sent (sorted by expert), R rows received, D model dim,
F expert hidden dim, E experts, L local experts (E/ep), P ep ranks.
"""

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.experts import GroupedExperts, swiglu_experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Make every GroupedExperts' weights DTensors Shard(0) on `ep_mesh` and swap its forward.

    Applied for ep == 1 too (a size-1 mesh), so expert weights have the same placements in every
    layout. Each rank keeps its own slice of the (identical) full weights: no communication."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name in EXPERT_WEIGHTS:
                full = getattr(module, name)
                local = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(local, requires_grad=full.requires_grad))
            module.ep_group = ep_mesh.get_group()
            module.forward = types.MethodType(expert_parallel_forward, module)


def expert_parallel_forward(self: GroupedExperts, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Drop-in GroupedExperts.forward under EP: same inputs (this rank's token copies sorted by
    expert, counts of all E experts) and output (out_TD in the same order)."""
    w1, w2, w3 = (_local(getattr(self, n)) for n in EXPERT_WEIGHTS)  # [L, F, D], [L, D, F], [L, F, D]
    n_ranks = dist.get_world_size(self.ep_group)
    if n_ranks == 1:
        return swiglu_experts(x_TD, w1, w2, w3, counts_E)
    n_local = counts_E.shape[0] // n_ranks
    send_counts_PL = counts_E.view(n_ranks, n_local)
    recv_counts_PL = torch.empty_like(send_counts_PL)
    dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=self.ep_group)  # communication: counts
    send_splits = send_counts_PL.sum(1).tolist()  # host sync: split sizes must be Python ints
    recv_splits = recv_counts_PL.sum(1).tolist()

    x_RD = _all_to_all(x_TD, recv_splits, send_splits, self.ep_group)  # communication: dispatch
    # Received rows are ordered (source rank, local expert); the grouped matmul needs (local expert, ...).
    expert_of_row_R = torch.arange(n_local, device=x_TD.device).repeat(n_ranks).repeat_interleave(
        recv_counts_PL.flatten(), output_size=sum(recv_splits)  # output_size: no second host sync
    )
    order_R = torch.argsort(expert_of_row_R, stable=True)
    y_sorted_RD = swiglu_experts(x_RD[order_R], w1, w2, w3, recv_counts_PL.sum(0))
    y_RD = y_sorted_RD[torch.argsort(order_R)]
    return _all_to_all(y_RD, send_splits, recv_splits, self.ep_group)  # communication: combine


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The local experts of an (unsharded by FSDP) expert weight; gradients flow back as Shard(0)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of rows with uneven splits: in_splits[p] rows go to rank p, out_splits[p] come from it."""
    return _AllToAll.apply(x_ND, out_splits, in_splits, group)


class _AllToAll(torch.autograd.Function):
    """Autograd all-to-all; the backward sends each row's gradient back the way the row came."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out_MD = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
        dist.all_to_all_single(out_MD, x_ND.contiguous(), out_splits, in_splits, group=group)
        return out_MD

    @staticmethod
    def backward(ctx, grad_MD):
        out_splits, in_splits = ctx.splits
        grad_ND = grad_MD.new_empty((sum(in_splits), *grad_MD.shape[1:]))
        dist.all_to_all_single(grad_ND, grad_MD.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_ND, None, None, None
