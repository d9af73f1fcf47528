"""Recompute ahead (`parallel.ep_recompute_ahead`): under full activation checkpointing, the block below
starts its recompute while this block's dispatch gradient crosses.

Why: a checkpointed block reruns its forward when autograd first reaches it (torch.utils.checkpoint,
non-reentrant), i.e. after the block above has finished its backward. Under EP the block above ends
waiting for its dispatch gradients' all-to-alls, and the rerun that follows is pure compute with no
all-to-all in flight: the device idles in the first gap, the network in the second. Rerunning the block
below inside that wait fills both (K2 at 256 GPUs: benchmarks/lib/ep_timeline.py, docs/expert_parallel.md).

How: each checkpointed block call is a `Call`, linked to the call that produced its input (the block
below, same micro-batch): this thread's last finished call, when its output shares its storage with the
block's input (the block receives that output, or FSDP2's view of it). Inside the checkpointed
function an `_Anchor` node saves an empty tensor; the checkpoint packs it like any saved tensor, so
reading it back (`node.saved_tensors`) from inside the backward runs the region's recompute for the
current backward, exactly as autograd's first read would later (that later read then finds it done).
`parallel/ep_overlap.py` keeps the block's `below` call in its dispatch boxes and calls `start()` at each
dispatch-gradient wait (the first one starts it; the others find it started). Before the read, `start`
runs the block's FSDP2 pre-backward (unshard, and the backward prefetch of the unit before it), which
its output's hook would run when the gradient arrives (a private FSDP2 method, parallel/_torch_private.py,
probed at parallelize time; the hook's later call finds the unit PRE_BACKWARD and does nothing).

Only the time of the recompute moves: the same ops on the same inputs, so losses and gradients equal
the default order bitwise (tests/test_ep_pairing.py). Cost: the block below's recomputed activations
are alive while this block finishes its backward (one more block's, launch/estimate_memory.py).
"""

import contextlib
import threading
import weakref

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from parallel import _torch_private

_CURRENT = threading.local()  # .call: the Call whose first forward runs now on this thread (F runs in a thread);
# .last: (weak reference to its output, Call) of the last call this thread finished


class Call:
    """One checkpointed call of `block` for one micro-batch; `below`: the call that produced its input."""

    def __init__(self, block: nn.Module, below: "Call | None"):
        self.block, self.below = block, below
        self.node = None  # the _Anchor's autograd node, set by the first forward
        self.started = False

    def start(self) -> None:
        """Run this call's recompute now (inside the backward that will need it), once."""
        if self.started or self.node is None:
            return
        self.started = True
        if isinstance(self.block, FSDPModule):
            _torch_private.run_pre_backward(self.block)  # what the gradient's arrival would run first
        self.node.saved_tensors  # noqa: B018  the checkpoint's unpack hook reruns the region now


class _Anchor(torch.autograd.Function):
    """Identity that saves an empty tensor: the handle `Call.start` reads to trigger the recompute."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.new_empty(0))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def anchored(block: nn.Module, run):
    """`run(x, ...)` (the checkpointed function) as a `Call` of `block` for x's micro-batch: returns the
    function for torch.utils.checkpoint and a `finish(out)` that links the output to the call."""
    def prepare(x: torch.Tensor):
        call = Call(block, _producer(x))

        def checkpointed(x, *args, **kwargs):
            y = _Anchor.apply(x)
            first = call.node is None and y.grad_fn is not None
            if first:
                call.node = y.grad_fn
            with _current(call if first else None):
                return run(y, *args, **kwargs)

        def finish(out):
            if isinstance(out, torch.Tensor) and call.node is not None:
                _CURRENT.last = (weakref.ref(out), call)
            return out

        return checkpointed, finish
    return prepare


def _producer(x: torch.Tensor) -> Call | None:
    """The call whose output `x` is (or a view of it: FSDP2 passes its post-backward hook's identity view)."""
    out_ref, call = getattr(_CURRENT, "last", (None, None))
    out = out_ref() if out_ref is not None else None
    if out is None or out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return None
    return call


@contextlib.contextmanager
def _current(call):
    previous, _CURRENT.call = getattr(_CURRENT, "call", None), call
    try:
        yield
    finally:
        _CURRENT.call = previous


def below() -> Call | None:
    """In a block's first forward under recompute ahead: the call of the block below, else None."""
    call = getattr(_CURRENT, "call", None)
    return call.below if call is not None else None
