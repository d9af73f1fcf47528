"""Layout-independent seeded initialization.

The same seed gives the same global weights whether a parameter is a full tensor or any DTensor
shard of it (any mesh, any placements), on any device: index i along dim 0 (a row of a matrix, an
expert of a stacked weight) is drawn on the CPU from its own generator seeded by
(seed, parameter name, i). A rank draws only the dim-0 indices its shard holds and keeps the part
of the remaining dims it holds, so a large model is initialized shard by shard after
`to_empty`, without ever materializing a full parameter. Cost: one generator per local dim-0 index.
"""

import hashlib

import torch
from torch.distributed.tensor import DTensor

from parallel.boxes import dtensor_box


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's part of `t` (the whole tensor if not a DTensor)."""
    box = dtensor_box(t)
    return tuple(stop - start for start, stop in box), tuple(start for start, _ in box)


def _seed(seed: int, name: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill this rank's part of `param` with N(0, std^2) values that depend only on (seed, name)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    shape, offset = local_box(param)
    if local.numel() == 0:
        return
    keep = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:]))
    rows = []
    for i in range(offset[0], offset[0] + shape[0]):
        g = torch.Generator().manual_seed(_seed(seed, name, i))
        rows.append(torch.empty(param.shape[1:]).normal_(0.0, std, generator=g)[keep])
    local.copy_(torch.stack(rows).view(local.shape))
