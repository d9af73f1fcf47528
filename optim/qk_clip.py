"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): rescale the query/key weights of every attention head
whose largest pre-softmax logit of the step exceeded tau, so that its logits on the same inputs scale
by exactly gamma = tau / S_max (S_max -> tau); heads under tau keep their logits.

Per head h with gamma_h = min(1, tau / S_max_h), alpha in [0, 1] (0.5 = K2's even split):
  MLA  query rows of head h: non-rotary (q_nope) * gamma^alpha, rotary (q_rope) * gamma;
       key rows of head h in wkv_b (k_nope) * gamma^(1 - alpha); the shared rotary key is never scaled.
       Logits q_nope.k_nope + q_rope.k_rope then scale by gamma^alpha gamma^(1-alpha) = gamma and gamma.
  GQA  a key head is shared by the H/G query heads of its group, so it takes the factor of the group's
       most violating head: s_k = (min_h gamma_h)^(1 - alpha); each query head then takes
       s_q,h = gamma_h / s_k, so every head's logits scale by exactly its own gamma_h (a non-violating
       head of a violating group gets its queries scaled UP by 1 / s_k, leaving its logits unchanged).
RoPE rotates q and k linearly per position, so scaling whole rows commutes with it.

Where communication happens: `qk_clip_` takes one MAX all-reduce of the [layers, heads] maxima over all
ranks (data-, context- and expert-parallel ranks all ran attention on their own tokens); the scaling is
local: each rank multiplies the rows of its own shard (box from the DTensor placements).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.boxes import dtensor_box


def clip_factors(max_logit_H: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma_h = min(1, tau / S_max_h), fp32 [H]."""
    return torch.clamp(tau / max_logit_H.clamp_min(1e-30), max=1.0)


def mla_row_scales(gamma_H, alpha: float, nope: int, rope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale of each query row [H*(nope+rope)], scale of each wkv_b row [H*(nope+v)])."""
    H = gamma_H.shape[0]
    q_HE = torch.cat([gamma_H[:, None].pow(alpha).expand(H, nope), gamma_H[:, None].expand(H, rope)], dim=1)
    kv_HE = torch.cat([gamma_H[:, None].pow(1 - alpha).expand(H, nope), torch.ones(H, v_dim)], dim=1)
    return q_HE.flatten(), kv_HE.flatten()


def gqa_row_scales(gamma_H, alpha: float, n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale of each wq row [H*E], scale of each wk row [G*E]); query head h uses kv head h // (H/G)."""
    gamma_GQ = gamma_H.view(n_kv_heads, -1)
    k_G = gamma_GQ.min(dim=1).values.pow(1 - alpha)
    q_H = (gamma_GQ / k_G[:, None]).flatten()
    return q_H.repeat_interleave(head_dim), k_G.repeat_interleave(head_dim)


@torch.no_grad()
def scale_rows_(param: torch.Tensor, scale_R: torch.Tensor) -> None:
    """param[r, :] *= scale_R[r] on the rows this rank holds (a DTensor's local shard, or a plain tensor)."""
    (start, stop) = dtensor_box(param)[0]
    local = param.to_local() if isinstance(param, DTensor) else param
    local.mul_(scale_R[start:stop].to(local)[:, None])


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [block.attention for block in model.layers]


def _recorder(attention: nn.Module):
    sdpa = attention.sdpa
    return getattr(sdpa, "local_sdpa", sdpa)  # under context parallelism the local attention is wrapped


def enable_recording(model: nn.Module) -> None:
    """Make every layer's attention record its per-head max logit in training-mode forwards."""
    for attention in attention_modules(model):
        _recorder(attention).record_max_logits = True


def reset_recording(model: nn.Module) -> None:
    for attention in attention_modules(model):
        _recorder(attention).max_logit_H = None


def step_max_logits(model: nn.Module) -> torch.Tensor:
    """The step's max logit per layer and head, fp32 [L, H], MAX over all ranks (collective)."""
    maxima = [_recorder(a).max_logit_H for a in attention_modules(model)]
    device = next(m for m in maxima if m is not None).device if any(m is not None for m in maxima) else "cpu"
    max_LH = torch.stack([m if m is not None else torch.full((a.n_heads,), -torch.inf, device=device)
                          for m, a in zip(maxima, attention_modules(model))])
    if dist.is_initialized():
        dist.all_reduce(max_LH, op=dist.ReduceOp.MAX)  # communication: L*H floats, once per step
    return max_LH


@torch.no_grad()
def qk_clip_(model: nn.Module, tau: float, alpha: float = 0.5) -> tuple[float, int]:
    """Apply QK-clip after an optimizer step; returns (the step's largest logit, heads clipped).

    Collective: every rank must call it. Resets the recorded maxima for the next step."""
    max_LH = step_max_logits(model)
    for attention, max_H in zip(attention_modules(model), max_LH.cpu()):
        gamma_H = clip_factors(max_H, tau)
        if bool((gamma_H < 1).any()):
            _clip_layer_(attention, gamma_H, alpha)
    reset_recording(model)
    return float(max_LH.max()), int((max_LH > tau).sum())


def _clip_layer_(attention: nn.Module, gamma_H: torch.Tensor, alpha: float) -> None:
    if hasattr(attention, "wkv_b"):  # MLA
        q_R, kv_R = mla_row_scales(gamma_H, alpha, attention.nope, attention.rope_dim, attention.v_dim)
        scale_rows_(attention.wq.weight if hasattr(attention, "wq") else attention.wq_b.weight, q_R)
        scale_rows_(attention.wkv_b.weight, kv_R)
    else:  # GQA
        q_R, k_R = gqa_row_scales(gamma_H, alpha, attention.n_kv_heads, attention.head_dim)
        scale_rows_(attention.wq.weight, q_R)
        scale_rows_(attention.wk.weight, k_R)
