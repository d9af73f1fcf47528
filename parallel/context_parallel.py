"""Context parallelism: each sequence is split over the cp ranks in load-balanced causal chunks.

The sequence is cut into 2*cp equal chunks; cp rank i holds chunks i and 2*cp-1-i, so every rank
gets the same amount of causal attention work (an early chunk sees few keys, its mirror many).
Attention is exact: K and V (and their global positions) are all-gathered over the cp group and the
model's own `CausalAttention` masks by global positions (key j visible to query i iff
kv_pos[j] <= q_pos[i]). The all-gather's backward reduce-scatters (sums) the K/V gradients back to
the ranks that own them. RoPE is applied by the model at the global positions it is given.

Cost: each rank holds the whole sequence's K/V per layer while it attends (O(S) memory, like
Megatron's all-gather CP), and the explicit [S/cp, S] boolean mask rules out the fused causal
kernel. The model hands `sdpa` K/V already expanded to all H query heads (GQA repeats kv heads
before the call), so the all-gather moves H/G times the minimum; ring attention would fix both.

Shape letters: B batch, H heads, S local sequence (2 chunks), E head width, P cp ranks.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def load_balanced_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks cp_rank and 2*cp-1-cp_rank of 2*cp, int64 [seq_len/cp]
    (strictly increasing, as the model requires)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp={2 * cp} (balanced causal chunks)")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp={cp})")
    chunk = seq_len // (2 * cp)
    mirror = 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange(mirror * chunk, (mirror + 1) * chunk)])


class _AllGatherSeq(torch.autograd.Function):
    """x_BHSE -> [B, H, P*S, E] (rank-major along S); backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x_BHSE, group):
        ctx.group = group
        x_SBHE = x_BHSE.movedim(2, 0).contiguous()
        out_PSBHE = x_SBHE.new_empty((dist.get_world_size(group) * x_SBHE.shape[0], *x_SBHE.shape[1:]))
        dist.all_gather_single(out_PSBHE, x_SBHE, group=group)  # communication: cp all-gather
        return out_PSBHE.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad_BHSE):
        grad_PSBHE = grad_BHSE.movedim(2, 0).contiguous()
        out_SBHE = grad_PSBHE.new_empty((grad_PSBHE.shape[0] // dist.get_world_size(ctx.group), *grad_PSBHE.shape[1:]))
        dist.reduce_scatter_single(out_SBHE, grad_PSBHE, group=ctx.group)  # communication: cp reduce-scatter
        return out_SBHE.movedim(0, 2), None


def _all_gather_positions(pos_S: torch.Tensor, group) -> torch.Tensor:
    out_PS = pos_S.new_empty(dist.get_world_size(group) * pos_S.shape[0])
    dist.all_gather_single(out_PS, pos_S.contiguous(), group=group)  # communication: tiny
    return out_PS


class ContextParallelAttention(nn.Module):
    """Replaces `attention.sdpa`: local queries attend to the K/V of the whole sequence (no parameters,
    so parameter names are unchanged). The gathered keys are not in position order; the mask by
    global positions makes the order irrelevant."""

    def __init__(self, local_sdpa: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.local_sdpa = local_sdpa
        self.group = group

    def forward(self, q_BHSE, k_BHSE, v_BHSE, q_pos_S, kv_pos_S, scale: float):
        k_all = _AllGatherSeq.apply(k_BHSE, self.group)
        v_all = _AllGatherSeq.apply(v_BHSE, self.group)
        kv_pos_all = _all_gather_positions(kv_pos_S, self.group)
        return self.local_sdpa(q_BHSE, k_all, v_all, q_pos_S, kv_pos_all, scale)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Swap every `attention.sdpa` for the cp version (no-op when cp == 1). The caller feeds each
    rank its `load_balanced_positions` tokens and passes those positions to the model."""
    if cp_mesh.size() == 1:
        return
    for block in model.layers:
        block.attention.sdpa = ContextParallelAttention(block.attention.sdpa, cp_mesh.get_group())
