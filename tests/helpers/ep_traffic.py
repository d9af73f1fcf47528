"""Count the bytes every all-to-all of a real run sends, within and across simulated nodes.

    with count_all_to_all(ranks_per_node=4) as calls:
        loss = model(inputs); loss.backward()
    intra, inter = split_by_node(calls, ranks_per_node=4)

A dispatch mode (like benchmarks/lib/counters.py's) sees each c10d `alltoall_base_` the process issues,
whoever issues it (forward or backward, any module), and records the bytes of the input's rows for
each peer (self excluded) by GLOBAL rank; a peer on the same node (ranks_per_node consecutive global
ranks) is intra-node. The counts come from the tensors and split sizes handed to the collective, not
from the code that planned them: tests compare them with parallel/ep/plan.py.

Private torch APIs (checked on torch 2.13.0): `TorchDispatchMode` and `ProcessGroup.unbox`, as in
benchmarks/lib/counters.py.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class AllToAll:
    """One all-to-all this rank issued: bytes it sent to each global rank (self included, as 0)."""
    me: int
    sent: dict[int, int]
    dtype: torch.dtype


class _Recorder(TorchDispatchMode):
    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.split(".")[0] == "alltoall_base_":
            self.calls.append(_record(args))
        return func(*args, **(kwargs or {}))


def _record(args) -> AllToAll:
    """args: (output, input, group, output_split_sizes, input_split_sizes, ...)."""
    x, group = args[1], dist.ProcessGroup.unbox(args[2])
    ranks = dist.get_process_group_ranks(group) if group.size() < dist.get_world_size() else list(
        range(dist.get_world_size()))
    rows = x.shape[0] if x.ndim else 1
    splits = list(args[4]) or [rows // len(ranks)] * len(ranks)
    row_bytes = x.numel() * x.element_size() // max(1, rows)
    me = dist.get_rank()
    return AllToAll(me, {r: (0 if r == me else n * row_bytes) for r, n in zip(ranks, splits)}, x.dtype)


@contextlib.contextmanager
def count_all_to_all():
    """Yield the list the all-to-alls issued inside the block are appended to (AllToAll each)."""
    calls: list[AllToAll] = []
    with _Recorder(calls):
        yield calls


def split_by_node(calls: list[AllToAll], ranks_per_node: int) -> tuple[int, int]:
    """(intra-node, inter-node) bytes sent over `calls`."""
    intra = inter = 0
    for call in calls:
        for peer, n in call.sent.items():
            if peer // ranks_per_node == call.me // ranks_per_node:
                intra += n
            else:
                inter += n
    return intra, inter
