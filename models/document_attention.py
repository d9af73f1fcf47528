"""Document masking (`data.document_mask`): packed documents attend only within themselves.

Query i sees key j iff kv_pos[j] <= q_pos[i] (causal, by global position in the packed row) and both
belong to the same document. RoPE positions restart at each document (the attention modules rotate by
`Documents.rope_BS` instead of the global positions), so a document's logits equal those of the
document forwarded alone. The label crossing a boundary (the last token of one document predicting the
first of the next) is not trained: runtime/data/loader.py sets it to IGNORE_INDEX.

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

CUDA (`flex_document_attention`, chosen when `Documents.block_mask` is set, which `prepared` does for
CUDA tensors): FlexAttention with a BlockMask built from the same predicate (mask_mod: same document and
causal), compiled, because it takes any per-row document layout and the CP chunk layout (query and key
positions as index tensors) without repacking, skips fully masked blocks, needs no host sync and supports
MLA's unequal q/k and v widths; a varlen flash path would need the sequences repacked into cu_seqlens per
document and per CP chunk. The BlockMask is the same for every layer: `prepared` builds it once per
micro-batch (runtime/train.py), outside the compiled blocks (building it costs 12-47 ms and cannot be
traced inside one), and it travels with the documents into them. Inside a compiled block flex is traced
into the block's graph; its mask_mod is a closure over the document ids, which dynamo takes as graph
inputs, so new document boundaries recompile nothing (tests/ranks/test_compile.py). Its predicate is checked on
the CPU in eager mode against the block path (tests/ranks/test_document_mask.py), and its compiled form in no_grad
inside a compiled block (tests/ranks/test_compile.py; FlexAttention has no CPU backward in torch 2.13); the kernel
has NOT run on a GPU here (none was available).

Under `training.compile` on the CPU the block path stays eager: its key ranges and its mask-free shortcut
are host reads of the document ids (data-dependent shapes, a new graph per document layout), so each
block's attention is left out of the compiled regions (parallel/compile.py).

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
    block_mask: object = None  # FlexAttention BlockMask of this rank's queries over the row's keys (`prepared`)

    def to(self, device) -> "Documents":
        mask = None if self.block_mask is None else self.block_mask.to(device)
        return Documents(self.doc_BL.to(device), self.rope_BS.to(device), mask)


def flex_path(device: torch.device) -> bool:
    """Whether document attention runs FlexAttention on `device` (CUDA), else the block path."""
    return torch.device(device).type == "cuda"


def prepared(documents: Documents, positions_S: torch.Tensor) -> Documents:
    """`documents` as the attention of every layer reads them: on the flex path with the BlockMask of the
    queries at `positions_S` over the whole row's keys (positions 0..L-1 of `doc_BL`: the local keys, or
    under CP the gathered ones); elsewhere unchanged. Once per micro-batch, outside compiled blocks."""
    if not flex_path(documents.doc_BL.device):
        return documents
    kv_pos_L = torch.arange(documents.doc_BL.shape[1], device=positions_S.device)
    return documents._replace(block_mask=document_block_mask(documents.doc_BL, positions_S, kv_pos_L))


def document_block_mask(doc_BL, q_pos_S, kv_pos_T):
    """The FlexAttention BlockMask of queries at `q_pos_S` over keys at `kv_pos_T` (same document, causal)."""
    from torch.nn.attention.flex_attention import create_block_mask

    base = kv_pos_T[:1]
    q_doc_BS, kv_doc_BT = doc_BL[:, q_pos_S - base], doc_BL[:, kv_pos_T - base]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_doc_BS[b, q_idx] == kv_doc_BT[b, kv_idx]) & (kv_pos_T[kv_idx] <= q_pos_S[q_idx])

    B, S, T = doc_BL.shape[0], q_pos_S.shape[0], kv_pos_T.shape[0]
    return create_block_mask(same_document_causal, B, None, S, T, device=doc_BL.device)


def document_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, doc_BL, scale: float,
                       block: int = 512, block_mask=None) -> torch.Tensor:
    """Exact causal attention restricted to documents. `q_pos_S` / `kv_pos_T`: global positions (strictly
    increasing; kv_pos_T[0] is the row's first position); `doc_BL` indexed by position - kv_pos_T[0].
    `block_mask` (`Documents.block_mask`) or CUDA tensors: FlexAttention; else the block path, where
    values narrower than q/k (MLA) are padded for the flash kernel and the output sliced. Local, no
    communication."""
    if block_mask is not None or flex_path(q_BHSE.device):
        return flex_document_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, doc_BL, scale,
                                       block_mask=block_mask)
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
                            compiled: bool = True, block_mask=None) -> torch.Tensor:
    """The same attention through FlexAttention (`compiled=False`: eager, e.g. to check it on the CPU).
    `block_mask`: `document_block_mask` of these positions, built by the caller; None builds it here,
    which a compiled block cannot (ValueError)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if block_mask is None:
        if torch.compiler.is_compiling():
            raise ValueError("document masking in a compiled block needs Documents.block_mask, built outside "
                             "the block (models/document_attention.prepared)")
        block_mask = document_block_mask(doc_BL, q_pos_S, kv_pos_T)
    assert block_mask.seq_lengths == (q_BHSE.shape[2], k_BHTE.shape[2]), (block_mask.seq_lengths, q_BHSE.shape)
    if torch.compiler.is_compiling() or not compiled:  # in a compiled block: traced into its graph
        attend = flex_attention
    else:
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention)
        attend = _COMPILED_FLEX
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


@torch.no_grad()
def max_document_logits(q_BHSE, k_BHTE, q_pos_S, kv_pos_T, doc_BL, scale: float, block: int = 256,
                        query_pad_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Largest logit per head, fp32 [H], over the pairs document attention computes (QK-clip);
    `query_pad_BS` (bool [B, S]): queries left out (a packed row's padded tail). No grad: a checkpointed
    recompute records nothing, so the forward must save nothing for it either."""
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
