"""Sync-free EP dispatch with a fixed capacity (`parallel.ep_capacity_factor` > 0).

The direct dispatch (parallel/ep/direct.py) needs the split sizes on the host: NCCL's
all-to-all takes them as integers, so each MoE layer waits for the device once. Here every rank
sends exactly C rows to every ep peer, C = ceil(factor x T K / P) (T K token copies of this rank),
so the split sizes are the constant [C] * P and nothing is read back:
  1. each copy (sorted by expert, as the dispatcher's `route` gives them) takes slot `position in its
     destination rank's rows` of that rank's C-row block; copies at position >= C are dropped (their
     expert output is zero, so the token keeps its residual and the other experts' outputs);
  2. one all-to-all of the [P C, D] slot buffer (unused slots are zero rows) and one of the slots'
     local expert ids (L = empty slot), fixed splits;
  3. the receiver sorts its P C rows by local expert (empty slots last, in the last expert's group:
     zero rows give zero outputs and add exact zeros to the weight gradients) and runs the grouped
     matmul with device-side group sizes (no host read), then unsorts;
  4. the inverse all-to-all returns the slots; each copy reads its slot's row (dropped: zero).
Every rank must pass the same T (true for the fixed-shape micro-batches the runtime builds), since
C sizes the receive buffer. With C >= T K (factor >= P) nothing can drop and the outputs equal the
direct path's up to the grouped matmul's extra zero rows (exact zeros).

Dropped copies are counted on the device (the dispatcher's `drop_counts`: [dropped, routed] of this rank since
the last read); runtime/train.py sums them across ranks with the loss and logs
`ep_dropped_fraction` at the step's one readback.

Shape letters: N token copies of this rank (sorted by expert), D model dim, P ep ranks, L local
experts, C slots per peer, S = P C slots.
"""

import torch

from models.experts import swiglu_experts
from parallel.ep.direct import all_to_all, dispatch_rows
from parallel.ep.plan import capacity_slots


def capacity_run(d, x_ND: torch.Tensor, counts_E: torch.Tensor, w13, w2, training: bool) -> torch.Tensor:
    """The experts' call of dispatcher `d` under a fixed capacity (module docstring); same inputs and
    output as the direct path. `training`: the experts module's mode (drops are counted in training)."""
    P = d.n_ranks
    L = counts_E.shape[0] // P
    C = capacity_slots(x_ND.shape[0], P, d.config.ep_capacity_factor)
    slot_N, local_expert_N, kept_N = _slots(counts_E, P, L, C, x_ND.shape[0])
    if training:
        _count_drops(d, kept_N)
    send_SD = x_ND.new_zeros(P * C + 1, x_ND.shape[1]).index_copy(0, slot_N, x_ND)[:-1]  # row P C: the dropped
    ids_S = torch.full((P * C + 1,), L, dtype=torch.int64, device=x_ND.device).index_copy(0, slot_N, local_expert_N)
    splits = [C] * P
    x_SD = dispatch_rows(d, send_SD, splits, splits)  # communication: dispatch (fixed splits)
    ids_S = all_to_all(d, ids_S[:-1], splits, splits)
    order_S = torch.argsort(ids_S, stable=True)
    sizes_L = torch.zeros(L + 1, dtype=torch.int64, device=x_ND.device).index_add_(0, ids_S, torch.ones_like(ids_S))
    sizes_L = sizes_L[:L].clone()
    sizes_L[-1] += sizes_L.new_full((), P * C) - sizes_L.sum()  # empty slots join the last group
    y_SD = swiglu_experts(x_SD[order_S], w13, w2, sizes_L)[torch.argsort(order_S)]
    back_SD = all_to_all(d, y_SD, splits, splits, d.config.combine_grad_fp8)  # communication: combine (fixed splits)
    return torch.cat([back_SD, back_SD.new_zeros(1, back_SD.shape[1])]).index_select(0, slot_N)


def _slots(counts_E, P: int, L: int, C: int, N: int):
    """(slot_N: destination rank x C + position, or P C when dropped; local expert; kept mask), from
    the per-expert counts of the expert-sorted copies, on the device."""
    expert_N = torch.repeat_interleave(torch.arange(P * L, device=counts_E.device), counts_E, output_size=N)
    rank_N = expert_N // L
    first_P = torch.cumsum(counts_E.view(P, L).sum(1), 0) - counts_E.view(P, L).sum(1)
    position_N = torch.arange(N, device=counts_E.device) - first_P[rank_N]
    kept_N = position_N < C
    slot_N = torch.where(kept_N, rank_N * C + position_N, P * C)
    return slot_N, expert_N % L, kept_N


def _count_drops(d, kept_N: torch.Tensor) -> None:
    """Training-mode forwards only, like the routers' token counts (evaluation drops are not the step's)."""
    if d.drop_counts is None:
        d.drop_counts = torch.zeros(2, dtype=torch.int64, device=kept_N.device)
    with torch.no_grad():
        d.drop_counts[0] += (~kept_N).sum()
        d.drop_counts[1] += kept_N.numel()
