"""Two halves per MoE block (`parallel.ep_interleave = true`): one half's EP all-to-alls in flight while the
other half computes its attention, its routed experts or the shared experts, in forward and in backward.

`Halves` is the schedule of every MoE block (`TransformerBlock.schedule`, set by parallel/parallelize.py
before activation checkpointing wraps the block and FSDP hooks it): the block's forward runs it. The
micro-batch is cut in two halves A and B: by sequences
when the local batch is even, else by positions (tokens [0, S/2) and [S/2, S) of every sequence); then
half B's attention reads half A's keys through the attention's cache interface (models/kv_cache.LayerCache:
A's latent and rotary key ahead of B's, causal by global position), so B depends on A and never the reverse.
Program order of one block:

    attention(A), router(A), count exchange(A) and its host read, dispatch(A) issued
    attention(B), router(B), count exchange(B) and its host read, dispatch(B) issued     dispatch(A) in flight
    routed experts, one call (FSDP gathers them once):
        wait dispatch(A), experts(A), combine(A) issued                                 dispatch(B) in flight
        wait dispatch(B), experts(B), combine(B) issued                                 combine(A) in flight
    shared experts(A), wait combine(A), shared experts(B), wait combine(B)              combine(B) in flight

The all-to-alls are parallel/ep_overlap.py's asynchronous start/wait autograd pair, with what it carries:
FP8 dispatch, FP8 combine gradient, and `ep_recompute = "keep"` (the tape replays the six exchanges in the
same order). In backward autograd runs ready nodes latest-created first, so each half's gradient all-to-alls
are in flight while the other half's gradients are computed (tests/test_ep_interleave.py records the order).

Costs against the direct dispatch: the same rows (bytes), two host syncs per layer instead of one (one
count exchange per half), and the router, when it is an FSDP unit of its own (bf16 weights, parallel/fsdp.py),
gathered once per half. The sequence-wise balance loss is still computed once over the micro-batch
(`Router.split_dim`). Exact: each token meets the same operations; half B's attention runs with an explicit
causal mask over A's and B's keys instead of the fused causal kernel (the same softmax over the same keys).
Not with dedup, fixed capacity or pieces (parallel/layout.py refuses), selective checkpointing or document
masking (runtime/config.py refuses); the split by positions not under context parallelism (the split by
sequences works with it).
"""

import torch

from models.attention import LocalKV
from models.kv_cache import LayerCache
from models.model import TransformerBlock
from models.moe import expert_counts
from parallel.ep_overlap import start_rows, wait_rows
from parallel.expert_parallel import local_experts, local_weight


class Half:
    """One half's routing and its exchanges in flight. A plain class, not a dataclass: FSDP's hooks rebuild
    the dataclasses among a unit's inputs, and the experts' call writes `combine_box` into this object."""

    def __init__(self, order_N: torch.Tensor, weights_TK: torch.Tensor, counts, dispatch: tuple):
        self.order_N = order_N  # its token copies sorted by expert
        self.weights_TK = weights_TK
        self.counts = counts  # parallel/expert_parallel.ExchangedCounts (split sizes read)
        self.dispatch = dispatch  # (link, box) of parallel/ep_overlap.start_rows
        self.combine_box = None


class Halves:
    """The two-halves schedule of one MoE block (module docstring); `block.forward` calls `forward`."""

    def forward(self, block: TransformerBlock, x_BSD: torch.Tensor, positions_S: torch.Tensor,
                documents=None) -> torch.Tensor:
        moe = block.feed_forward
        d = moe.dispatcher
        dim = 0 if x_BSD.shape[0] % 2 == 0 else 1
        if documents is not None:  # runtime/config.py refuses the combination before launch
            raise ValueError("parallel.ep_interleave with data.document_mask: not combined yet; choose one")
        if dim == 1 and not isinstance(block.attention.kv_source, LocalKV):
            raise ValueError(f"parallel.ep_interleave with context parallelism: {x_BSD.shape[0]} sequence(s) per rank "
                             f"and micro-batch are cut by positions, which needs cp=1; use an even number per micro-batch")
        keys = {"cache": LayerCache()} if dim == 1 else {}
        halves, hidden = [], []
        moe.router.split_dim = dim
        try:
            for i, (x, p) in enumerate(_split(x_BSD, positions_S, dim)):
                d.mark("attention_start", i)
                a = block.attention_norm(x)
                h = x + block.attention(a, p, **keys)
                f = block.ffn_norm(h)
                if d.timeline is not None and torch.is_grad_enabled():  # the backward's order, for tests
                    h.register_hook(lambda grad, i=i: d.mark("attention_grad_start", i))
                    a.register_hook(lambda grad, i=i: d.mark("attention_grad_end", i))
                halves.append(_dispatch(moe, f, i))
                hidden.append((h, f))
                d.mark("attention_end", i)
        finally:
            moe.router.split_dim = None
        links = moe.experts([half.dispatch[0] for half in halves], halves, _HalvesRun(d))
        out = []
        for i, ((h, f), half, link) in enumerate(zip(hidden, halves, links)):
            B, S, D = f.shape
            shared = None if moe.shared_experts is None else moe.shared_experts(f.reshape(B * S, D))
            y_TD = moe.combine(wait_rows(link, half.combine_box), half.order_N, half.weights_TK)
            out.append(h + (y_TD if shared is None else y_TD + shared).view(B, S, D))
        return torch.cat(out, dim)


def _split(x_BSD, positions_S, dim: int):
    """[(x, positions)] of halves A and B: by sequences (dim 0) or by positions (dim 1)."""
    if dim == 0:
        B = x_BSD.shape[0] // 2
        return [(x_BSD[:B], positions_S), (x_BSD[B:], positions_S)]
    S = x_BSD.shape[1] // 2
    return [(x_BSD[:, :S], positions_S[:S]), (x_BSD[:, S:], positions_S[S:])]


def _dispatch(moe, f_BSD: torch.Tensor, i: int) -> Half:
    """Route half i, exchange its counts (the host reads the split sizes) and issue its dispatch."""
    B, S, D = f_BSD.shape
    d = moe.dispatcher
    weights_TK, experts_TK = moe.router(f_BSD)
    K = experts_TK.shape[1]
    order_N = torch.argsort(experts_TK.flatten(), stable=True)  # as LocalDispatcher.route
    counts = d.exchange(expert_counts(experts_TK, moe.router.n_experts))
    send, recv = counts.split_sizes()  # host sync
    dispatch = start_rows(d, "dispatch", i, f_BSD.reshape(B * S, D)[order_N // K], recv, send)
    return Half(order_N, weights_TK, counts, dispatch)


class _HalvesRun:
    """The experts' call with both halves (the experts module calls `run` with the dispatch links and the
    halves): for each half, wait for its dispatch, run its experts and issue its combine; returns the
    combines' links."""

    def __init__(self, d):
        self.d = d

    def run(self, experts, links: list, halves: list) -> list:
        w13, w2 = local_weight(experts.w13), local_weight(experts.w2)
        combines = []
        for i, (link, half) in enumerate(zip(links, halves)):
            x_RD = wait_rows(link, half.dispatch[1])
            self.d.mark("compute_start", i)
            y_RD = local_experts(x_RD, half.counts.recv_counts_PL, w13, w2)
            self.d.mark("compute_end", i)
            send, recv = half.counts.split_sizes()
            link, half.combine_box = start_rows(self.d, "combine", i, y_RD, send, recv)
            combines.append(link)
        return combines
