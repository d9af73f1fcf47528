"""Layout-independent seeded initialization, generated shard by shard.

The same seed gives the same global weights whether a parameter is a full tensor or any DTensor
shard of it (any mesh, any placements), on any device. The random stream is counter-based on
fixed row blocks: view the parameter as rows of its last dim; block b holds rows
[b*R, (b+1)*R) with R = max(1, ROW_BLOCK_ELEMS // row length) (a function of the shape only), and
its values are the first R*row_length normals of a CPU generator seeded by (seed, parameter name,
b). Draws are rounded up to multiples of 16 normals: torch's CPU `normal_` is prefix-consistent
only there (it transforms uniforms 16 at a time; checked on torch 2.13.0), so the rows a rank
needs from a block's start come out the same as from a whole-block draw. A rank draws only the blocks its shard touches (whole rows of them, then keeps its columns),
so the cost is about its own shard (at most one partial block at each end of a contiguous run of
rows), never a full parameter. Blocks are drawn on a thread pool (torch ops release the GIL).
"""

import concurrent.futures
import hashlib

import torch
from torch.distributed.tensor import DTensor

from models.boxes import dtensor_box

ROW_BLOCK_ELEMS = 2**16  # elements per generator key (rounded down to whole rows, at least one row)


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's part of `t` (the whole tensor if not a DTensor)."""
    box = dtensor_box(t)
    return tuple(stop - start for start, stop in box), tuple(start for start, _ in box)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str, rows: tuple[int, int] | None = None) -> None:
    """Fill this rank's part of `param` with N(0, std^2) values that depend only on (seed, name).

    rows=(lo, hi): fill only param[:, lo:hi], as if it were a parameter of its own named `name` (the
    routed experts' w13 holds the streams of w1 and w3 side by side on dim 1)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    shape, offset = local_box(param)
    if rows is None:
        if local.numel():
            local.copy_(normal_box(tuple(param.shape), shape, offset, std, seed, name).view(local.shape))
        return
    lo, hi = max(offset[1], rows[0]), min(offset[1] + shape[1], rows[1])  # this rank's rows of the stream
    if hi <= lo or local.numel() == 0:
        return
    full_shape = (param.shape[0], rows[1] - rows[0], *param.shape[2:])
    part_shape, part_offset = (shape[0], hi - lo, *shape[2:]), (offset[0], lo - rows[0], *offset[2:])
    part = normal_box(full_shape, part_shape, part_offset, std, seed, name).view(part_shape)
    local.narrow(1, lo - offset[1], hi - lo).copy_(part)


def normal_box(full_shape, shape, offset, std: float, seed: int, name: str) -> torch.Tensor:
    """The box `shape` at `offset` of the seeded N(0, std^2) tensor of `full_shape`, as [rows, cols] on the CPU."""
    row_len = full_shape[-1] if full_shape else 1
    rows_per_block = max(1, ROW_BLOCK_ELEMS // row_len)
    rows_R = _box_rows(full_shape, shape, offset)
    cols = slice(offset[-1], offset[-1] + shape[-1]) if full_shape else slice(0, 1)
    blocks_K, counts_K = torch.unique_consecutive(rows_R // rows_per_block, return_counts=True)
    ends_K = torch.cumsum(counts_K, 0)
    firsts_K = blocks_K * rows_per_block  # global first row of each block
    lo_K, hi_K = rows_R[ends_K - counts_K] - firsts_K, rows_R[ends_K - 1] - firsts_K + 1  # rows used, in the block
    out_RC = torch.empty(len(rows_R), cols.stop - cols.start)
    full_rows = cols.stop - cols.start == row_len

    def fill(block: int, end: int, count: int, lo: int, hi: int) -> None:
        g = torch.Generator().manual_seed(_seed(seed, name, block))
        out = out_RC[end - count:end]
        if lo == 0 and hi == count and full_rows and count * row_len % 16 == 0:  # the block's first rows
            out.normal_(0.0, std, generator=g)
            return
        needed = hi * row_len  # the stream up to the last row used, in whole 16s
        drawn = torch.empty(-(-needed // 16) * 16).normal_(0.0, std, generator=g)[:needed].view(hi, row_len)
        used = slice(lo, hi) if hi - lo == count else rows_R[end - count:end] - block * rows_per_block
        out.copy_(drawn[used, cols])

    _run(fill, list(zip(blocks_K.tolist(), ends_K.tolist(), counts_K.tolist(), lo_K.tolist(), hi_K.tolist())))
    return out_RC


def _box_rows(full_shape, shape, offset) -> torch.Tensor:
    """Global row ids (row = index over all dims but the last) of the box, in row-major order (sorted)."""
    rows = torch.zeros((), dtype=torch.int64)
    for size, start, length in zip(full_shape[:-1], offset[:-1], shape[:-1]):
        rows = rows[..., None] * size + torch.arange(start, start + length)
    return rows.reshape(-1)


def _run(fill, tasks: list[tuple]) -> None:
    threads = torch.get_num_threads()
    if threads == 1 or len(tasks) < 4:
        for task in tasks:
            fill(*task)
        return
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda task: fill(*task), tasks))


def _seed(seed: int, name: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
