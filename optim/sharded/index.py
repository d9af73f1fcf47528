"""Index maps of one rank's buckets: every piece of a bucket moves with a few whole-bucket ops.

Built once at optimizer construction from a bucket of `rank_schedule` (optim/sharded/schedule.py),
so a step's op count scales with buckets, shape groups and parameters, not with pieces. Three flat
buffers per bucket, each a concatenation of pieces in a fixed order:

  stage     this rank's held pieces: the forward all-to-all's send segments (exchange by exchange,
            in `Exchange.sends` order), then the copies (held and owned here, `Bucket.copies`
            order). The return all-to-all brings the results back into the same layout ("back").
  incoming  the owned pieces received: each exchange's receive segment (`Exchange.recvs` order).
            The return all-to-all sends the results in the same layout ("ret"); the copies go
            straight between stage / back and the blocks.
  blocks    per batch, its wide blocks [n_w, s, l] then its tall blocks [n_t, l, s], each in the
            orientation the parameter stores it (so a piece is a few contiguous runs of a block).

A piece is contiguous in stage / incoming and a set of equal contiguous runs in a local shard or a
block. All maps work on rows of g elements, g the gcd of every run length, run start and buffer
size involved (one g for the stage side, one for the block side), so a map costs 8 bytes per g
elements: a local shard or the blocks viewed as [-1, g] are gathered / scattered with one
`index_select` / `index_copy_` / `index_add_` per parameter (stage side) or per bucket (block side).
A parameter whose pieces are a few contiguous runs on both sides (`MAX_RUNS`) moves by slices
instead, one op per run that touches only its elements.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch


# A map of at most this many contiguous runs moves run by run (a slice each: one op reading and
# writing only the elements) instead of by `index_select` + `index_copy_` / `index_add_` (which
# stage the rows once more in memory). Kimi K2, 256 GPUs, narrow layout: 91% of a rank's elements
# are in maps of <= 16 runs (the expert pieces); the rest (per-head pieces) have hundreds.
MAX_RUNS = 16


@dataclass
class ParamMap:
    """Where one parameter's pieces sit in a flat buffer: `runs`, slices of the flat local shard and
    of the buffer, when they are a few contiguous runs; else index tensors on both viewed as rows of
    g elements (`local_rows[i]` of the local shard is `buffer_rows[i]` of stage or a receive buffer)."""

    param: int
    runs: list[tuple[slice, slice]] | None = None  # (local elements, buffer elements) of equal length
    local_rows: torch.Tensor | None = None
    buffer_rows: torch.Tensor | None = None


@dataclass
class GatherMap:
    """Replica all-gather of one group (sharded.schedule.Gather): my segment (rows of back) goes into
    the chunks by an all-to-all, the chunks are all-gathered into one buffer of every segment."""

    send_rows: torch.Tensor
    send_sizes: list[int]  # the all-to-all into the chunks
    recv_sizes: list[int]
    chunk: int  # elements per member in the all-gather
    total: int  # elements of all segments (the all-gather's output beyond is padding)
    apply: list[ParamMap]  # buffer_rows: rows of the all-gathered buffer (the other members' segments)


@dataclass
class BucketIndex:
    g_stage: int
    g_blocks: int
    n_send: int  # stage[:n_send] is the forward send buffer (and back[:n_send] the return receive buffer)
    n_stage: int  # n_send + copies
    n_recv: int  # incoming: the forward receive buffer (and ret: the return send buffer)
    n_blocks: int  # elements of all blocks of the bucket
    pack: list[ParamMap] = field(default_factory=list)  # u -> stage, and back -> parameters
    recv_rows: torch.Tensor | None = None  # block row of each received row (forward) / returned row
    copy_rows: torch.Tensor | None = None  # block row of each row of the copies (stage[n_send:], back[n_send:])
    batches: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (offset, n_wide, n_tall, s, l)
    own_batches: list[bool] = field(default_factory=list)  # per batch: no received row (own copies only)
    gathers: list[GatherMap] = field(default_factory=list)


def bucket_index(plan, bucket, local_shapes, device) -> BucketIndex:
    """The maps of `bucket` (a sharded.schedule.Bucket) for this rank's local shard shapes."""
    held, owned = bucket.held, bucket.owned
    stage_order = [h for ex in bucket.exchanges for h in ex.sends] + [h for h, _ in bucket.copies]
    incoming_order = [o for ex in bucket.exchanges for o in ex.recvs] + [o for _, o in bucket.copies]
    n_send = sum(_numel(held[h].shape) for ex in bucket.exchanges for h in ex.sends)
    n_recv = sum(_numel([s.stop - s.start for s in owned[o].block]) for ex in bucket.exchanges for o in ex.recvs)
    gathered = [list(gx.recvs) for gx in bucket.gathers]
    held_runs = {h: _local_runs(local_shapes[held[h].param], held[h].local)
                 for h in set(stage_order) | {h for hs in gathered for h in hs}}
    g_stage = _gcd([local for h, r in held_runs.items() for local in (r[1], *r[0].tolist())]
                   + [_numel(local_shapes[held[h].param]) for h in held_runs])
    offsets = _offsets([_numel(held[h].shape) for h in stage_order])
    ix = BucketIndex(g_stage, 1, n_send, int(offsets[-1]), n_recv, 0)
    ix.pack = _param_maps(held, stage_order, offsets, held_runs, g_stage, device)
    _block_maps(ix, plan, bucket, incoming_order, device)
    at = dict(zip(stage_order, offsets[:-1].tolist()))
    for gx, recvs in zip(bucket.gathers, gathered):
        send = [_rows(at[h], _numel(held[h].shape), g_stage) for h in gx.sends]
        mine = sum(gx.segments[: gx.me])  # the others' segments before mine, then mine, then the rest
        sizes = [_numel(held[h].shape) for h in recvs]
        recv_offsets = _offsets(sizes)
        recv_offsets += np.where(recv_offsets >= mine, gx.segments[gx.me], 0)  # pieces have numel > 0
        ix.gathers.append(GatherMap(
            _tensor(np.concatenate(send) if send else np.zeros(0, np.int64), device),
            *gx.balance_sizes(), gx.chunk, sum(gx.segments),
            _param_maps(held, recvs, recv_offsets, held_runs, g_stage, device)))
    return ix


def _param_maps(held, order, offsets, runs, g, device) -> list[ParamMap]:
    """Per parameter (first appearance order): its pieces' local rows and buffer rows."""
    local, buffer = {}, {}
    for h, off in zip(order, offsets[:-1].tolist()):
        starts, length = runs[h]
        pi = held[h].param
        local.setdefault(pi, []).append(_run_rows(starts, length, g))
        buffer.setdefault(pi, []).append(_rows(off, _numel(held[h].shape), g))
    return [_param_map(pi, np.concatenate(local[pi]), np.concatenate(buffer[pi]), g, device) for pi in local]


def _param_map(pi, local, buffer, g, device) -> ParamMap:
    """Runs where the rows are few contiguous runs on both sides, else index tensors."""
    starts = np.flatnonzero((np.diff(local) != 1) | (np.diff(buffer) != 1)) + 1
    if len(starts) < MAX_RUNS:
        bounds = [0, *starts.tolist(), len(local)]
        return ParamMap(pi, runs=[(slice(int(local[a]) * g, int(local[a] + b - a) * g),
                                   slice(int(buffer[a]) * g, int(buffer[a] + b - a) * g))
                                  for a, b in zip(bounds, bounds[1:])])
    return ParamMap(pi, local_rows=_tensor(local, device), buffer_rows=_tensor(buffer, device))


def _block_maps(ix, plan, bucket, incoming_order, device) -> None:
    """Block layout (batches of wide then tall blocks, parameter orientation) and the maps to it."""
    tall = {}  # (batch, position) -> whether the block is stored tall
    for bi, batch in enumerate(bucket.batches):
        for pos, (param, _) in enumerate(batch.blocks):
            r, c = plan.params[param].block_shape
            tall[bi, pos] = r > c
    base, offset = {}, 0
    for bi, batch in enumerate(bucket.batches):
        s, l = plan.shape_groups[batch.shape_group][:2]
        order = [p for p in range(len(batch.blocks)) if not tall[bi, p]] + [p for p in range(len(batch.blocks))
                                                                              if tall[bi, p]]
        n_tall = sum(tall[bi, p] for p in order)
        ix.batches.append((offset, len(order) - n_tall, n_tall, s, l))
        for p in order:
            base[bi, p] = offset
            offset += s * l
    runs = []
    for o in incoming_order:
        piece = bucket.owned[o]
        r, c = plan.params[bucket.batches[piece.batch].blocks[piece.pos][0]].block_shape
        starts, length = _local_runs((r, c), piece.block)
        runs.append((starts + base[piece.batch, piece.pos], length))
    sizes = [len(st) * ln for st, ln in runs]
    ix.n_blocks = int(sum(sizes))
    assert ix.n_blocks == offset, (ix.n_blocks, offset)  # every block element arrives exactly once
    g = _gcd([v for st, ln in runs for v in (ln, *st.tolist())] + [offset]
             + [n * s * l for _, nw, nt, s, l in ix.batches for n in (nw, nt)])
    ix.g_blocks = g
    incoming_offsets = _offsets(sizes)
    dst = np.concatenate([_run_rows(st, ln, g) for st, ln in runs]) if runs else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(dst), np.arange(offset // g)), "blocks not covered exactly once"
    assert incoming_offsets[-1] == offset and ix.n_recv % g == 0
    ix.recv_rows, ix.copy_rows = _tensor(dst[: ix.n_recv // g], device), _tensor(dst[ix.n_recv // g :], device)
    received = np.sort(dst[: ix.n_recv // g]) * g  # first element of each received row
    ix.own_batches = [bool(np.searchsorted(received, off) == np.searchsorted(received, off + (nw + nt) * s * l))
                      for off, nw, nt, s, l in ix.batches]


def _local_runs(shape, slices) -> tuple[np.ndarray, int]:
    """Contiguous runs of the box `slices` in a C-contiguous tensor of `shape`: (run starts in
    row-major order of the box, run length). Trailing dims the box spans whole merge into a run."""
    shape = tuple(int(s) for s in shape)
    lo = [0] * (len(shape) - len(slices)) + [s.start for s in slices]
    hi = [n for n in shape[: len(shape) - len(slices)]] + [s.stop for s in slices]
    strides = np.cumprod([1, *shape[::-1]])[:-1][::-1]
    k = len(shape) - 1
    length = hi[k] - lo[k]
    while k > 0 and lo[k] == 0 and hi[k] == shape[k]:
        k -= 1
        length *= hi[k] - lo[k]
    starts = np.zeros(1, dtype=np.int64) + lo[k] * strides[k]
    for d in range(k - 1, -1, -1):  # outer dims: one run per index combination, row-major
        starts = ((np.arange(lo[d], hi[d]) * strides[d])[:, None] + starts[None, :]).ravel()
    return starts, int(length)


def _run_rows(starts, length, g) -> np.ndarray:
    return ((starts // g)[:, None] + np.arange(length // g)[None, :]).ravel()


def _rows(offset, numel, g) -> np.ndarray:
    return np.arange(offset // g, (offset + numel) // g)


def _offsets(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)


def _gcd(values) -> int:
    return max(1, math.gcd(*[int(v) for v in values])) if values else 1


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
