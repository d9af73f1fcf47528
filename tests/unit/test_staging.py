"""runtime/staging.py on the CPU: the ring reuses its buffers (same storage), holds the right data, and
a new shape or dtype gets its own buffers; `to_device` to the CPU returns the tensor itself. The pinned
allocation, the non-blocking copy and its CUDA event run only on a GPU (benchmarks/gpu_check.py)."""

import torch

from runtime.staging import PinnedStaging
from runtime.train import to_device


def _batch(seed, shape=(2, 5), dtype=torch.int64):
    return torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_ring_reuses_its_buffers_and_holds_each_batch():
    staging = PinnedStaging(depth=2, pin=False)
    batches = [_batch(seed) for seed in range(5)]
    buffers = []
    for t in batches:
        buffers.append(staging.stage(t).host)
        assert torch.equal(buffers[-1], t) and buffers[-1].data_ptr() != t.data_ptr()  # a copy, not the batch
    pointers = [b.data_ptr() for b in buffers]
    assert pointers[0] != pointers[1] and pointers[::2] == [pointers[0]] * 3 and pointers[1::2] == [pointers[1]] * 2


def test_a_new_shape_or_dtype_gets_a_new_buffer():
    staging = PinnedStaging(depth=1, pin=False, max_shapes=2)
    first = staging.stage(_batch(0)).host.data_ptr()
    assert staging.stage(_batch(1)).host.data_ptr() == first  # depth 1: the same storage every call
    other_shape = staging.stage(_batch(2, shape=(3, 5)))
    assert torch.equal(other_shape.host, _batch(2, shape=(3, 5))) and other_shape.host.data_ptr() != first
    assert staging.stage(_batch(3, dtype=torch.int32)).host.dtype == torch.int32
    assert len(staging._rings) == 2  # max_shapes: the (2, 5) int64 ring went first


def test_to_device_on_the_cpu_is_a_no_op():
    t = _batch(0)
    assert to_device(t, torch.device("cpu")) is t
