"""Host batches to the GPU through reusable pinned buffers, without a host sync.

A copy from pageable host memory makes the host wait for the device stream; from pinned memory with
`non_blocking=True` the host only queues it. Each batch shape and dtype gets a ring of `depth` pinned
buffers, refilled in turn (one host memcpy each), instead of a pinned block per batch
(`t.pin_memory()`, which torch's caching host allocator serves from its free blocks once warm).
A buffer is refilled only after its previous copy to the device has run (a CUDA event recorded
behind that copy): the host waits there only when it is `depth` copies of that shape ahead of the
device. At most `max_shapes` rings are kept (the oldest goes first; a freed pinned block returns to
torch's caching host allocator, which reuses it only after its recorded copies ran). On other devices
`to_device` is a plain `.to(device)` (a no-op on the CPU).
"""

from dataclasses import dataclass

import torch


@dataclass
class _Buffer:
    host: torch.Tensor  # pinned when the staging pins
    copied: torch.cuda.Event | None = None  # recorded behind the last copy out of `host`


class PinnedStaging:
    """Rings of reusable host buffers, one ring per (shape, dtype)."""

    def __init__(self, depth: int = 4, pin: bool = True, max_shapes: int = 8):
        """`pin=False` stages through pageable buffers (same reuse; for hosts without a pinned allocator)."""
        assert depth >= 1 and max_shapes >= 1
        self.depth, self.pin, self.max_shapes = depth, pin, max_shapes
        self._rings: dict[tuple, list[_Buffer]] = {}
        self._next: dict[tuple, int] = {}

    def stage(self, t: torch.Tensor) -> _Buffer:
        """The ring's next buffer for t's shape and dtype, now holding a copy of `t` (a host tensor)."""
        key = (tuple(t.shape), t.dtype)
        if key not in self._rings and len(self._rings) == self.max_shapes:
            oldest = next(iter(self._rings))
            del self._rings[oldest], self._next[oldest]
        ring, i = self._rings.setdefault(key, []), self._next.get(key, 0)
        self._next[key] = (i + 1) % self.depth
        if i == len(ring):
            ring.append(_Buffer(torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)))
        buffer = ring[i]
        if buffer.copied is not None:
            buffer.copied.synchronize()  # its previous copy to the device has run (rarely waits: see above)
        buffer.host.copy_(t)
        return buffer

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Host tensor -> `device`; on CUDA queued from a pinned buffer without waiting for the stream."""
        if device.type != "cuda":
            return t.to(device)
        buffer = self.stage(t)
        out = buffer.host.to(device, non_blocking=True)
        buffer.copied = torch.cuda.Event()
        buffer.copied.record()  # on the current stream, behind the copy
        return out


# one per process; pinned buffers are allocated on the first CUDA copy, not at import. 32 shapes: a
# post-training micro-batch brings 16 tensors (runtime/posttrain/rollout_batch.py), pretraining 3
_STAGING = PinnedStaging(max_shapes=32)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch -> device without a host sync: on CUDA through reusable pinned buffers and a
    non-blocking copy; elsewhere `.to(device)`."""
    return _STAGING.to_device(t, device)
