"""Attention: multi-head latent attention (MLA, DeepSeek-V2/V3) and grouped-query attention (GQA).

Both project to per-head q/k/v, apply RoPE at the given global positions, and call
`self.sdpa(q_BHSE, k_BHSE, v_BHSE, q_pos_S, kv_pos_S, scale)`. The keys' compact form (MLA: the
latent and the shared rotary key; GQA: keys and values per kv head) passes through
`self.kv_source(*tensors, positions_S=...)` before it is expanded to H heads: the identity here, a
KV cache when decoding, an all-gather over the cp ranks under context parallelism. `sdpa` and
`kv_source` are parameter-free submodules; context parallelism replaces both without touching the
projections (parallel/context_parallel.py).

Shape letters: B batch, S sequence, D model dim, H query heads, G kv heads (GQA), E head width
(qk or v, as named), R rotary width, C compressed (latent) width, T keys (S, or cached + S when
decoding, or the whole sequence under context parallelism).
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.block_attention import pad_values, sdpa_needs_padded_values
from models.config import ModelConfig
from models.document_attention import Documents, document_attention, max_document_logits
from models.kv_cache import LayerCache
from models.layers import RMSNorm, apply_rope, rope_cos_sin
from models.region import Region
from models.splits import WHOLE, MatrixSplit, per_head_cols, per_head_rows


class LocalKV(nn.Module):
    """`kv_source` without a cache or context parallelism: the keys are this chunk's own tokens."""

    def forward(self, *tensors_BS: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*tensors_BS, positions_S)


class CausalAttention(nn.Module):
    """Exact causal softmax attention by global positions: query i sees key j iff kv_pos[j] <= q_pos[i].

    When `q_pos_S is kv_pos_S` (self-attention over one chunk), the positions are strictly
    increasing (Transformer.forward checks this), so the mask equals the plain lower-triangular
    one and SDPA runs with `is_causal=True` and no mask. Otherwise (decoding with a cache) an
    explicit boolean [Sq, Skv] mask is built. Every query must see at least one key, or its row is
    undefined. Values narrower than q/k (MLA) are zero-padded to the q/k width and the output sliced
    where torch would otherwise run its math fallback (the CPU flash kernel takes one width), so a
    fused kernel runs; not where a fused kernel takes them as they are (cuDNN, memory-efficient on
    CUDA) (models/block_attention.py; benchmarks/attention_kernels.py measures it).

    With `record_max_logits` set (QK-clip, optim/qk_clip.py), training-mode forwards also keep the
    largest pre-softmax logit per head seen since the last reset in `max_logit_H` (fp32 [H]). Under
    context parallelism `record` is called with the gathered keys, so each rank records its own
    queries against every key they see; the step's MAX over ranks is taken by the clip. While
    `query_pad_BS` (bool [B, S], set by optim/qk_clip.padding_ignored) is set, padded queries are
    left out (rows padded at the end: real queries see only real keys).
    """

    def __init__(self):
        super().__init__()
        self.record_max_logits, self.max_logit_H, self.query_pad_BS = False, None, None

    def forward(self, q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, scale: float, documents: Documents | None = None):
        """`documents` (data.document_mask): attention only within documents (models/document_attention.py)."""
        self.record(q_BHSE, k_BHTE, q_pos_S, kv_pos_T, scale, documents)
        if documents is not None:
            return document_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, documents.doc_BL, scale,
                                      block_mask=documents.block_mask)
        v_width = v_BHTE.shape[-1]
        causal = q_pos_S is kv_pos_T
        mask_ST = None if causal else kv_pos_T[None, :] <= q_pos_S[:, None]
        if sdpa_needs_padded_values(q_BHSE, k_BHTE, v_BHTE, mask_ST, causal, scale):
            v_BHTE = pad_values(v_BHTE, q_BHSE.shape[-1])
        out_BHSE = F.scaled_dot_product_attention(q_BHSE, k_BHTE, v_BHTE, attn_mask=mask_ST, is_causal=causal,
                                                  scale=scale)
        return out_BHSE[..., :v_width]

    def record(self, q_BHSE, k_BHTE, q_pos_S, kv_pos_T, scale: float, documents: Documents | None = None) -> None:
        """Fold these logits' per-head maxima into `max_logit_H` (training-mode forwards, when enabled)."""
        if self.record_max_logits and self.training:
            if documents is not None:
                seen_H = max_document_logits(q_BHSE, k_BHTE, q_pos_S, kv_pos_T, documents.doc_BL, scale,
                                             query_pad_BS=self.query_pad_BS)
            else:
                seen_H = max_logits(q_BHSE, k_BHTE, q_pos_S, kv_pos_T, scale, query_pad_BS=self.query_pad_BS)
            if self.max_logit_H is None:
                self.max_logit_H = seen_H
            else:  # in place: the tensor optim/qk_clip.enable_recording made stays, so compiled code never recompiles
                self.max_logit_H.copy_(torch.maximum(self.max_logit_H, seen_H))


@torch.no_grad()
def max_logits(q_BHSE, k_BHSE, q_pos_S, kv_pos_S, scale: float, block: int = 256,
               query_pad_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Largest causal logit scale * q.k per head, fp32 [H], by blocks of `block` queries: the
    [B, H, block, Skv] scores of one block exist at a time, never the whole [S, S] (fused attention
    kernels do not expose their logits). Costs one extra Q K^T, and no host synchronization: on CUDA
    in the compute dtype with fp32 output (`bmm(..., out_dtype=float32)`, the same products of the same
    bf16/fp16 values, accumulated in fp32), elsewhere on fp32 copies (the CPU has no bmm with out_dtype
    on torch 2.13). `query_pad_BS` (bool [B, Sq]): queries left out (-inf where a head sees none)."""
    if not _scores_in_compute_dtype(q_BHSE):
        q_BHSE, k_BHSE = q_BHSE.float(), k_BHSE.float()
    kT_BHES = k_BHSE.transpose(-1, -2)
    best_H = torch.full((q_BHSE.shape[1],), -torch.inf, device=q_BHSE.device)
    for start in range(0, q_BHSE.shape[2], block):
        scores_BHQK = _fp32_scores(q_BHSE[:, :, start:start + block], kT_BHES) * scale
        hidden_QK = kv_pos_S[None, :] > q_pos_S[start:start + block, None]
        if query_pad_BS is not None:  # [B, 1, Q, K]: a padded query hides its whole row
            hidden_QK = hidden_QK | query_pad_BS[:, None, start:start + block, None]
        best_H = torch.maximum(best_H, scores_BHQK.masked_fill(hidden_QK, -torch.inf).amax(dim=(0, 2, 3)))
    return best_H


def _scores_in_compute_dtype(q_BHSE: torch.Tensor) -> bool:
    return q_BHSE.is_cuda and q_BHSE.dtype in (torch.bfloat16, torch.float16)


def _fp32_scores(q_BHQE: torch.Tensor, kT_BHEK: torch.Tensor) -> torch.Tensor:
    """q k^T as fp32 [B, H, Q, K]: one bmm with fp32 output for CUDA half inputs, else fp32 inputs' matmul."""
    if q_BHQE.dtype == torch.float32:
        return torch.matmul(q_BHQE, kT_BHEK)
    B, H, Q, _ = q_BHQE.shape
    scores = torch.bmm(q_BHQE.flatten(0, 1), kT_BHEK.expand(B, H, -1, -1).flatten(0, 1), out_dtype=torch.float32)
    return scores.view(B, H, Q, -1)


class MLA(Region):
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1), non-absorbed training form.

    q = wq_b(q_norm(wq_a x)) (or wq x)            -> per head [nope | rope]
    [c_kv | k_rope] = wkv_a x                       (k_rope shared by all heads)
    [k_nope | v] = wkv_b(kv_norm(c_kv))             -> per head [nope | v]
    out = wo(attention(q, [k_nope | k_rope], v))
    """

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.kv_lora_rank = c.n_heads, c.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rope = c.rope()
        self.scale = c.qk_head_dim**-0.5 * self.rope.softmax_scale_factor()
        q_out = c.n_heads * c.qk_head_dim
        if c.q_lora_rank == 0:
            self.wq = nn.Linear(c.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(c.q_lora_rank, c.mla_latent_norm_eps)
            self.wq_b = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.mla_latent_norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)
        self.kv_source, self.sdpa = LocalKV(), CausalAttention()

    def body(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, cache: LayerCache | None = None,
             documents: Documents | None = None) -> torch.Tensor:
        """`cache` (decoding): the latent and rotary key of earlier tokens; these tokens' are appended.
        `documents`: RoPE restarts per document and attention stays inside documents (cos/sin then [B, S, R])."""
        B, S, _ = x_BSD.shape
        cos_SR, sin_SR = rope_cos_sin(positions_S if documents is None else documents.rope_BS, self.rope)
        q_BSHE = self._queries(x_BSD).view(B, S, self.n_heads, self.nope + self.rope_dim)
        q_nope_BSHE, q_rope_BSHR = q_BSHE.split([self.nope, self.rope_dim], dim=-1)
        q_BSHE = torch.cat([q_nope_BSHE, apply_rope(q_rope_BSHR, cos_SR, sin_SR)], dim=-1)

        c_kv_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope_BS1R = apply_rope(k_rope_BSR.unsqueeze(2), cos_SR, sin_SR)
        # T = these tokens, or every cached token plus these, or (cp) the whole sequence's
        kv_source = self.kv_source if cache is None else cache.extend
        c_kv_BTC, k_rope_BT1R, kv_pos_T = kv_source(c_kv_BSC, k_rope_BS1R, positions_S=positions_S)
        T = c_kv_BTC.shape[1]
        kv_BTHE = self.wkv_b(self.kv_norm(c_kv_BTC)).view(B, T, self.n_heads, self.nope + self.v_dim)
        k_nope_BTHE, v_BTHE = kv_BTHE.split([self.nope, self.v_dim], dim=-1)
        k_BTHE = torch.cat([k_nope_BTHE, k_rope_BT1R.expand(-1, -1, self.n_heads, -1)], dim=-1)

        extra = {} if documents is None else {"documents": documents}
        out_BHSE = self.sdpa(
            q_BSHE.transpose(1, 2), k_BTHE.transpose(1, 2), v_BTHE.transpose(1, 2),
            positions_S, kv_pos_T, self.scale, **extra,
        )
        return self.wo(out_BHSE.transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim))

    def _queries(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x_BSD)
        return self.wq_b(self.q_norm(self.wq_a(x_BSD)))

    def muon_splits(self) -> dict[str, MatrixSplit]:
        """Per-head blocks for the up-projections and wo; the shared down-projections are whole."""
        per_head = per_head_rows(self.n_heads)
        splits = {"wkv_a.weight": WHOLE, "wkv_b.weight": per_head, "wo.weight": per_head_cols(self.n_heads)}
        if hasattr(self, "wq"):
            splits["wq.weight"] = per_head
        else:
            splits.update({"wq_a.weight": WHOLE, "wq_b.weight": per_head})
        return splits


class GQA(Region):
    """Grouped-query attention (Ainslie et al. 2023): G kv heads, each shared by H/G query heads."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.rope = c.rope()
        self.scale = c.head_dim**-0.5 * self.rope.softmax_scale_factor()
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.kv_source, self.sdpa = LocalKV(), CausalAttention()

    def body(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, cache: LayerCache | None = None,
             documents: Documents | None = None) -> torch.Tensor:
        """`cache` (decoding): keys and values per kv head of earlier tokens; these tokens' are appended.
        `documents`: as in MLA.body."""
        B, S, _ = x_BSD.shape
        cos_SR, sin_SR = rope_cos_sin(positions_S if documents is None else documents.rope_BS, self.rope)
        q_BSHE = apply_rope(self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim), cos_SR, sin_SR)
        k_BSGE = apply_rope(self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim), cos_SR, sin_SR)
        v_BSGE = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        # T = these tokens, or every cached token plus these, or (cp) the whole sequence's
        kv_source = self.kv_source if cache is None else cache.extend
        k_BTGE, v_BTGE, kv_pos_T = kv_source(k_BSGE, v_BSGE, positions_S=positions_S)
        # kv head g serves query heads [g * H/G, (g+1) * H/G)
        group = self.n_heads // self.n_kv_heads
        k_BTHE = k_BTGE.repeat_interleave(group, dim=2)
        v_BTHE = v_BTGE.repeat_interleave(group, dim=2)
        extra = {} if documents is None else {"documents": documents}
        out_BHSE = self.sdpa(
            q_BSHE.transpose(1, 2), k_BTHE.transpose(1, 2), v_BTHE.transpose(1, 2),
            positions_S, kv_pos_T, self.scale, **extra,
        )
        return self.wo(out_BHSE.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))

    def muon_splits(self) -> dict[str, MatrixSplit]:
        return {
            "wq.weight": per_head_rows(self.n_heads),
            "wk.weight": per_head_rows(self.n_kv_heads),
            "wv.weight": per_head_rows(self.n_kv_heads),
            "wo.weight": per_head_cols(self.n_heads),
        }


def build_attention(c: ModelConfig) -> nn.Module:
    return MLA(c) if c.attn == "mla" else GQA(c)
