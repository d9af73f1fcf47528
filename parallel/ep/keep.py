"""Recompute without resending (`parallel.ep_recompute = "keep"`): a checkpointed MoE layer's forward keeps
what its all-to-alls received, and the recompute in backward reads it back instead of sending again.

Under `training.activation_checkpoint` ("full": the whole block; "selective": the routed experts) the
backward reruns the region's forward, and with it, by default ("resend"), every EP all-to-all of the
region: the count exchange (and its host sync), the dispatch and the combine, and dedup's node hop.
The rerun sends exactly what the first forward sent (same inputs, same routing), so with "keep":
  - the first forward of a checkpointed region records, in order, the result of each EP exchange
    (`kept`): the receive buffer of every all-to-all of rows (what arrived, as it arrived: FP8 rows
    packed, before decoding), the exchanged counts and their host split sizes;
  - the recompute replays them in the same order: no all-to-all, no host sync;
  - the backward's all-to-alls (the gradients' way back) still run: non-reentrant checkpointing keeps
    the first forward's autograd nodes, and only their saved tensors come from the recompute.
One `Tape` per checkpointed call (parallel/activation_checkpoint.py makes it in the checkpoint's
`context_fn`): it lives as long as that call's autograd graph, and is freed with it after the
region's backward. Numerics are unchanged: the replayed buffers are the bytes the rerun would have
received. Cost: the kept buffers of every MoE layer until its backward (`kept_bytes_per_layer`,
counted by launch/estimate_memory.py).

Every EP exchange goes through `kept`; outside a checkpointed region with "keep" (the default path,
an evaluation forward, "resend") it simply runs.
"""

import contextlib
import threading

import torch

_ACTIVE = threading.local()  # .tape: the Tape of the checkpointed region running now on this thread (recording or
# replaying), else None; per thread, as autograd may run a backward (and its recompute) on a thread of its own


class Tape:
    """The results of one checkpointed call's EP exchanges, in order: (kind, value) each."""

    def __init__(self):
        self.entries: list[tuple[str, object]] = []
        self.cursor: int | None = None  # None: recording; else the next entry a replay reads


@contextlib.contextmanager
def recording(tape: Tape):
    """Around a checkpointed region's first forward: its EP exchanges are appended to `tape`."""
    previous, _ACTIVE.tape = getattr(_ACTIVE, "tape", None), tape
    tape.cursor = None
    try:
        yield
    finally:
        _ACTIVE.tape = previous


@contextlib.contextmanager
def replaying(tape: Tape):
    """Around the region's recompute: its EP exchanges read `tape` from the start (a recompute may
    stop early, torch's checkpoint early stop: the rest is simply not read)."""
    previous, _ACTIVE.tape = getattr(_ACTIVE, "tape", None), tape
    tape.cursor = 0
    try:
        yield
    finally:
        _ACTIVE.tape = previous


def contexts(keep: bool):
    """(forward context, recompute context) of one checkpointed call: a new Tape recorded and
    replayed when `keep`, else two null contexts."""
    if not keep:
        return contextlib.nullcontext(), contextlib.nullcontext()
    tape = Tape()
    return recording(tape), replaying(tape)


def kept(kind: str, exchange):
    """`exchange()` (an EP all-to-all and whatever it reads back), kept when a region records, read
    back when it replays; simply run otherwise. Tensors are kept detached (no autograd graph)."""
    tape = getattr(_ACTIVE, "tape", None)
    if tape is None:
        return exchange()
    if tape.cursor is None:
        value = exchange()
        tape.entries.append((kind, _detached(value)))
        return value
    if tape.cursor >= len(tape.entries) or tape.entries[tape.cursor][0] != kind:
        got = tape.entries[tape.cursor][0] if tape.cursor < len(tape.entries) else "nothing"
        raise RuntimeError(f"parallel.ep_recompute='keep': the recompute's exchange {tape.cursor} is {kind!r}, "
                           f"the forward kept {got!r} (the recompute must repeat the forward's EP exchanges)")
    value = tape.entries[tape.cursor][1]
    tape.cursor += 1
    return _detached(value)


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def kept_bytes_per_layer(tokens: int, config, layout, act_bytes: int, nodes_per_token: float) -> float:
    """Bytes one rank keeps per MoE layer and micro-batch under "keep" (the receive buffers of the layer's
    forward all-to-alls, self rows included; integer counts left out), on average over ranks, for
    `tokens` tokens per rank (T) and top-K routing: every copy is received once and returned once, so
    the direct dispatch keeps T K dispatched rows + T K combined rows; dedup also keeps the node hop's
    pairs (T x nodes_per_token: rows, K weights, K ids) both ways. A rank with more than the mean of
    the copies (skewed routing) keeps proportionally more."""
    D, K = config.dim, config.n_activated_experts
    dispatch = D + 4 if layout.ep_dispatch_dtype == "float8_e4m3" else D * act_bytes
    copies = tokens * K * (dispatch + D * act_bytes)
    if not layout.ep_dedup:
        return float(copies)
    pairs = tokens * nodes_per_token * (dispatch + K * act_bytes + K * 8 + D * act_bytes)
    return float(copies + pairs)
