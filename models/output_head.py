"""The untied output head, and losses over its logits computed in token chunks.

`head(x_ND)` is a Linear: logits [N, V]. `head(x_TD, parts, chunk)` returns a vector of loss sums
instead, and never holds more than `chunk` rows of logits: each `LossPart` names the rows of x whose
logits it reads (`index_n`, any order, repeats allowed) and a function of those logits, called one
chunk of rows at a time, that returns fp32 sums [K]. Their sum over chunks and parts is returned; the
backward recomputes each chunk's logits (one more head forward) instead of keeping them.

Why: at 16k local tokens and a 163,840-token vocabulary, the logits and their gradient alone are 10 GB
in bf16 and the fp32 losses over them several times that (planning/memory/posttrain.py). Chunked, the
loss path holds `chunk x V`, and only the rows a loss reads are computed (not the prompt and tool tokens).

The weight's gradient is accumulated in fp32 over the chunks (each chunk's product in the weight's dtype,
as one unchunked matmul would round once), then cast back. One forward call of the module: FSDP2
unshards the weight once and reduce-scatters its gradient once.

Letters: T rows of x, N rows a part reads, D model dim, V vocabulary, K sums.
"""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class LossPart(NamedTuple):
    index_n: torch.Tensor  # int64 rows of x whose logits the part reads
    fn: Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits of rows lo:hi [hi-lo, V], lo, hi) -> fp32 [K]


def spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) chunks of n rows; one empty span when n = 0 (so every part still returns its [K] zeros)."""
    return [(lo, min(lo + chunk, n)) for lo in range(0, max(n, 1), chunk)]


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weight_VD, index_n, fn, chunk):
        total = sum(fn(F.linear(x_TD[index_n[lo:hi]], weight_VD), lo, hi) for lo, hi in spans(len(index_n), chunk))
        ctx.save_for_backward(x_TD, weight_VD, index_n)
        ctx.fn, ctx.chunk = fn, chunk
        return total

    @staticmethod
    def backward(ctx, grad_K):
        x_TD, weight_VD, index_n = ctx.saved_tensors
        weight_VD = weight_VD.detach()
        grad_x = torch.zeros_like(x_TD)
        grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        for lo, hi in spans(len(index_n), ctx.chunk):
            rows = index_n[lo:hi]
            x_cD = x_TD[rows].detach()
            with torch.enable_grad():
                logits_cV = F.linear(x_cD, weight_VD).requires_grad_()
                (grad_cV,) = torch.autograd.grad(ctx.fn(logits_cV, lo, hi), logits_cV, grad_K)
            grad_x.index_add_(0, rows, grad_cV @ weight_VD)
            grad_w += grad_cV.t() @ x_cD
        return grad_x, grad_w.to(weight_VD.dtype), None, None, None


class OutputHead(nn.Linear):
    """The untied output head (no bias); called with loss parts, their sums instead of logits."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, parts: list[LossPart] | None = None, chunk: int = 0) -> torch.Tensor:
        """x [..., D] -> logits [..., V]; with `parts` (x: [T, D], chunk >= 1): the parts' sums [K], added."""
        if parts is None:
            return super().forward(x)
        return sum(_ChunkedLoss.apply(x, self.weight, part.index_n, part.fn, chunk) for part in parts)
