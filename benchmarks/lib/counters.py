"""Measure what one optimizer step really does on this rank: matmul FLOPs, memory traffic and bytes on the wire.

Every method in the benchmark is measured the same way, by running one extra (untimed) step under
`count_step()`:
  - Ops: every aten op the step dispatches (a proxy for kernel launches and host overhead: a
    `_foreach_` op over many tensors counts once, like the one multi-tensor kernel it is on GPU).
  - Peak extra memory: the most bytes of storages allocated by the step's ops alive at the same
    time (planning/recording.py `LiveMemory`): what the step needs on top of parameters, gradients and state.
    Both see what reaches the dispatcher under the mode: for a DTensor op that is the DTensor op
    once, not the local ops DTensor's own dispatch runs for it (the mode is off inside a handler),
    so they are exact for steps on plain (local) tensors and undercounts for DTensor-level code.
  - Memory bytes: what each memory-bound op reads and writes (`_memory_bytes`: elementwise ops,
    casts, copies, index ops by the rows they touch; not matmuls, collectives or views), kept
    apart for the ops dispatched inside `optim.newton_schulz.orthogonalize` (found by a walk of
    the Python stack): on a GPU, the HBM traffic of the step's kernels outside Newton-Schulz.
  - FLOPs: torch's public `FlopCounterMode` counts every mm/bmm/addmm/baddbmm. An optimizer step has
    no other matmuls, so this is exactly the Newton-Schulz work (4 s^2 l + 2 s^3 per iteration
    and block), whatever the method's code looks like.
  - Bytes: a dispatch mode sees every c10d collective (`torch.distributed.*` and DTensor's
    functional collectives both go through the dispatcher), decoded by planning/recording.py, and adds
    up the logical bytes that leave this rank and enter it, excluding a rank's copy to itself:
        all-to-all     sent = input rows for peers, received = output rows from peers
        all-gather     sent = received = input bytes x (group size - 1)
        reduce-scatter sent = received = input bytes x (G - 1) / G
        all-reduce     sent = received = bytes x 2 (G - 1) / G  (ring; no method here uses it)
    Any other collective is listed in `uncounted` (the benchmark prints it) rather than guessed.
    All-gather counted this way is what a ring or a direct exchange moves; it does not depend on
    the backend's algorithm.

Private torch API (checked on torch 2.13.0): `torch.utils._python_dispatch.TorchDispatchMode` (the
documented way to intercept dispatcher calls; it has no public alias); the process groups are decoded by
planning/recording.py.
"""

import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from optim.newton_schulz import orthogonalize
from planning.recording import MATMULS, LiveMemory, decode, plain_tensors

_ORTHOGONALIZE_CODE = orthogonalize.__code__

CHECKED_TORCH_VERSION = "2.13.0"


@dataclass
class StepCounts:
    flops: int = 0  # matmul FLOPs (= NS FLOPs for an optimizer step)
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    ops: int = 0  # aten ops dispatched (a proxy for kernel launches; a _foreach_ op counts once)
    peak_extra_bytes: int = 0  # most bytes of tensors allocated during the step alive at once
    memory_bytes: int = 0  # bytes read + written by the memory-bound ops outside Newton-Schulz
    ns_memory_bytes: int = 0  # the same inside `orthogonalize` (its elementwise ops; matmuls are FLOPs)
    uncounted: list = field(default_factory=list)  # collectives whose bytes this module does not model

    @property
    def bytes_total(self) -> int:
        return self.bytes_sent + self.bytes_received


class _CommCounter(TorchDispatchMode):
    def __init__(self, counts: StepCounts):
        super().__init__()
        self.counts = counts
        self.memory = LiveMemory()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.ops += 1
        self._collective(func, args)
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and not func.is_view and func.overloadpacket not in MATMULS:
            moved = _memory_bytes(func, args, kwargs or {}, out)
            if _in_newton_schulz():
                self.counts.ns_memory_bytes += moved
            else:
                self.counts.memory_bytes += moved
        self.memory.track(args, out)
        self.counts.peak_extra_bytes = self.memory.peak
        return out

    def _collective(self, func, args):
        call = decode(func, args)
        if call is None:
            return
        if call.to_peer is None:
            self.counts.uncounted.append(call.op)
            return
        self.counts.bytes_sent += int(call.sent)
        self.counts.bytes_received += int(call.received)
        self.counts.collectives += 1


_NO_TRAFFIC = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
               torch.ops.aten._unsafe_view}
_WRITE_ONLY = {torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.zero_, torch.ops.aten.fill_,
               torch.ops.aten.full, torch.ops.aten.copy_}  # copy_ reads its source (below), not self
_INDEXED = {torch.ops.aten.index_copy_: 3, torch.ops.aten.index_add_: 3, torch.ops.aten.index_put_: 2}


def _memory_bytes(func, args, kwargs, out) -> int:
    """Bytes an aten op reads + writes in device memory: what a memory-bound kernel costs.

    Default: every tensor argument is read whole (but an out= argument), and the arguments the schema
    marks as written (in-place self, out=) or else the outputs are written whole (elementwise ops, casts, `cat`).
    Exceptions: allocation moves nothing; `copy_`, fills and `zeros` do not read the destination;
    `index_select` reads only the rows it selects (= what it writes) and the index; `index_copy_`,
    `index_add_` and `index_put_` read the source and the index and write (`index_add_`: read and
    write) only the destination rows, not the whole destination.
    """
    packet = func.overloadpacket
    if packet in _NO_TRAFFIC:
        return 0
    schema = func._schema.arguments
    named = dict(zip((a.name for a in schema), args)) | kwargs
    mutated = [a for a in schema if a.alias_info is not None and a.alias_info.is_write and a.name in named]
    written = sum(_nbytes(t) for t in plain_tensors([named[a.name] for a in mutated] or out))
    outs = {a.name for a in mutated if a.kwarg_only}  # out=: written, not read (in-place self is both)
    if packet in _WRITE_ONLY:
        return written + (_nbytes(args[1]) if packet is torch.ops.aten.copy_ else 0)
    if packet is torch.ops.aten.index_select:
        return 2 * written + _nbytes(args[2])
    if packet in _INDEXED:
        source = args[_INDEXED[packet]]
        reads = 2 if packet is torch.ops.aten.index_add_ else 1
        return (reads + 1) * _nbytes(source) + sum(_nbytes(t) for t in plain_tensors(args[_INDEXED[packet] - 1]))
    return sum(_nbytes(t) for t in plain_tensors([v for k, v in named.items() if k not in outs])) + written


def _in_newton_schulz() -> bool:
    """Whether the op is dispatched from inside `optim.newton_schulz.orthogonalize` (a stack walk)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _ORTHOGONALIZE_CODE:
            return True
        frame = frame.f_back
    return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def count_step():
    """`with count_step() as counts: opt.step()` -> counts (StepCounts) of this rank."""
    counts = StepCounts()
    flop_mode = FlopCounterMode(display=False)
    with flop_mode, _CommCounter(counts):
        yield counts
    counts.flops = flop_mode.get_total_flops()
