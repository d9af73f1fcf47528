"""Measured peak tensor memory of a code region, by category, on any device (CPU included).

Uses torch's `MemTracker` (private: `torch.distributed._tools.mem_tracker`, checked on torch 2.13.0),
which follows every tensor storage created inside the region (parameters, buffers, gradients,
optimizer state, activations, temporaries) and records the peak of their sum: the CPU analogue of
`torch.cuda.max_memory_allocated`, without allocator caching or fragmentation.
"""

import contextlib

from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker


@contextlib.contextmanager
def track_peak(*modules: nn.Module, optimizers=()):
    """`with track_peak(model) as peak: ...`; afterwards `peak()` is {category: bytes, "Total": bytes}
    at the moment the sum peaked (summed over devices). Tensors that exist before the region (the
    modules' parameters, buffers, gradients; the optimizers' state) are counted from the start."""
    tracker = MemTracker()
    tracker.track_external(*modules, *optimizers)
    with tracker:
        yield lambda: _by_category(tracker.get_tracker_snapshot("peak"))


def _by_category(snapshot: dict) -> dict:
    out = {}
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            name = category if isinstance(category, str) else category.value
            out[name] = out.get(name, 0) + nbytes
    return out
