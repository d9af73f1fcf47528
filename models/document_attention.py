"""Document masking (`data.document_mask`): packed documents attend only within themselves.

Query i sees key j iff kv_pos[j] <= q_pos[i] (causal, by global position in the packed row) and both
belong to the same document. RoPE positions restart at each document (the attention modules rotate by
`Documents.rope_BS` instead of the global positions), so a document's logits equal those of the
document forwarded alone. The label crossing a boundary (the last token of one document predicting the
first of the next) is not trained: runtime/data.py sets it to IGNORE_INDEX.

CPU path (`document_attention`): query blocks of at most `block` rows; each block attends to its
visible key range only (from the first key of the block's earliest document to its last query), through
SDPA with a boolean [B, 1, Q, K'] mask shared by the heads (SDPA turns it into a float mask of that shape).
So no [S, S] tensor exists per head, nor any [S, S] float at all: the largest mask is block x K'. Each
block whose rows, queries and keys all lie in one document skips the mask: the flash path of
models/block_attention.prefix_causal_attention (long documents: most blocks). A masked block runs under
non-reentrant activation checkpointing when gradients are needed, so backward rebuilds
its mask instead of keeping all of them (S^2/2 floats per row otherwise: 128 MiB at S = 8192 in one
document, per layer); benchmarks/document_attention.py measures time and peak memory against the
unmasked flash path. The key range needs the document ids on the host (one
small device-to-host copy per block): fine on the CPU, a sync per block on CUDA.

CUDA (`flex_document_attention`, chosen for CUDA tensors): FlexAttention with a BlockMask built from
the same predicate (mask_mod: same document and causal), compiled, because it takes any per-row
document layout and the CP chunk layout (query and key positions as index tensors) without repacking,
skips fully masked blocks, needs no host sync and supports MLA's unequal q/k and v widths; a varlen
flash path would need the sequences repacked into cu_seqlens per document and per CP chunk. Its
predicate is checked on the CPU in eager mode against the block path (tests/test_document_mask.py);
the compiled kernel has NOT run on a GPU here (none was available).

Context parallelism: the gathered keys are the whole row in global order, and `Documents.doc_BL` holds
the document id of every token of the row (each rank's loader knows the whole window), so each chunk's
visible keys respect document boundaries with no extra communication, whether or not a document
straddles the CP split (parallel/context_parallel.py calls this function with the gathered keys).

Shape letters: B batch, H heads, S local queries, T keys, L whole sequence, E head width, Q/K one
block's queries/keys.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.block_attention import pad_values, prefix_causal_attention


class Documents(NamedTuple):
    """Where documents lie in a packed micro-batch (data.document_mask)."""
    doc_BL: torch.Tensor  # int64 [B, L] document index of every token of the WHOLE row (global order, non-decreasing)
    rope_BS: torch.Tensor  # int64 [B, S] RoPE positions of this rank's tokens: their offsets in their document

    def to(self, device) -> "Documents":
        return Documents(self.doc_BL.to(device), self.rope_BS.to(device))


def document_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, doc_BL, scale: float,
                       block: int = 512) -> torch.Tensor:
    """Exact causal attention restricted to documents. `q_pos_S` / `kv_pos_T`: global positions (strictly
    increasing; kv_pos_T[0] is the row's first position); `doc_BL` indexed by position - kv_pos_T[0].
    Values narrower than q/k (MLA) are padded for the flash kernel and the output sliced. Local, no
    communication."""
    if q_BHSE.is_cuda:
        return flex_document_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, doc_BL, scale)
    v_width = v_BHTE.shape[-1]
    v_BHTE = pad_values(v_BHTE, q_BHSE.shape[-1])
    base = kv_pos_T[:1]
    q_doc_BS, kv_doc_BT = doc_BL[:, q_pos_S - base], doc_BL[:, kv_pos_T - base]
    outs = []
    for start in range(0, q_BHSE.shape[2], block):
        rows = slice(start, start + block)
        lo, hi = _key_range(q_doc_BS[:, rows], q_pos_S[rows], kv_doc_BT, kv_pos_T)
        if _inside_one_document(q_doc_BS[:, rows], q_pos_S[rows], kv_doc_BT[:, lo:hi], kv_pos_T[lo:hi]):
            outs.append(prefix_causal_attention(q_BHSE[:, :, rows], k_BHTE[:, :, lo:hi], v_BHTE[:, :, lo:hi], scale))
            continue
        args = (q_BHSE[:, :, rows], k_BHTE[:, :, lo:hi], v_BHTE[:, :, lo:hi], q_doc_BS[:, rows], kv_doc_BT[:, lo:hi],
                q_pos_S[rows], kv_pos_T[lo:hi], scale)
        if torch.is_grad_enabled() and q_BHSE.requires_grad:  # backward rebuilds the block's mask: none is kept
            outs.append(checkpoint(_masked_block, *args, use_reentrant=False))
        else:
            outs.append(_masked_block(*args))
    return torch.cat(outs, dim=2)[..., :v_width]


_COMPILED_FLEX = None


def flex_document_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, doc_BL, scale: float,
                            compiled: bool = True) -> torch.Tensor:
    """The same attention through FlexAttention (CUDA; `compiled=False`: eager, e.g. to check it on the CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _COMPILED_FLEX
    base = kv_pos_T[:1]
    q_doc_BS, kv_doc_BT = doc_BL[:, q_pos_S - base], doc_BL[:, kv_pos_T - base]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_doc_BS[b, q_idx] == kv_doc_BT[b, kv_idx]) & (kv_pos_T[kv_idx] <= q_pos_S[q_idx])

    B, _, S, _ = q_BHSE.shape
    block_mask = create_block_mask(same_document_causal, B, None, S, k_BHTE.shape[2], device=q_BHSE.device)
    if compiled and _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    attend = _COMPILED_FLEX if compiled else flex_attention
    # contiguous V: compiled flex inside a compiled block read a strided V wrongly (CPU, torch 2.13)
    return attend(q_BHSE, k_BHTE, v_BHTE.contiguous(), block_mask=block_mask, scale=scale)


def _inside_one_document(q_doc_BQ, q_pos_Q, kv_doc_BK, kv_pos_K) -> bool:
    """Whether every row's queries and keys of the block lie in one document and the queries are the last
    keys: then the mask is plain causal and the mask-free flash path computes the same attention."""
    Q = q_pos_Q.shape[0]
    return bool(kv_pos_K.shape[0] >= Q and torch.equal(kv_pos_K[-Q:], q_pos_Q)
                and (kv_doc_BK == q_doc_BQ[:, :1]).all() and (q_doc_BQ == q_doc_BQ[:, :1]).all())


def _masked_block(q_BHQE, k_BHKE, v_BHKE, q_doc_BQ, kv_doc_BK, q_pos_Q, kv_pos_K, scale: float) -> torch.Tensor:
    """One query block over its key range: SDPA with the boolean [B, 1, Q, K] mask (same document, causal)."""
    visible_BQK = (kv_doc_BK[:, None, :] == q_doc_BQ[:, :, None]) & (kv_pos_K[None, None, :] <= q_pos_Q[None, :, None])
    return F.scaled_dot_product_attention(q_BHQE, k_BHKE, v_BHKE, attn_mask=visible_BQK.unsqueeze(1), scale=scale)


def _key_range(q_doc_BQ, q_pos_Q, kv_doc_BT, kv_pos_T) -> tuple[int, int]:
    """[lo, hi): the keys any query of the block can see. hi: past the last key at or before the block's
    last query; lo: the first key of the earliest document among the block's queries (over all rows)."""
    hi = int(torch.searchsorted(kv_pos_T, q_pos_Q[-1:], right=True))
    first_doc_B = q_doc_BQ.min(dim=1).values
    lo = int(torch.searchsorted(kv_doc_BT, first_doc_B[:, None]).min())
    return lo, hi


def max_document_logits(q_BHSE, k_BHTE, q_pos_S, kv_pos_T, doc_BL, scale: float, block: int = 256,
                        query_pad_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Largest logit per head, fp32 [H], over the pairs document attention computes (QK-clip);
    `query_pad_BS` (bool [B, S]): queries left out (a packed row's padded tail)."""
    base = kv_pos_T[:1]
    q_doc_BS, kv_doc_BT = doc_BL[:, q_pos_S - base], doc_BL[:, kv_pos_T - base]
    q_BHSE, kT_BHET = q_BHSE.float(), k_BHTE.float().transpose(-1, -2)
    best_H = q_BHSE.new_full((q_BHSE.shape[1],), -torch.inf)
    for start in range(0, q_BHSE.shape[2], block):
        rows = slice(start, start + block)
        scores_BHQT = torch.matmul(q_BHSE[:, :, rows], kT_BHET) * scale
        visible_BQT = (kv_doc_BT[:, None, :] == q_doc_BS[:, rows, None]) & (kv_pos_T[None, None, :] <= q_pos_S[None, rows, None])
        if query_pad_BS is not None:
            visible_BQT = visible_BQT & ~query_pad_BS[:, rows, None]
        best_H = torch.maximum(best_H, scores_BHQT.masked_fill(~visible_BQT[:, None], -torch.inf).amax(dim=(0, 2, 3)))
    return best_H
