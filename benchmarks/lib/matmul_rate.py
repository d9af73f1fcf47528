"""The machine's own Newton-Schulz matmul rate for a set of block shapes (the benchmark's yardstick).

`ns_rate(shape_counts)` times `orthogonalize` on every block of the set, one batched call per
shape (the best case: no communication, no Python per block), and returns GFLOP/s. An optimizer
step that reaches this rate on its busiest rank spends all its time in useful NS matmuls; the
benchmark reports each method's achieved rate as a fraction of it.
"""

import time
from collections import Counter

import torch

from models.splits import MatrixSplit
from optim.newton_schulz import ns_flops, orthogonalize


def block_shape_counts(shapes: dict[str, tuple], splits: dict[str, MatrixSplit]) -> Counter:
    """(rows, cols) of a block -> number of such blocks, over all parameters."""
    counts = Counter()
    for fqn, shape in shapes.items():
        split = splits[fqn]
        counts[split.block_shape(tuple(shape))] += split.num_blocks(tuple(shape))
    return counts


def total_ns_flops(shape_counts: Counter, steps: int = 5) -> int:
    return sum(n * ns_flops(r, c, steps) for (r, c), n in shape_counts.items())


def ns_rate(shape_counts: Counter, repeats: int = 3, dtype=torch.float32, device="cpu", seed: int = 0) -> float:
    """Median-of-`repeats` GFLOP/s of batched `orthogonalize` over all blocks of `shape_counts`."""
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(n, r, c, generator=gen).to(device, dtype) for (r, c), n in shape_counts.items()]
    flops = total_ns_flops(shape_counts)
    for x in batches:  # warm-up (first-call allocations, kernel selection)
        orthogonalize(x[:1])
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x in batches:
            orthogonalize(x)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return flops / sorted(seconds)[len(seconds) // 2] / 1e9


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
