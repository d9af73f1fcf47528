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

Use in a training step (runtime/train.py):
  1. after forward/backward: `max_LH = step_max_logits(model)`: one MAX all-reduce of the [layers, heads]
     maxima over all ranks (data-, context- and expert-parallel ranks all ran attention on their own
     tokens; pipeline stages each fill their own layers' rows); `clip_metrics(max_LH, tau)` (the step's largest logit and clipped-head count, on device)
     joins the step's one host readback (loss, grad norm), so QK-clip adds no host sync of its own;
  2. after the optimizer step: `qk_clip_(model, max_LH, tau, alpha)`: clip factors on device, and each
     rank multiplies the rows of its own shard (of its own layers) in place (box from the DTensor placements); no
     communication, no host readback.
Padded positions (post-training rows are padded at the end) are left out of the maxima inside
`padding_ignored(model, pad_BS)`.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.boxes import dtensor_box


def clip_factors(max_logit_H: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma_h = tau / S_max_h where S_max_h > tau, else exactly 1 (a NaN maximum is not clipped), fp32 [H],
    on max_logit_H's device (no host readback)."""
    return torch.where(max_logit_H > tau, tau / max_logit_H, torch.ones_like(max_logit_H))


def mla_row_scales(gamma_H, alpha: float, nope: int, rope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale of each query row [H*(nope+rope)], scale of each wkv_b row [H*(nope+v)])."""
    H = gamma_H.shape[0]
    q_HE = torch.cat([gamma_H[:, None].pow(alpha).expand(H, nope), gamma_H[:, None].expand(H, rope)], dim=1)
    kv_HE = torch.cat([gamma_H[:, None].pow(1 - alpha).expand(H, nope), gamma_H.new_ones(H, v_dim)], dim=1)
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
    """Make every layer's attention record its per-head max logit in training-mode forwards, into an fp32
    [H] tensor of -inf made here on the attention's device (call after the model has its storage): one
    tensor for the whole run, updated in place, so a compiled attention sees the same input every step."""
    for attention in attention_modules(model):
        recorder = _recorder(attention)
        recorder.record_max_logits = True
        recorder.max_logit_H = torch.full((attention.n_heads,), -torch.inf, device=attention.wo.weight.device)


def reset_recording(model: nn.Module) -> None:
    """Forget the maxima recorded so far (-inf in place where `enable_recording` made the tensor)."""
    for attention in attention_modules(model):
        recorder = _recorder(attention)
        if recorder.max_logit_H is not None:
            recorder.max_logit_H.fill_(-torch.inf)


def layer_indices(model: nn.Module) -> list[int]:
    """The whole-model index of each block of `model.layers` (a pipeline stage holds some: parallel/pp/part.py)."""
    return [int(name) for name, _ in model.layers.named_children()]


def step_max_logits(model: nn.Module) -> torch.Tensor:
    """The step's max logit per layer and head, fp32 [L, H] over ALL the model's L layers, MAX over all ranks
    (collective); -inf where nothing was recorded. Under pipeline parallelism a rank fills the rows of its
    stages' layers and -inf elsewhere, so the one MAX over the world is per layer across the stages."""
    attentions = attention_modules(model)
    maxima = [_recorder(a).max_logit_H for a in attentions]
    device = next(m for m in maxima if m is not None).device if any(m is not None for m in maxima) else "cpu"
    n_heads = attentions[0].n_heads if attentions else model.config.n_heads
    max_LH = torch.full((model.config.n_layers, n_heads), -torch.inf, device=device)
    for layer, m in zip(layer_indices(model), maxima):
        if m is not None:
            max_LH[layer] = m
    if dist.is_initialized():
        dist.all_reduce(max_LH, op=dist.ReduceOp.MAX)  # communication: L*H floats, once per step
    return max_LH


def clip_metrics(max_LH: torch.Tensor, tau: float) -> torch.Tensor:
    """[the step's largest logit, the number of heads over tau], fp32 on max_LH's device: the caller
    reads them back with its other step values (one host sync for all)."""
    return torch.stack([max_LH.max(), (max_LH > tau).sum().float()])


@contextlib.contextmanager
def padding_ignored(model: nn.Module, pad_BS: torch.Tensor | None):
    """Within the block, attention records no logit of a padded query (pad_BS: bool [B, S], this rank's
    positions in the model's input order; None = no padding). Rows must be padded at the end: a real
    query then sees only real keys (causal), so padded keys drop out too. Keep the block open through
    backward: activation checkpointing reruns attention there, and it records again."""
    recorders = [_recorder(a) for a in attention_modules(model)]
    for recorder in recorders:
        recorder.query_pad_BS = pad_BS
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.query_pad_BS = None


@torch.no_grad()
def qk_clip_(model: nn.Module, max_LH: torch.Tensor, tau: float, alpha: float = 0.5) -> None:
    """Apply QK-clip after an optimizer step, from the step's maxima `max_LH` ([L, H], `step_max_logits`):
    every head over tau gets its factor; rows whose factor is 1 (heads under tau, and every row of a
    layer or GQA group without a violating head) are multiplied by exactly 1, so stay bitwise unchanged.
    Local (no communication) and free of host syncs: the factors stay on the device."""
    for layer, attention in zip(layer_indices(model), attention_modules(model)):
        _clip_layer_(attention, clip_factors(max_LH[layer], tau), alpha)


def _clip_layer_(attention: nn.Module, gamma_H: torch.Tensor, alpha: float) -> None:
    if hasattr(attention, "wkv_b"):  # MLA
        q_R, kv_R = mla_row_scales(gamma_H, alpha, attention.nope, attention.rope_dim, attention.v_dim)
        scale_rows_(attention.wq.weight if hasattr(attention, "wq") else attention.wq_b.weight, q_R)
        scale_rows_(attention.wkv_b.weight, kv_R)
    else:  # GQA
        q_R, k_R = gqa_row_scales(gamma_H, alpha, attention.n_kv_heads, attention.head_dim)
        scale_rows_(attention.wq.weight, q_R)
        scale_rows_(attention.wk.weight, k_R)
