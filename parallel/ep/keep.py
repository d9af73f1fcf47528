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
One `Tape` per checkpointed call: the region's runner (parallel/activation_checkpoint.py `Recompute`)
makes it in the checkpoint's `context_fn` and hands it to the region's dispatchers (`contexts`), each of
which holds it in its own `tape` (parallel/ep/dispatcher.py) while the region's forward or recompute runs
and passes it to every exchange it issues (`kept(tape, ...)`): a reader follows the tape from the runner
to the exchange through arguments. It lives as long as that call's autograd graph, and is freed with it
after the region's backward. Numerics are unchanged: the replayed buffers are the bytes the rerun would
have received. Cost: the kept buffers of every MoE layer until its backward (`kept_bytes_per_layer`,
counted by launch/estimate_memory.py). A recompute may run more than once (a backward split in two):
each replay reads the tape from its start. One tape slot per dispatcher suffices, whatever thread
autograd recomputes on: a model's forward and its backward never run at the same time (the caller
waits in `backward`), and each dispatcher belongs to one region.

Outside a checkpointed region with "keep" (the default path, an evaluation forward, "resend") a
dispatcher's tape is None and every exchange simply runs.
"""

import contextlib

import torch


class Tape:
    """The results of one checkpointed call's EP exchanges, in order: (kind, value) each."""

    def __init__(self):
        self.entries: list[tuple[str, object]] = []
        self.cursor: int | None = None  # None: recording; else the next entry a replay reads


@contextlib.contextmanager
def _handed(dispatchers: list, tape: Tape, cursor: int | None):
    """`tape` in every dispatcher's `tape` (recording when `cursor` is None, else replaying from it)."""
    previous = [d.tape for d in dispatchers]
    tape.cursor = cursor
    for d in dispatchers:
        d.tape = tape
    try:
        yield
    finally:
        for d, before in zip(dispatchers, previous):
            d.tape = before


def contexts(dispatchers: list):
    """(forward context, a function making a recompute context) of one checkpointed call: a new Tape
    that `dispatchers` record in the forward and replay from the start in each recompute (a recompute
    may stop early, torch's checkpoint early stop: the rest is simply not read); null contexts when
    no dispatcher keeps."""
    if not dispatchers:
        return contextlib.nullcontext(), contextlib.nullcontext
    tape = Tape()
    return _handed(dispatchers, tape, None), lambda: _handed(dispatchers, tape, 0)


def kept(tape: Tape | None, kind: str, exchange):
    """`exchange()` (an EP all-to-all and whatever it reads back), kept when `tape` records, read back
    when it replays; simply run without a tape. Tensors are kept detached (no autograd graph)."""
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


def kept_bytes_per_layer(tokens: int, config, ep_config, act_bytes: int, nodes_per_token: float) -> float:
    """Bytes one rank keeps per MoE layer and micro-batch under "keep" (the receive buffers of the layer's
    forward all-to-alls, self rows included; integer counts left out), on average over ranks, for
    `tokens` tokens per rank (T) and top-K routing, with the EP knobs `ep_config` (parallel/ep/config.py):
    every copy is received once and returned once, so the direct dispatch keeps T K dispatched rows + T K
    combined rows; dedup also keeps the node hop's pairs (T x nodes_per_token: rows, K weights, K ids)
    both ways. A rank with more than the mean of the copies (skewed routing) keeps proportionally more."""
    D, K = config.dim, config.n_activated_experts
    dispatch = D + 4 if ep_config.dispatch_fp8 else D * act_bytes
    copies = tokens * K * (dispatch + D * act_bytes)
    if not ep_config.ep_dedup:
        return float(copies)
    pairs = tokens * nodes_per_token * (dispatch + K * act_bytes + K * 8 + D * act_bytes)
    return float(copies + pairs)
