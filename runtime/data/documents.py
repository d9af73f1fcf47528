"""Document masking on the data side (`data.document_mask`): for each packed window, which document each
token belongs to, its RoPE position inside that document, and which labels cross a boundary.

A window of L + 1 tokens starting at token a of a source with document starts D (sorted, from the
Megatron index): token a + i is in window document d_i = #{D <= a + i} - #{D <= a} (0 for the document
the window starts in, which counts from the window's first token). Inputs are tokens 0..L-1, labels
1..L; label i is not trained (IGNORE_INDEX) when token i + 1 starts a new document: the last token of
one document never predicts the first of the next. The step's trained-label count (the loss's global
denominator) is B * L minus the document starts inside (a, a + L] of every row: every rank computes
it for the whole step from the window starts alone, without communication.

Letters: B rows, W = L + 1 window tokens, L = seq_len, S = this rank's tokens (L / cp).
"""

from typing import NamedTuple

import numpy as np
import torch

from models.document_attention import Documents
from parallel.gradients import IGNORE_INDEX


class DocumentMicroBatch(NamedTuple):
    inputs_BS: torch.Tensor  # int64 token ids
    labels_BS: torch.Tensor  # int64 next-token ids, IGNORE_INDEX where the next token starts a document
    positions_S: torch.Tensor  # int64 global positions of the S tokens in the packed row (the causal order)
    documents: Documents  # document ids of the whole rows and the RoPE positions of these S tokens
    global_labels: int  # trained labels of the whole step (all ranks and micro-batches): the loss's denominator


def window_documents(doc_starts: np.ndarray, starts_B: np.ndarray, width: int) -> np.ndarray:
    """int64 [B, width]: the window document index of each token of the windows starting at starts_B."""
    first_B = np.searchsorted(doc_starts, starts_B, side="right")
    tokens_BW = starts_B[:, None] + np.arange(width)
    return np.searchsorted(doc_starts, tokens_BW, side="right") - first_B[:, None]


def rope_positions(doc_BL: np.ndarray) -> np.ndarray:
    """int64 [B, L]: each token's offset from the first token of its document in the window."""
    index_L = np.arange(doc_BL.shape[1])
    new_BL = np.concatenate([np.ones_like(doc_BL[:, :1], bool), doc_BL[:, 1:] != doc_BL[:, :-1]], axis=1)
    first_BL = np.maximum.accumulate(np.where(new_BL, index_L, 0), axis=1)
    return index_L - first_BL


def crossing_labels(doc_starts: np.ndarray, starts_B: np.ndarray, seq_len: int) -> int:
    """Labels of the windows that cross a document boundary: document starts inside (a, a + L]."""
    inside_B = np.searchsorted(doc_starts, starts_B + seq_len, side="right") - \
        np.searchsorted(doc_starts, starts_B, side="right")
    return int(inside_B.sum())


def document_micro_batches(windows_BW: torch.Tensor, doc_BW: np.ndarray, positions_S: torch.Tensor,
                           rows: int, global_labels: int) -> list[DocumentMicroBatch]:
    """This rank's micro-batches (`rows` rows each) of document-masked windows."""
    doc_BL = torch.from_numpy(doc_BW[:, :-1].copy())
    crossing_BL = torch.from_numpy(doc_BW[:, 1:] != doc_BW[:, :-1])
    rope_BL = torch.from_numpy(rope_positions(doc_BW[:, :-1]))
    labels_BL = windows_BW[:, 1:].masked_fill(crossing_BL, IGNORE_INDEX)
    pos_S = positions_S
    return [DocumentMicroBatch(w[:, :-1][:, pos_S], y[:, pos_S], pos_S, Documents(d, r[:, pos_S]), global_labels)
            for w, y, d, r in zip(windows_BW.split(rows), labels_BL.split(rows), doc_BL.split(rows),
                                  rope_BL.split(rows))]
