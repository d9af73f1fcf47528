"""What a real step dispatches, counted the planner's way: every collective this process issues and the storages
its ops keep alive. One decoder of process groups for every counter that compares a real step with a plan:
benchmarks/lib/counters.py (bytes sent and received), launch/dry_run_bytes.py (bytes on the wire per mesh, against
the projection) and the tests that count EP and FSDP bytes on real ranks.

    with record_collectives() as calls:
        loss = model(inputs); loss.backward()
    intra, inter = split_by_node(calls, ranks_per_node=4)

`decode` turns one dispatched c10d op (`torch.distributed.*`) or functional collective (DTensor's) into a
`Collective`: its kind (all_gather | reduce_scatter | all_reduce | all_to_all, or the op's own name), its group
(global ranks, this rank's index), the bytes this rank passes in, and the bytes it sends to and receives from each
member in planning/wire.py's convention (what leaves this rank for its peers, itself excluded, whatever the
backend's algorithm: all-gather its shard to each peer, reduce-scatter the peer's chunk, all-reduce 2 B / g to
each, all-to-all each peer's rows). A kind planning/wire.py does not model keeps no per-peer bytes (`uncounted`).
The counts come from the tensors and split sizes handed to the collective, not from the code that planned them.

`LiveMemory` follows the storages ops allocate while counting (current and peak bytes alive).

Private torch APIs (checked on torch 2.13.0): `torch.utils._python_dispatch.TorchDispatchMode` (the documented
way to intercept dispatcher calls; it has no public alias), `ProcessGroup.unbox` (the dispatcher's boxed process
group -> the Python one) and `distributed_c10d._resolve_process_group` (a functional collective's group name ->
its group).
"""

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from planning.wire import KINDS, to_each_peer

# op name (its leading and trailing underscores stripped) -> kind
KIND = {"allgather": "all_gather", "allgather_base": "all_gather", "allgather_coalesced": "all_gather",
        "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
        "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter": "reduce_scatter",
        "reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter", "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
        "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "alltoall_base": "all_to_all",
        "all_to_all_single": "all_to_all"}
NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier", "wrap_tensor_autograd")
MATMULS = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm}


@dataclass
class Collective:
    """One collective this rank issued (module docstring)."""
    kind: str
    op: str  # the dispatched op's name, e.g. "_reduce_scatter_base_"
    group: object  # the ProcessGroup
    ranks: list  # global ranks in group order
    me: int  # this rank's index in `ranks`
    passed: int  # bytes this rank passes in (its shard for an all-gather, its whole input otherwise)
    to_peer: list | None  # bytes sent to each group index (0 to itself); None for a kind wire.py does not model
    from_peer: list | None  # bytes received from each group index

    @property
    def sent(self) -> float:
        return sum(self.to_peer) if self.to_peer is not None else 0.0

    @property
    def received(self) -> float:
        return sum(self.from_peer) if self.from_peer is not None else 0.0

    def links(self, ranks_per_node: int) -> tuple[float, float]:
        """(to peers on this rank's node, to peers elsewhere): nodes of `ranks_per_node` consecutive global ranks."""
        node = self.ranks[self.me] // ranks_per_node
        intra = inter = 0.0
        for rank, n in zip(self.ranks, self.to_peer or ()):
            if rank // ranks_per_node == node:
                intra += n
            else:
                inter += n
        return intra, inter


def decode(func, args) -> Collective | None:
    """The collective `func(*args)` is (a c10d op or a functional collective), None for any other op."""
    op = func.__name__.split(".")[0]
    name = op.strip("_")
    if func.namespace not in ("c10d", "_c10d_functional") or name in NOT_COLLECTIVES:
        return None
    kind = KIND.get(name, name)
    if func.namespace == "c10d":
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
        if not boxed:
            return None
        group = dist.ProcessGroup.unbox(boxed[0])
        passed = args[0] if kind == "all_reduce" else args[1]
        out, in_splits, out_splits = (args[0], args[4], args[3]) if kind == "all_to_all" else (None, None, None)
    else:
        group = distributed_c10d._resolve_process_group(args[-1])
        passed = args[0]
        out, in_splits, out_splits = (None, args[2], args[1]) if kind == "all_to_all" else (None, None, None)
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    nbytes = tensor_bytes(passed)
    if kind not in KINDS:
        return Collective(kind, op, group, ranks, me, nbytes, None, None)
    if kind == "all_to_all":
        row = nbytes // max(1, passed.shape[0] if passed.ndim else 1)
        to_peer = _rows(in_splits, passed, len(ranks), row)
        from_peer = _rows(out_splits, out if out is not None else passed, len(ranks), row)
    else:
        to_peer = to_each_peer(kind, nbytes, len(ranks))
        from_peer = list(to_peer)
    to_peer[me] = from_peer[me] = 0
    return Collective(kind, op, group, ranks, me, nbytes, to_peer, from_peer)


def _rows(splits, t: torch.Tensor, size: int, row_bytes: int) -> list:
    """Bytes of `t`'s rows for each group index (equal chunks when `splits` is empty)."""
    splits = list(splits) or [(t.shape[0] if t.ndim else 1) // size] * size
    return [n * row_bytes for n in splits]


class CollectiveRecorder(TorchDispatchMode):
    """Appends the `Collective` of every collective dispatched inside to `calls`, then runs the op."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = decode(func, args)
        if call is not None:
            self.calls.append(call)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_collectives():
    """Yield the list the collectives issued inside the block are appended to (`Collective` each)."""
    calls: list[Collective] = []
    with CollectiveRecorder(calls):
        yield calls


def split_by_node(calls: list, ranks_per_node: int, kind: str = "all_to_all") -> tuple[float, float]:
    """(intra-node, inter-node) bytes sent over the `calls` of `kind`."""
    intra = inter = 0.0
    for call in calls:
        if call.kind == kind:
            a, b = call.links(ranks_per_node)
            intra, inter = intra + a, inter + b
    return intra, inter


# ---- storages alive ------------------------------------------------------------------------------

class LiveMemory:
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
        inputs = {_storage_ptr(t) for t in plain_tensors(args)}
        for t in plain_tensors(out):
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


def plain_tensors(tree) -> list:
    """The plain (not subclass, not meta) tensors of a pytree."""
    return [t for t in pytree.tree_leaves(tree) if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta]


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tensor_bytes(tensors) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(tensor_bytes(t) for t in tensors)
