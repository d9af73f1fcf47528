"""Where each rank's shard of a DTensor parameter sits in the global tensor: a box.

FSDP2 and DTensor cut a tensor dim with `torch.chunk` semantics: n parts of ceil(size / n), the
trailing parts shorter or empty. When several mesh axes shard the same tensor dim the cuts nest: each
axis chunks the piece the previous axis left. So every rank holds one contiguous [start, stop) range
per tensor dim (a box). The sharded optimizer plans with boxes alone; the seeded init and the
checkpoint loader fill and read exactly this rank's box. Imports only torch and numpy; it sits in
models/, the bottom layer, so models/, parallel/ and optim/ all use it without an upward import.

Order of the nested cuts: plain `Shard` placements in mesh-axis order (left to right), then
`_StridedShard` placements. `_StridedShard(d, split_factor=k)` is FSDP2's mark for "this axis shards
dim d AFTER the axes to its right that shard d" (expert weights: Shard(0) on `ep` first, then FSDP on
`edp_shard`), with k = the product of those axes' sizes; we check that k.

Private torch API: `_StridedShard` (torch.distributed.tensor.placement_types), checked on torch 2.13.0.
This module is its only user.
"""

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def placement_kind(placement) -> tuple:
    """("replicate",) | ("shard", dim) | ("strided", dim, split_factor); ValueError otherwise."""
    if isinstance(placement, _StridedShard):
        return ("strided", placement.dim, placement.split_factor)
    if isinstance(placement, Shard):
        return ("shard", placement.dim)
    if isinstance(placement, Replicate):
        return ("replicate",)
    raise ValueError(f"placement {placement!r}: the sharded optimizer supports Replicate, Shard, _StridedShard")


def strided_shard(dim: int, split_factor: int):
    """The placement FSDP2 gives a dim already sharded by later mesh axes (for building specs)."""
    return _StridedShard(dim, split_factor=split_factor)


def chunk(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """The index-th of `parts` torch.chunk pieces of [start, stop) (empty past the end)."""
    size = -(-(stop - start) // parts)
    lo = min(start + index * size, stop)
    return lo, min(lo + size, stop)


def cut_order(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements) -> list[tuple[int, int]]:
    """(mesh axis, tensor dim) of every sharding placement, in the order the cuts nest."""
    kinds = [placement_kind(p) for p in placements]
    if len(kinds) != len(mesh_shape):
        raise ValueError(f"{len(kinds)} placements for a mesh of shape {tuple(mesh_shape)}")
    plain = [(axis, k[1]) for axis, k in enumerate(kinds) if k[0] == "shard"]
    strided = [(axis, k[1], k[2]) for axis, k in enumerate(kinds) if k[0] == "strided"]
    for axis, dim, factor in strided:
        before = int(np.prod([mesh_shape[a] for a, d in plain if d == dim and a > axis]))
        if factor != before:
            raise ValueError(
                f"_StridedShard(dim={dim}, split_factor={factor}) on mesh axis {axis} of mesh "
                f"{tuple(mesh_shape)}: expected split_factor {before} (the sizes of the later axes sharding dim {dim})"
            )
    for _, dim in plain + [(a, d) for a, d, _ in strided]:
        if not 0 <= dim < len(shape):
            raise ValueError(f"placements {tuple(placements)} shard dim {dim} of a tensor of shape {tuple(shape)}")
    return plain + [(a, d) for a, d, _ in strided]


def local_box(shape, mesh_shape, placements, coordinate) -> tuple[tuple[int, int], ...]:
    """The [start, stop) range per tensor dim held by the rank at mesh `coordinate`."""
    box = [[0, size] for size in shape]
    for axis, dim in cut_order(shape, mesh_shape, placements):
        box[dim] = list(chunk(box[dim][0], box[dim][1], mesh_shape[axis], coordinate[axis]))
    return tuple(tuple(b) for b in box)


def all_boxes(shape, mesh_shape, placements) -> np.ndarray:
    """Boxes of every mesh coordinate: int64 [*mesh_shape, ndim, 2] (start, stop)."""
    order = cut_order(shape, mesh_shape, placements)
    boxes = np.zeros((*mesh_shape, len(shape), 2), dtype=np.int64)
    boxes[..., 1] = np.asarray(shape, dtype=np.int64)
    for axis, dim in order:  # vectorized chunk over all coordinates at once
        start, stop = boxes[..., dim, 0], boxes[..., dim, 1]
        parts = mesh_shape[axis]
        index = np.arange(parts).reshape([-1 if a == axis else 1 for a in range(len(mesh_shape))])
        size = -(-(stop - start) // parts)
        lo = np.minimum(start + index * size, stop)
        boxes[..., dim, 0], boxes[..., dim, 1] = lo, np.minimum(lo + size, stop)
    return boxes


def dtensor_box(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """This rank's [start, stop) range per dim of `t`'s global tensor (the whole tensor if not a DTensor)."""
    if not isinstance(t, DTensor):
        return tuple((0, size) for size in t.shape)
    mesh = t.device_mesh
    return local_box(tuple(t.shape), tuple(mesh.shape), t.placements, mesh.get_coordinate())
