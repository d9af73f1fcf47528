"""Count host synchronizations: the points where the CPU must wait for the accelerator.

On a GPU the host queues kernels and runs ahead; anything that needs a device value on the host
(a Python number, a data-dependent output shape, a copy into pageable host memory) drains the
queue and leaves the GPU idle until the host catches up. FSDP2's implicit prefetch is issued by
the host, so every sync also exposes the next all-gather. Syncs are invisible in a CPU run's
wall clock but countable: `count_syncs()` counts the operations that force one on CUDA.

What is counted (one per call; each is at least one host wait on CUDA):
  item          aten._local_scalar_dense: .item(), bool(t), int(t), float(t), `if t:`
  tolist        Tensor.tolist() / .numpy() / .cpu() of a device tensor (a device-to-host copy)
  shape         ops whose output shape depends on values, so the host must read them:
                nonzero, masked_select, boolean-mask indexing, unique, repeat_interleave without
                output_size, bincount (its CUDA kernel reads min/max to size the output), histc
                without an explicit range, equal / is_nonzero (return a Python bool)
  copy          blocking copies between host and device (`.to(device)` from pageable memory
                without non_blocking, and device-to-host copies): seen only when a device exists;
                and device tensors made from host data by our code (`torch.tensor(x, device=...)`,
                `torch.as_tensor`: a pageable copy that waits for the stream on CUDA, which the
                dispatcher never sees; `torch.full` is the sync-free way), in every run
Which tensors count: those on `device_type` (the run's device). In a CPU run that is every tensor,
so the count is what the same code would do on a GPU, except copies between host and device
(there are none on a CPU) and `torch.cuda.synchronize` calls (not dispatcher ops). Tensors that
live on the host in every run are declared so: `mark_host(tensors)` (e.g. AdamW's step counters,
CPU scalars by torch's convention and ours), and code that deliberately works on host data runs
under `host_side()`. Collectives are not syncs: NCCL orders them on the stream.
Blind spot (torch 2.13.0): torch-function modes are not active while autograd recomputes an
activation-checkpointed region, so a CPU run misses `.tolist()` there (dispatch-level syncs such
as `.item()` are still counted; on a GPU the tolist is a device-to-host copy and is counted), and
every run misses `torch.tensor(x, device=...)` there.

Private torch API (checked on torch 2.13.0): `torch.utils._python_dispatch.TorchDispatchMode`, the
documented way to intercept dispatcher calls (no public alias), as in benchmarks/lib/counters.py.
"""

import collections
import contextlib
import os
import sys
import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HOST_SIDE = [0]  # depth of `host_side()` blocks
# id -> weak reference of the tensors declared host-resident (`mark_host`); by identity, because a
# WeakSet compares tensors with `==`, which is itself a tensor op
_HOST_TENSORS: dict[int, weakref.ref] = {}

# Data-dependent output shapes (the host reads a size from the device).
_SHAPE_OPS = {
    "nonzero", "masked_select", "unique_dim", "_unique", "_unique2", "unique_consecutive", "bincount",
    "argwhere", "equal", "is_nonzero", "nonzero_numpy",
}
# Python-level tensor methods that copy device data to the host; dispatch does not see them on CPU.
_READBACK_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "tolist", torch.Tensor.cpu: "tolist"}
# Tensors made from Python or NumPy data (`device` is keyword-only in both).
_FACTORIES = (torch.tensor, torch.as_tensor)


@dataclass
class SyncCounts:
    """Host syncs seen in a `count_syncs()` block: total, per kind, per call site (file:line op)."""
    total: int = 0
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    by_site: collections.Counter = field(default_factory=collections.Counter)

    def add(self, kind: str, op: str) -> None:
        self.total += 1
        self.by_kind[kind] += 1
        self.by_site[f"{_call_site()} {op}"] += 1

    def as_dict(self) -> dict:
        return {"total": self.total, "by_kind": dict(self.by_kind), "by_site": dict(self.by_site.most_common())}


@contextlib.contextmanager
def host_side():
    """Mark a block that works on host-resident data (not counted when its tensors are on the CPU)."""
    _HOST_SIDE[0] += 1
    try:
        yield
    finally:
        _HOST_SIDE[0] -= 1


def mark_host(tensors) -> None:
    """Declare CPU tensors that stay on the host in a GPU run too: reading them is not a sync."""
    for t in tensors:
        if t.device.type == "cpu":
            _HOST_TENSORS[id(t)] = weakref.ref(t, lambda _, key=id(t): _HOST_TENSORS.pop(key, None))


def mark_optimizer_host_state(optimizer) -> None:
    """`mark_host` for every CPU scalar in the optimizer state (AdamW's "step" counters)."""
    mark_host(v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0)


def _call_site() -> str:
    """The innermost frame in this repository outside this file: where the sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path.startswith(_ROOT) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, _ROOT)}:{frame.lineno}"
    return "<outside the repository>"


def _on_device(t, device_type: str) -> bool:
    if not isinstance(t, torch.Tensor) or t.device.type != device_type:
        return False
    marked = _HOST_TENSORS.get(id(t))
    return not ((_HOST_SIDE[0] and t.device.type == "cpu") or (marked is not None and marked() is t))


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: SyncCounts, device_type: str):
        super().__init__()
        self.counts, self.device_type = counts, device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            self.counts.add(kind, func.__name__)
        return func(*args, **kwargs)

    def _kind(self, func, args, kwargs) -> str | None:
        name = func.__name__.split(".")[0]
        first = args[0] if args else None
        if name in ("_to_copy", "copy_"):
            return "copy" if _blocking_transfer(name, args, kwargs) else None
        if not _on_device(first, self.device_type):
            return None
        if name == "_local_scalar_dense":
            return "item"
        if name in _SHAPE_OPS:
            return "shape"
        if name == "index" and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return "shape"  # x[mask]: nonzero inside
        if func.__name__ == "repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            return "shape"
        if name == "histc" and _histc_range(args, kwargs) == (0, 0):
            return "shape"
        return None


def _histc_range(args, kwargs) -> tuple:
    lo = kwargs.get("min", args[2] if len(args) > 2 else 0)
    hi = kwargs.get("max", args[3] if len(args) > 3 else 0)
    return lo, hi


def _blocking_transfer(name: str, args, kwargs) -> bool:
    """A host<->device copy that blocks the host: any device->host copy, or host->device without
    non_blocking (PyTorch then synchronizes the stream after the copy)."""
    if name == "_to_copy":
        src, dst = args[0].device, kwargs.get("device") or args[0].device
        non_blocking = kwargs.get("non_blocking", False)
    else:
        dst, src = args[0].device, args[1].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    dst = torch.device(dst)
    if src.type == dst.type:
        return False
    return dst.type == "cpu" or not non_blocking


class _FunctionCounter(TorchFunctionMode):
    """What the dispatcher never sees: readbacks of CPU tensors (tolist, numpy, cpu; counted in a CPU
    run only, a GPU run's dispatcher sees them as device-to-host copies) and device tensors made from
    host data (`_FACTORIES`) by code of this repository (torch's own, e.g. AdamW's CPU step scalars, are
    host tensors by design)."""

    def __init__(self, counts: SyncCounts, device_type: str):
        super().__init__()
        self.counts, self.device_type = counts, device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READBACK_METHODS.get(func) if self.device_type == "cpu" else None
        if kind and _on_device(args[0], self.device_type):
            self.counts.add(kind, func.__name__)
        elif func in _FACTORIES and self._from_host(args, kwargs):
            self.counts.add("copy", func.__name__)
        return func(*args, **kwargs)

    def _from_host(self, args, kwargs) -> bool:
        device = kwargs.get("device")
        if device is None or torch.device(device).type != self.device_type:
            return False
        if args and isinstance(args[0], torch.Tensor):
            return False  # a tensor's own copy: the dispatcher sees it
        caller = os.path.abspath(sys._getframe(2).f_code.co_filename)  # 0: here, 1: __torch_function__
        ours = caller.startswith(_ROOT) and not any(d in caller for d in ("site-packages", "dist-packages"))
        return ours and caller != os.path.abspath(__file__)


@contextlib.contextmanager
def count_syncs(device_type: str = "cpu"):
    """`with count_syncs("cuda") as counts: train_step(...)` -> counts (SyncCounts) of this rank."""
    counts = SyncCounts()
    with _FunctionCounter(counts, device_type), _DispatchCounter(counts, device_type):
        yield counts
