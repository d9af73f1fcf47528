"""Fused attention kernels for causal attention: flash eligibility, and one query chunk over
[fully visible prefix | causal diagonal] keys without a mask.

Flash kernels need one head width for q, k and v. MLA's values are narrower (128 vs 192 for
DeepSeek-V3 / Kimi K2), so `pad_values` zero-pads them to the q/k width: the padded output
columns are exactly zero and are sliced off, the kept ones are the same sums.

`prefix_causal_attention(q, k, v)`: Q queries; K = prefix + Q keys, query i sees keys
[0, prefix + i]. That is context parallelism's block (parallel/context_parallel.py). It runs as two
flash calls, one over the prefix without a mask and one over the diagonal with `is_causal`, merged
exactly by their log-sum-exps (Milakov & Gimelshein 2018; Dao 2023, FlashAttention-2 sec. 3.1):
    lse = logaddexp(lse_p, lse_d),  out = exp(lse_p - lse) out_p + exp(lse_d - lse) out_d.
Backward runs each piece's flash backward with the merged out and lse (the softmax statistics of
the whole row), which gives each piece's exact gradients (as ring attention does). No [Q, K] tensor
exists. Where no flash kernel fits (e.g. fp32 on CUDA), one SDPA call with a lower-right boolean
[Q, K] mask gives the same result.

Private ATen ops (this module only; checked on torch 2.13): `torch._fused_sdp_choice` (which SDPA kernel
torch would run), `_scaled_dot_product_flash_attention_for_cpu`
(+ `_backward`) on the CPU, `_scaled_dot_product_flash_attention` (+ `_backward`) on CUDA (fp16/bf16).
The CPU pair is exercised by tests/ranks/test_attention.py; the CUDA pair follows torch's own ring attention
(torch/distributed/tensor/experimental/_context_parallel/_attention.py) and has not run on a GPU here.

Shape letters: B batch, H heads, Q queries, K keys (prefix + Q), E head width.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

aten = torch.ops.aten
CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)
CUDA_FLASH_MAX_HEAD = 256


def pad_values(v_BHKE: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the value head width up to `width` (no-op when already as wide)."""
    return v_BHKE if v_BHKE.shape[-1] >= width else F.pad(v_BHKE, (0, width - v_BHKE.shape[-1]))


def sdpa_needs_padded_values(q_BHQE, k_BHKE, v_BHKE, attn_mask=None, is_causal: bool = False,
                             scale: float | None = None) -> bool:
    """Whether SDPA should get values zero-padded to the q/k width: only where torch would run its math
    fallback on the narrower values (the CPU flash kernel takes one width; cuDNN and memory-efficient
    attention on CUDA take 192/128 natively, and padding would only cost them a third more work).
    Asks torch's own dispatcher (`torch._fused_sdp_choice`, private, checked on torch 2.13)."""
    if v_BHKE.shape[-1] >= q_BHQE.shape[-1]:
        return False
    if torch.compiler.is_compiling():  # the dispatcher's int cannot be traced: on the CPU it is always MATH here
        return q_BHQE.device.type == "cpu"
    choice = torch._fused_sdp_choice(q_BHQE, k_BHKE, v_BHKE, attn_mask, 0.0, is_causal, scale=scale)
    return SDPBackend(choice) == SDPBackend.MATH


def flash_with_lse_available(q_BHQE: torch.Tensor) -> bool:
    """Whether `prefix_causal_attention` can run the flash pair on q's device and dtype."""
    if q_BHQE.device.type == "cpu":  # not float64: the kernels' lse is fp32, too coarse for the merge
        return q_BHQE.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if q_BHQE.device.type == "cuda":
        E = q_BHQE.shape[-1]
        return q_BHQE.dtype in CUDA_FLASH_DTYPES and E <= CUDA_FLASH_MAX_HEAD and E % 8 == 0
    return False


def _flash_forward(q, k, v, causal: bool, scale: float):
    """(out, lse fp32 [B, H, Q], what the backward needs)."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(grad_out, q, k, v, out, lse, aux, causal: bool, scale: float):
    """(dq, dk, dv) of one piece, given the merged row's out and lse."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)[:3]


def merge_by_lse(out_p, lse_p, out_d, lse_d) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two key sets from each set's (out, lse); fp32 math, out in out_p's dtype."""
    lse = torch.logaddexp(lse_p, lse_d).contiguous()  # contiguous for the flash backward, as torch ring attention does
    w_p, w_d = torch.exp(lse_p - lse).unsqueeze(-1), torch.exp(lse_d - lse).unsqueeze(-1)
    return (w_p * out_p.float() + w_d * out_d.float()).to(out_p.dtype), lse


class _PrefixCausalFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHQE, k_BHKE, v_BHKE, scale):
        # Contiguous q and key/value pieces, as torch's own ring attention passes them to the same ops
        # (its comment: the loss is bad otherwise); here they arrive as transposed [B, T, H, E] views.
        prefix = k_BHKE.shape[2] - q_BHQE.shape[2]
        q_BHQE = q_BHQE.contiguous()
        k_p, k_d, v_p, v_d = (t.contiguous() for t in (k_BHKE[:, :, :prefix], k_BHKE[:, :, prefix:],
                                                         v_BHKE[:, :, :prefix], v_BHKE[:, :, prefix:]))
        out_p, lse_p, aux_p = _flash_forward(q_BHQE, k_p, v_p, False, scale)
        out_d, lse_d, aux_d = _flash_forward(q_BHQE, k_d, v_d, True, scale)
        out_BHQE, lse_BHQ = merge_by_lse(out_p, lse_p, out_d, lse_d)
        ctx.save_for_backward(q_BHQE, k_p, k_d, v_p, v_d, out_BHQE, lse_BHQ)
        ctx.scale, ctx.aux = scale, (aux_p, aux_d)
        return out_BHQE

    @staticmethod
    def backward(ctx, grad_BHQE):
        q, k_p, k_d, v_p, v_d, out, lse = ctx.saved_tensors
        grad_BHQE = grad_BHQE.contiguous()
        dq_p, dk_p, dv_p = _flash_backward(grad_BHQE, q, k_p, v_p, out, lse, ctx.aux[0], False, ctx.scale)
        dq_d, dk_d, dv_d = _flash_backward(grad_BHQE, q, k_d, v_d, out, lse, ctx.aux[1], True, ctx.scale)
        return dq_p + dq_d, torch.cat([dk_p, dk_d], dim=2), torch.cat([dv_p, dv_d], dim=2), None


def lower_right_mask(n_queries: int, n_keys: int, device) -> torch.Tensor:
    """bool [Q, K]: query i sees keys [0, K - Q + i]."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries)


def prefix_causal_attention(q_BHQE, k_BHKE, v_BHKE, scale: float) -> torch.Tensor:
    """Attention of Q queries over K = prefix + Q keys, query i seeing keys [0, prefix + i]
    (module docstring). q, k, v share one head width (see `pad_values`)."""
    prefix = k_BHKE.shape[2] - q_BHQE.shape[2]
    assert prefix >= 0 and q_BHQE.shape[-1] == k_BHKE.shape[-1] == v_BHKE.shape[-1]
    if prefix == 0:
        return F.scaled_dot_product_attention(q_BHQE, k_BHKE, v_BHKE, is_causal=True, scale=scale)
    if flash_with_lse_available(q_BHQE):
        return _PrefixCausalFlash.apply(q_BHQE, k_BHKE, v_BHKE, scale)
    mask_QK = lower_right_mask(q_BHQE.shape[2], k_BHKE.shape[2], q_BHQE.device)
    return F.scaled_dot_product_attention(q_BHQE, k_BHKE, v_BHKE, attn_mask=mask_QK, scale=scale)
