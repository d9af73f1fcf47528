"""Context parallelism: each sequence is split over the cp ranks in load-balanced causal chunks.

The sequence of L tokens is cut into 2*P equal chunks of c = L/(2P) (P = cp); cp rank r holds
chunks r and 2P-1-r, so every rank gets the same causal attention work (an early chunk sees few
keys, its mirror many). Attention is exact. Per layer, on each cp rank (two module swaps, no
parameters, so parameter names are unchanged):
  1. gather (`GatheredKV`, replaces `attention.kv_source`): the keys' compact form, before it is
     expanded to H heads: MLA's latent c_kv (C values per token, before kv_norm) and shared rotary
     key (R, after RoPE); GQA's keys and values per kv head (2 G E). One all-gather over cp of the
     concatenation, then reordered from rank order to global chunk order. Communication: cp
     all-gather, (P-1) x local tokens x (C + R) values sent per rank (576 for DeepSeek-V3 / Kimi
     K2, instead of the H (qk + v) = 20,480 (K2) of the expanded K/V).
  2. expand locally (the model's own code): MLA runs kv_norm and wkv_b on all L tokens on every rank,
     GQA repeats kv heads. Costs (P-1)/P x L x 2 C H (nope + v) extra FLOPs forward per rank and
     layer (16.8 MFLOP per gathered token for K2; x3 with backward).
  3. attend (`ContextParallelAttention`, replaces `attention.sdpa`): local query chunk k (k = r and
     2P-1-r) sees global key chunks [0, k) fully and chunk k causally:
     models/block_attention.prefix_causal_attention, two flash calls merged by log-sum-exp, no mask.
  4. backward: the all-gather's backward reduce-scatters (sums) the compact gradients back to the
     ranks that own them. Communication: cp reduce-scatter, the same bytes as step 1.
Each rank holds the whole sequence's expanded K/V while it attends (O(L) memory, like Megatron's
all-gather CP). Key positions are not communicated: the gathered keys are in global order, so
their positions are the rank's first position minus r c plus 0..L-1. This requires the callers'
layout, `load_balanced_positions` (plus any constant shift), which `GatheredKV` checks on the device.

Shape letters: B batch, S local sequence (2 chunks), L whole sequence (P S), X values per token, P cp ranks.
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.block_attention import pad_values, prefix_causal_attention
from models.document_attention import document_attention
from parallel import _torch_private


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


def _chunk_order(cp: int) -> list[tuple[int, int]]:
    """(rank, half) holding global chunk 0..2cp-1."""
    return [(k, 0) if k < cp else (2 * cp - 1 - k, 1) for k in range(2 * cp)]


class _AllGatherChunks(torch.autograd.Function):
    """x_SBX (this rank's 2 chunks) -> x_LBX in global chunk order; backward reduce-scatters (sums)."""

    @staticmethod
    def forward(ctx, x_SBX, group):
        ctx.group, P = group, dist.get_world_size(group)
        out_PSBX = x_SBX.new_empty((P * x_SBX.shape[0], *x_SBX.shape[1:]))
        dist.all_gather_single(out_PSBX, x_SBX.contiguous(), group=group)  # communication: cp all-gather
        chunks = out_PSBX.view(P, 2, x_SBX.shape[0] // 2, *x_SBX.shape[1:])
        return torch.cat([chunks[rank, half] for rank, half in _chunk_order(P)])

    @staticmethod
    def backward(ctx, grad_LBX):
        P = dist.get_world_size(ctx.group)
        grad_KCBX = grad_LBX.view(2 * P, grad_LBX.shape[0] // (2 * P), *grad_LBX.shape[1:])
        by_rank = [None] * (2 * P)
        for k, (rank, half) in enumerate(_chunk_order(P)):
            by_rank[2 * rank + half] = grad_KCBX[k]
        grad_PSBX = torch.cat(by_rank)
        out_SBX = grad_PSBX.new_empty((grad_PSBX.shape[0] // P, *grad_PSBX.shape[1:]))
        dist.reduce_scatter_single(out_SBX, grad_PSBX, group=ctx.group)  # communication: cp reduce-scatter
        return out_SBX, None


class GatheredKV(nn.Module):
    """Replaces `attention.kv_source`: the compact key tensors of the whole sequence, in global order.

    In: tensors [B, S, ...] (this rank's 2 chunks) and their positions [S]. Out: each tensor as
    [B, L, ...] and the keys' positions [L]. One all-gather over cp for all tensors together."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, *tensors_BS: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, S = tensors_BS[0].shape[:2]
        L = S * dist.get_world_size(self.group)
        kv_pos_L = self._key_positions(positions_S, L)  # before the collective: a bad layout raises on every rank
        widths = [math.prod(t.shape[2:]) for t in tensors_BS]
        x_BSX = torch.cat([t.reshape(B, S, -1) for t in tensors_BS], dim=-1)
        x_LBX = _AllGatherChunks.apply(x_BSX.transpose(0, 1), self.group)
        parts = x_LBX.transpose(0, 1).split(widths, dim=-1)
        gathered = [p.reshape(B, L, *t.shape[2:]) for p, t in zip(parts, tensors_BS)]
        return (*gathered, kv_pos_L)

    def _key_positions(self, positions_S: torch.Tensor, L: int) -> torch.Tensor:
        """First position of global chunk 0 plus 0..L-1, after checking that the local positions
        follow `load_balanced_positions` (a device-side assert: the host does not wait on CUDA)."""
        P, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        c, index_S = L // (2 * P), torch.arange(positions_S.shape[0], device=positions_S.device)
        expected_S = torch.where(index_S < c, r * c + index_S, (2 * P - 2 - r) * c + index_S)  # no host copy
        shift = positions_S[:1] - expected_S[:1]
        message = "context parallelism needs each rank's positions to be load_balanced_positions (+ a constant)"
        try:
            _torch_private.assert_async((positions_S - shift == expected_S).all(), message)
        except RuntimeError as e:
            raise ValueError(f"{message}; cp rank {r} of {P} got {positions_S.tolist()[:16]}...") from e
        return torch.arange(L, device=positions_S.device) + shift


class ContextParallelAttention(nn.Module):
    """Replaces `attention.sdpa`: the local queries (global chunks r and 2P-1-r) against the gathered
    keys in global order, each chunk over its visible prefix and its causal diagonal, without a mask.
    `local_sdpa` (the model's CausalAttention) keeps recording QK-clip maxima."""

    def __init__(self, local_sdpa: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.local_sdpa = local_sdpa
        self.group = group

    def forward(self, q_BHSE, k_BHLE, v_BHLE, q_pos_S, kv_pos_L, scale: float, documents=None):
        """`documents` (data.document_mask): each chunk's visible keys stop at document boundaries, also
        for documents straddling the chunks (models/document_attention.py; doc_BL covers the whole row)."""
        self.local_sdpa.record(q_BHSE, k_BHLE, q_pos_S, kv_pos_L, scale, documents)
        if documents is not None:
            return document_attention(q_BHSE, k_BHLE, v_BHLE, q_pos_S, kv_pos_L, documents.doc_BL, scale,
                                      block_mask=documents.block_mask)
        cp, cp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return balanced_chunk_attention(q_BHSE, k_BHLE, v_BHLE, cp_rank, cp, scale)


def balanced_chunk_attention(q_BHSE, k_BHLE, v_BHLE, cp_rank: int, cp: int, scale: float) -> torch.Tensor:
    """Exact causal attention of cp rank `cp_rank`'s queries (global chunks r and 2P-1-r) over the whole
    sequence's keys in global order: chunk k sees chunks [0, k) fully and chunk k causally. Local, no
    communication; values narrower than q/k are padded for the flash kernel and the output sliced."""
    c, v_width = q_BHSE.shape[2] // 2, v_BHLE.shape[-1]
    v_BHLE = pad_values(v_BHLE, q_BHSE.shape[-1])
    outs = []
    for half, k in enumerate((cp_rank, 2 * cp - 1 - cp_rank)):
        keys = slice(0, (k + 1) * c)
        outs.append(prefix_causal_attention(q_BHSE[:, :, half * c:(half + 1) * c], k_BHLE[:, :, keys],
                                            v_BHLE[:, :, keys], scale))
    return torch.cat(outs, dim=2)[..., :v_width]


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Swap every `attention.kv_source` and `attention.sdpa` for the cp versions (no-op when cp == 1).
    The caller feeds each rank its `load_balanced_positions` tokens and passes those positions to the model."""
    if cp_mesh.size() == 1:
        return
    group = cp_mesh.get_group()
    for block in model.layers:
        block.attention.kv_source = GatheredKV(group)
        block.attention.sdpa = ContextParallelAttention(block.attention.sdpa, group)
