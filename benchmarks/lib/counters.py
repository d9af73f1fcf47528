"""Measure what one optimizer step really does on this rank: matmul FLOPs, memory traffic and bytes on the wire.

Every method in the benchmark is measured the same way, by running one extra (untimed) step under
`count_step()`:
  - Ops: every aten op the step dispatches (a proxy for kernel launches and host overhead: a
    `_foreach_` op over many tensors counts once, like the one multi-tensor kernel it is on GPU).
  - Peak extra memory: the most bytes of storages allocated by the step's ops alive at the same
    time (`_LiveMemory`): what the step needs on top of parameters, gradients and state.
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
    functional collectives both go through the dispatcher) and adds up the logical bytes that
    leave this rank and enter it, excluding a rank's copy to itself:
        all-to-all     sent = input rows for peers, received = output rows from peers
        all-gather     sent = received = input bytes x (group size - 1)
        reduce-scatter sent = received = input bytes x (G - 1) / G
        all-reduce     sent = received = bytes x 2 (G - 1) / G  (ring; no method here uses it)
    Any other collective is listed in `uncounted` (the benchmark prints it) rather than guessed.
    All-gather counted this way is what a ring or a direct exchange moves; it does not depend on
    the backend's algorithm.

Private torch APIs (checked on torch 2.13.0): `torch.utils._python_dispatch.TorchDispatchMode` (the
documented way to intercept dispatcher calls; it has no public alias), `ProcessGroup.unbox` (the
dispatcher's boxed process group -> the Python one) and `distributed_c10d._resolve_process_group`
(a functional collective's group name -> its group); the last two only to learn this rank's index
and the group size.
"""

import contextlib
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from optim.newton_schulz import orthogonalize

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
        self.memory = _LiveMemory()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.ops += 1
        self._collective(func, args)
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and not func.is_view and func.overloadpacket not in _MATMULS:
            moved = _memory_bytes(func, args, kwargs or {}, out)
            if _in_newton_schulz():
                self.counts.ns_memory_bytes += moved
            else:
                self.counts.memory_bytes += moved
        self.memory.track(args, out)
        self.counts.peak_extra_bytes = self.memory.peak
        return out

    def _collective(self, func, args):
        name = func.__name__.split(".")[0]
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]  # the process group, if any
        if func.namespace == "c10d" and boxed and not name.startswith(("barrier", "monitored_barrier")):
            group = dist.ProcessGroup.unbox(boxed[0])
            self._add(name, _c10d_bytes(name, args, group.size(), group.rank()))
        elif func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            group = distributed_c10d._resolve_process_group(args[-1])
            self._add(name, _functional_bytes(name, args, group.size(), group.rank()))

    def _add(self, name: str, sent_received):
        if sent_received is None:
            self.counts.uncounted.append(name)
            return
        self.counts.bytes_sent += int(sent_received[0])
        self.counts.bytes_received += int(sent_received[1])
        self.counts.collectives += 1


_MATMULS = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm}
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
    written = sum(_nbytes(t) for t in _plain_tensors([named[a.name] for a in mutated] or out))
    outs = {a.name for a in mutated if a.kwarg_only}  # out=: written, not read (in-place self is both)
    if packet in _WRITE_ONLY:
        return written + (_nbytes(args[1]) if packet is torch.ops.aten.copy_ else 0)
    if packet is torch.ops.aten.index_select:
        return 2 * written + _nbytes(args[2])
    if packet in _INDEXED:
        source = args[_INDEXED[packet]]
        reads = 2 if packet is torch.ops.aten.index_add_ else 1
        return (reads + 1) * _nbytes(source) + sum(_nbytes(t) for t in _plain_tensors(args[_INDEXED[packet] - 1]))
    return sum(_nbytes(t) for t in _plain_tensors([v for k, v in named.items() if k not in outs])) + written


def _in_newton_schulz() -> bool:
    """Whether the op is dispatched from inside `optim.newton_schulz.orthogonalize` (a stack walk)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _ORTHOGONALIZE_CODE:
            return True
        frame = frame.f_back
    return False


class _LiveMemory:
    """Bytes of the storages that ops allocate while counting, alive at once (current and peak).

    A storage is new when an op output's storage is none of its inputs' (in-place ops and views
    return an input's); every plain tensor on a tracked storage (the output, later views of it)
    holds a reference, and the storage counts until the last of them is garbage collected. Tensor
    subclasses (DTensor) are skipped: their local tensors pass through the same ops.
    """

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage data_ptr -> [tensors alive, bytes]
        self.current = self.peak = 0

    def track(self, args, out) -> None:
        inputs = {_storage_ptr(t) for t in _plain_tensors(args)}
        for t in _plain_tensors(out):
            ptr = _storage_ptr(t)
            if ptr in self.live:
                self.live[ptr][0] += 1
            elif ptr in inputs or ptr == 0:
                continue
            else:
                self.live[ptr] = [1, t.untyped_storage().nbytes()]
                self.current += self.live[ptr][1]
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]


def _plain_tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta]


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _c10d_bytes(name: str, args, G: int, me: int):
    """(sent, received) of a `torch.distributed` collective; args (outputs, inputs, group, ...)."""
    if name == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes)
        return _peer_bytes(args[1], args[4], G, me), _peer_bytes(args[0], args[3], G, me)
    if name in ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"):
        return (_total(args[1]) * (G - 1),) * 2
    if name in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        return (_total(args[1]) * (G - 1) // G,) * 2
    if name == "allreduce_":  # ring all-reduce
        return (_total(args[0]) * 2 * (G - 1) // G,) * 2
    return None


def _functional_bytes(name: str, args, G: int, me: int):
    """(sent, received) of a functional collective (DTensor's); args (input(s), ..., group_name)."""
    if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
        row = _nbytes(args[0]) // max(1, args[0].shape[0])
        return row * (sum(args[2]) - args[2][me]), row * (sum(args[1]) - args[1][me])
    if name.startswith("all_gather_into_tensor"):
        return (_total(args[0]) * (G - 1),) * 2
    if name.startswith("reduce_scatter_tensor"):
        return (_total(args[0]) * (G - 1) // G,) * 2
    if name.startswith("all_reduce"):
        return (_total(args[0]) * 2 * (G - 1) // G,) * 2
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _total(tensors) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return _nbytes(tensors)
    return sum(_total(t) for t in tensors)


def _peer_bytes(t: torch.Tensor, splits, G: int, me: int) -> int:
    """Bytes of `t` (split on dim 0 into G chunks, equal when `splits` is empty) not for/from me."""
    rows = t.shape[0] if t.ndim else 1
    row_bytes = _nbytes(t) // max(1, rows)
    splits = list(splits) or [rows // G] * G
    return row_bytes * (sum(splits) - splits[me])


@contextlib.contextmanager
def count_step():
    """`with count_step() as counts: opt.step()` -> counts (StepCounts) of this rank."""
    counts = StepCounts()
    flop_mode = FlopCounterMode(display=False)
    with flop_mode, _CommCounter(counts):
        yield counts
    counts.flops = flop_mode.get_total_flops()
