"""Measure what one optimizer step really does on this rank: matmul FLOPs and bytes on the wire.

Every method in the benchmark is measured the same way, by running one extra (untimed) step under
`count_step()`:
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
        broadcast / gather / scatter: the root sends (or receives) one copy per peer
    All-gather counted this way is what a ring or a direct exchange moves; it does not depend on
    the backend's algorithm.

Private torch APIs (checked on torch 2.13.0): `ProcessGroup.unbox` turns the dispatcher's boxed
process group into the Python one, and `distributed_c10d._resolve_process_group` maps a functional
collective's group name to its group; both only to learn this rank's index and the group size.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

CHECKED_TORCH_VERSION = "2.13.0"


@dataclass
class StepCounts:
    flops: int = 0  # matmul FLOPs (= NS FLOPs for an optimizer step)
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0

    @property
    def bytes_total(self) -> int:
        return self.bytes_sent + self.bytes_received


class _CommCounter(TorchDispatchMode):
    def __init__(self, counts: StepCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns == "c10d":
            self._count_c10d(func.__name__.split(".")[0], args)
        elif ns == "_c10d_functional":
            self._count_functional(func.__name__.split(".")[0], args)
        return func(*args, **kwargs)

    def _add(self, sent: float, received: float):
        self.counts.bytes_sent += int(sent)
        self.counts.bytes_received += int(received)
        self.counts.collectives += 1

    def _count_c10d(self, name: str, args):
        if name in ("barrier", "monitored_barrier") or len(args) < 3:
            return
        group = dist.ProcessGroup.unbox(args[2])
        G, me = group.size(), group.rank()
        if name == "alltoall_base_":
            out, inp, _, out_splits, in_splits = args[:5]
            self._add(_peer_bytes(inp, in_splits, G, me), _peer_bytes(out, out_splits, G, me))
        elif name == "alltoall_":
            outs, inps = args[0], args[1]
            self._add(sum(_nbytes(t) for i, t in enumerate(inps) if i != me),
                      sum(_nbytes(t) for i, t in enumerate(outs) if i != me))
        elif name in ("allgather_", "allgather_coalesced_"):
            inputs = args[1]
            self._add(sum(map(_nbytes, inputs)) * (G - 1), sum(map(_nbytes, inputs)) * (G - 1))
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            inputs = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            self._add(sum(map(_nbytes, inputs)) * (G - 1), sum(map(_nbytes, inputs)) * (G - 1))
        elif name in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            inputs = _flatten(args[1])
            share = sum(map(_nbytes, inputs)) * (G - 1) / G
            self._add(share, share)
        elif name == "allreduce_":
            share = sum(map(_nbytes, args[0])) * 2 * (G - 1) / G
            self._add(share, share)
        elif name == "broadcast_":
            size = sum(map(_nbytes, args[0]))
            root = args[3]
            self._add(size * (G - 1) if me == root else 0, 0 if me == root else size)
        elif name in ("gather_", "scatter_"):
            root = args[3]
            size = sum(map(_nbytes, _flatten(args[1] if name == "gather_" else args[0])))
            peers = size * (G - 1) if me == root else 0
            mine = 0 if me == root else size
            self._add(mine, peers) if name == "gather_" else self._add(peers, mine)

    def _count_functional(self, name: str, args):
        if name in ("wait_tensor", "_wrap_tensor_autograd"):
            return
        group = distributed_c10d._resolve_process_group(args[-1])
        G, me = group.size(), group.rank()
        if name == "all_to_all_single":
            inp, out_splits, in_splits = args[:3]
            row = _nbytes(inp) // max(1, inp.shape[0]) if inp.ndim else inp.element_size()
            self._add(row * (sum(in_splits) - in_splits[me]), row * (sum(out_splits) - out_splits[me]))
        elif name.startswith("all_gather_into_tensor"):
            inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            size = sum(map(_nbytes, inputs)) * (G - 1)
            self._add(size, size)
        elif name.startswith("reduce_scatter_tensor"):
            inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            share = sum(map(_nbytes, inputs)) * (G - 1) / G
            self._add(share, share)
        elif name.startswith("all_reduce"):
            inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            share = sum(map(_nbytes, inputs)) * 2 * (G - 1) / G
            self._add(share, share)
        elif name == "broadcast":
            size, root = _nbytes(args[0]), args[1]
            self._add(size * (G - 1) if me == root else 0, 0 if me == root else size)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flatten(tensors) -> list:
    out = []
    for t in tensors:
        out.extend(_flatten(t) if isinstance(t, (list, tuple)) else [t])
    return out


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
