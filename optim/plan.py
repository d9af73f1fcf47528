"""Sharded Muon's plan: which rank orthogonalizes which block, and in which bucket. Pure: no process
group calls, so a 1T-parameter model on 2048 ranks plans on a laptop in seconds.

Input: one `ParamSpec` per Muon parameter (global shape, dtype, `MatrixSplit`, the global ranks of
its DTensor mesh, its placements). Every rank computes the same plan from the same specs.

1. Geometry. Mesh axes with Replicate placements are replica axes (R replicas); the others shard
   (S shard positions). A replica's "communication group" is its S ranks. Each shard position holds a
   box of the parameter (see `optim/sharded_boxes.py`); a block's pieces are its intersections with
   the boxes. Parameters of equal shape, split, mesh shape and placements share one piece template.
2. Shape groups: blocks with equal (short side, long side, NS dtype), across parameters and layers,
   are orthogonalized in one batched call per bucket; tall blocks join transposed (Newton-Schulz
   commutes with transposition and `orthogonalize` itself works on the wide orientation), so an
   expert's w2 [D, F] batches with w1 and w3 [F, D].
3. Owners, balancing estimated NS FLOPs (`ns_flops`) over ALL ranks at once (a rank's load counts
   every group it belongs to), greedily, largest first (LPT) or fewest candidate ranks first,
   whichever order ends with the lower maximum load:
   a. a block one rank holds whole stays there (no communication) while that rank's load stays
      under the mean load (total FLOPs / world size);
   b. any other block goes to the least loaded rank of its group (ties: the rank holding the
      largest piece), so a parameter's blocks spread over owners, and whole blocks leave ranks that
      hold more than their share (e.g. FSDP's torch.chunk leaving some ranks without experts).
   Without replica split every replica repeats this for its own copy; with replica split each block
   is computed by one replica and its result all-gathered over the replica axis.
   Speed (Kimi K2, 69k expert blocks on 2048 ranks): the greedy stays sequential, but the common
   blocks skip numpy: whole blocks of one-replica groups and blocks whose holders hold equal shares
   (experts split on a matrix dim) take their rank from lazy heaps, picking exactly what
   `_place_block` would (tests pin plans made before these fast paths).
4. Buckets: each rank's owned blocks, in (shape group, parameter, block) order, are cut every
   `bucket_mb`; bucket k is the union of every rank's k-th cut, so all ranks run the same bucket
   sequence and every group member issues the same collectives (empty pieces are zero-length splits).

Replica split at scale (Kimi K2, W = 1024..4096, dense dp_replicate = W / 8): "on" loses to "off" for
two reasons, measured with this planner.
  - FLOPs: the dense layer's three 7168 x 18432 matrices are WHOLE blocks of 22.6 TFLOP each (bf16,
    5 steps). Computed once, each exceeds the mean load at W = 4096 (11.7 TFLOP), and a block is the
    unit of NS work, so max/mean >= 22.6 / 11.7 = 1.94, which the plan reaches: inherent, not a
    balancing defect (at W <= 1024 "on" balances within 0.3%). "off" repeats the dense NS in every
    replica, which raises the mean (41 TFLOP at W = 4096) above the largest block.
  - Traffic: owners balance FLOPs only, but the replica all-gather makes every holder of a replica
    send its pieces of that replica's results to all R - 1 other replicas. Which replica computes
    how many bytes is left to the FLOPs greedy: at W = 1024 replica 0 computes 1.56 GB of dense
    results against a mean of 0.15 GB (it owns the big blocks), so its ranks send 28.6 GB across
    nodes (0.72 s at 40 GB/s) while every rank receives ~6.3 GB. A replica choice that also balances
    result bytes per replica would bound sends near the receives, except that one 7168 x 18432
    block alone is 264 MB (at W = 4096: 264 MB / 8 x 511 replicas = 16.9 GB sent per holder), so
    at large R splitting such blocks across replicas cannot pay; splitting only the small blocks
    (per parameter) is the direction. Not done yet: "auto" keeps "off" there.

Cost model (for replica_split="auto" and `describe`): a rank's step time is
  NS FLOPs / flops_per_s + max(sent, received) intra-node bytes / intra_node_bytes_per_s
                         + max(sent, received) inter-node bytes / inter_node_bytes_per_s,
nothing overlapped; the plan's estimate is the maximum over ranks. "auto" plans both ways and keeps
the cheaper.
"""

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from models.splits import MatrixSplit
from optim.newton_schulz import ns_flops
from optim.sharded_boxes import all_boxes, placement_kind
from optim.sharded_plan_stats import PlanStats, describe, plan_stats

REPLICA_SPLIT = ("auto", "on", "off")


@dataclass(frozen=True, eq=False)
class ParamSpec:
    """What the planner knows about one parameter; `mesh_ranks` is an int array of the mesh's shape."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: MatrixSplit
    mesh_ranks: np.ndarray
    mesh_dim_names: tuple[str, ...]
    placements: tuple


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    bucket_mb: float = 256.0  # NS input each rank owns per bucket
    replica_split: str = "auto"  # "auto" | "on" | "off": split NS work across HSDP replicas
    ns_dtype: torch.dtype | None = None  # dtype communicated and orthogonalized; None = parameter's
    ns_steps: int = 5
    ranks_per_node: int = 8  # for intra/inter-node traffic in the stats and the cost model
    flops_per_s: float = 400e12
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 40e9

    def __post_init__(self):
        if self.replica_split not in REPLICA_SPLIT:
            raise ValueError(f"replica_split={self.replica_split!r}: expected one of {REPLICA_SPLIT}")
        if self.bucket_mb <= 0 or self.ranks_per_node < 1:
            raise ValueError(f"bucket_mb={self.bucket_mb}, ranks_per_node={self.ranks_per_node}: must be positive")


@dataclass(eq=False)
class Pieces:
    """A block's pieces, CSR over blocks: pieces of block b are rows start[b]:start[b+1]."""

    start: np.ndarray  # [n_blocks + 1]
    shard: np.ndarray  # [P] shard position holding the piece
    box: np.ndarray  # [P, ndim, 2] piece box in parameter coordinates
    numel: np.ndarray  # [P]
    whole_on: np.ndarray  # [n_blocks] shard position holding the block whole, or -1


@dataclass(eq=False)
class ParamLayout:
    spec: ParamSpec
    groups: np.ndarray  # [R, S] global ranks: row r = replica r's communication group
    boxes: np.ndarray  # [S, ndim, 2] box of each shard position
    block_boxes: np.ndarray  # [n_blocks, ndim, 2]
    pieces: Pieces
    block_shape: tuple[int, int]  # (r, c) as the parameter stores a block
    flops: int  # NS FLOPs of one block
    nbytes: int  # bytes of one block in the NS dtype
    shape_group: int


@dataclass(eq=False)
class Plan:
    options: PlanOptions
    world_size: int
    params: list[ParamLayout]
    shape_groups: list[tuple[int, int, torch.dtype]]  # (short side, long side, NS dtype)
    replica_split: bool
    # one row per block instance (a block, or a block in one replica when each replica computes it)
    inst: dict[str, np.ndarray] = field(repr=False)  # param, block, replica, owner, bucket, flops
    num_buckets: int = 0
    stats: PlanStats | None = None

    def describe(self, max_rows: int = 16) -> str:
        """Readable summary: totals, shape groups, and a per-rank table (the most loaded ranks)."""
        return describe(self, max_rows)


def make_plan(specs: list[ParamSpec], world_size: int, options: PlanOptions = PlanOptions()) -> Plan:
    """Plan every Muon parameter in `specs` (see the module docstring)."""
    params, shape_groups = _layouts(specs, options)
    replicated = any(p.groups.shape[0] > 1 for p in params)
    choices = {"on": [True], "off": [False], "auto": [False, True] if replicated else [False]}
    plans = []
    for split in choices[options.replica_split]:
        inst = _assign(params, world_size, split)
        plan = Plan(options, world_size, params, shape_groups, split, inst)
        plan.num_buckets = _buckets(plan)
        plan.stats = plan_stats(plan)
        plans.append(plan)
    return min(plans, key=lambda p: p.stats.est_seconds)


# ---------------------------------------------------------------- geometry


def _layouts(specs, options):
    templates, shape_groups, interned, params = {}, {}, {}, []
    for spec in specs:
        mesh_shape = tuple(spec.mesh_ranks.shape)
        kinds = [placement_kind(p) for p in spec.placements]
        rep_axes = [a for a, k in enumerate(kinds) if k[0] == "replicate"]
        shard_axes = [a for a, k in enumerate(kinds) if k[0] != "replicate"]
        groups = np.transpose(spec.mesh_ranks, rep_axes + shard_axes).reshape(
            int(np.prod([mesh_shape[a] for a in rep_axes])), -1
        )
        groups = interned.setdefault((groups.shape, groups.tobytes()), groups)  # equal groups: one object
        key = (tuple(spec.shape), spec.split, tuple(spec.placements), mesh_shape)
        if key not in templates:
            boxes = all_boxes(spec.shape, mesh_shape, spec.placements)
            boxes = np.transpose(boxes, rep_axes + shard_axes + [len(mesh_shape), len(mesh_shape) + 1])
            boxes = boxes.reshape(groups.shape[0], groups.shape[1], len(spec.shape), 2)[0]
            block_boxes = _block_boxes(spec.split, tuple(spec.shape))
            templates[key] = (boxes, block_boxes, _pieces(block_boxes, boxes))
        boxes, block_boxes, pieces = templates[key]
        r, c = spec.split.block_shape(tuple(spec.shape))
        dtype = options.ns_dtype or spec.dtype
        sg = shape_groups.setdefault((min(r, c), max(r, c), dtype), len(shape_groups))
        nbytes = r * c * torch.empty((), dtype=dtype).element_size()
        params.append(
            ParamLayout(spec, groups, boxes, block_boxes, pieces, (r, c), ns_flops(r, c, options.ns_steps), nbytes, sg)
        )
    return params, list(shape_groups)


def _block_boxes(split: MatrixSplit, shape: tuple[int, ...]) -> np.ndarray:
    """[n_blocks, ndim, 2] box of each block in parameter coordinates."""
    n, (r, c) = split.num_blocks(shape), split.block_shape(shape)
    boxes = np.zeros((n, len(shape), 2), dtype=np.int64)
    boxes[..., 1] = shape
    i = np.arange(n)
    dim, size = {"rows": (0, r), "cols": (1, c), "experts": (0, 1), "whole": (0, shape[0])}[split.kind]
    boxes[:, dim, 0], boxes[:, dim, 1] = i * size, (i + 1) * size
    return boxes


def _pieces(block_boxes: np.ndarray, shard_boxes: np.ndarray) -> Pieces:
    lo = np.maximum(block_boxes[:, None, :, 0], shard_boxes[None, :, :, 0])
    hi = np.minimum(block_boxes[:, None, :, 1], shard_boxes[None, :, :, 1])
    blocks, shards = np.nonzero(np.all(hi > lo, axis=-1))  # row-major: grouped by block, shards ascending
    box = np.stack([lo[blocks, shards], hi[blocks, shards]], axis=-1)
    numel = np.prod(box[..., 1] - box[..., 0], axis=-1)
    counts = np.bincount(blocks, minlength=len(block_boxes))
    start = np.concatenate([[0], np.cumsum(counts)])
    block_numel = np.prod(block_boxes[:, :, 1] - block_boxes[:, :, 0], axis=-1)
    whole_on = np.full(len(block_boxes), -1, dtype=np.int64)
    single = (counts == 1) & (block_numel > 0)
    whole_on[single] = shards[start[:-1][single]]
    return Pieces(start, shards, box, numel, whole_on)


# ---------------------------------------------------------------- owners


def _assign(params, world_size, split):
    """Owner of every block instance (module docstring, step 3): a greedy pass in each of two
    orders, keeping the one with the lower maximum load (the second only if the first leaves a rank
    1% over the mean).

    Orders: fewest candidate ranks first, then largest (so blocks that may go anywhere in a wide
    group, like experts, fill what narrow groups left), and plain largest first (LPT). Without replica split
    a block has R instances, placed together: row r of its candidates is replica r's group.
    """
    reps = [1 if split else p.groups.shape[0] for p in params]
    n_blocks = [len(p.block_boxes) for p in params]
    cap = sum(p.flops * n * r for p, n, r in zip(params, n_blocks, reps)) / world_size
    width = [p.groups.size if split else p.groups.shape[1] for p in params]
    items = [(width[pi], -p.flops, pi, b) for pi, p in enumerate(params) for b in range(n_blocks[pi])]
    best = None
    for key in (lambda t: t[:2], lambda t: t[1]):  # sorts are stable: ties keep parameter/block order
        loads, owner, replica = _greedy(params, sorted(items, key=key), world_size, cap, split, reps)
        if best is None or loads.max() < best[0].max():
            best = loads, owner, replica
        if best[0].max() <= 1.01 * cap:  # balanced within 1%: skip the other order
            break
    _, owner, replica = best
    inst = {
        "param": _cat([np.full(n * r, pi) for pi, (n, r) in enumerate(zip(n_blocks, reps))]),
        "block": _cat([np.repeat(np.arange(n), r) for n, r in zip(n_blocks, reps)]),
        "replica": _cat([r.ravel() for r in replica]),
        "owner": _cat([o.ravel() for o in owner]),
    }
    inst["flops"] = np.array([p.flops for p in params], dtype=np.float64)[inst["param"]]
    return inst


def _greedy(params, items, world_size, cap, split, reps):
    loads = np.zeros(world_size)
    owner = [np.full((len(p.block_boxes), r), -1) for p, r in zip(params, reps)]
    replica = [np.tile(np.arange(r), (len(p.block_boxes), 1)) for p, r in zip(params, reps)]
    held, whole_on, shares, heaps, share_heaps = {}, {}, {}, {}, {}  # per piece template / per group
    for _, _, pi, b in items:
        p = params[pi]
        if id(p.pieces) not in held:
            held[id(p.pieces)] = _held_fraction(p, split)
            whole_on[id(p.pieces)] = p.pieces.whole_on.tolist()
            shares[id(p.pieces)] = _equal_shares(held[id(p.pieces)])
        whole = whole_on[id(p.pieces)][b]
        if whole >= 0 and p.groups.shape[0] == 1:  # fast path (whole experts): one candidate row
            own = int(p.groups[0, whole])
            if loads[own] + p.flops > cap:
                own = _least_loaded(heaps, p.groups, loads, own)
            owner[pi][b, 0] = own
            loads[own] += p.flops
            if id(p.groups) in heaps:
                heapq.heappush(heaps[id(p.groups)], (loads[own], own))
            continue
        masks, pattern, share = shares[id(p.pieces)]
        if whole < 0 and p.groups.shape[0] == 1 and pattern[b] >= 0:  # fast path (split experts)
            own = _least_loaded_equal(share_heaps, p, masks, pattern[b], share[b], loads)
            if own is not None:
                owner[pi][b, 0] = own
                continue
        own, rep = _place_block(p, b, loads, cap, split, held[id(p.pieces)][b])
        owner[pi][b], replica[pi][b] = own, rep
        loads[own] += p.flops  # owners of one block's replica instances are distinct ranks
    return loads, owner, replica


def _least_loaded(heaps, groups, loads, holder) -> int:
    """argmin of loads over `groups[0]` (lowest rank on ties, the holder first), via a lazy heap.

    Loads only grow, so a heap entry's load is never above the rank's current load: an entry that
    is current when popped is a true minimum; a stale one is refreshed and pushed back.
    """
    heap = heaps.get(id(groups))  # keyed by the (interned, long-lived) group array
    if heap is None:
        heap = heaps[id(groups)] = [(loads[r], int(r)) for r in groups[0]]
        heapq.heapify(heap)
    while heap[0][0] != loads[heap[0][1]]:
        _, r = heapq.heappop(heap)
        heapq.heappush(heap, (loads[r], r))
    return holder if loads[holder] <= heap[0][0] else heap[0][1]


def _equal_shares(held):
    """Blocks whose holders hold equal shares: (distinct holder masks [S] with a bytes key, each
    block's mask index or -1 where shares differ, each block's share)."""
    share = held.max(axis=1)
    equal = ((held == 0) | (held == share[:, None])).all(axis=1)
    packed = np.ascontiguousarray(np.packbits(held > 0, axis=1))
    _, first, pattern = np.unique(packed.view(np.dtype((np.void, packed.shape[1]))).ravel(),
                                  return_index=True, return_inverse=True)
    masks = [(held[i] > 0, packed[i].tobytes()) for i in first]  # bytes: the key of the mask's heap
    return masks, np.where(equal, pattern.ravel(), -1).tolist(), share.tolist()


def _least_loaded_equal(heaps, p, masks, k, share, loads) -> int | None:
    """`_place_block` for a block of a one-replica group whose holders (mask k) hold equal shares,
    via lazy heaps over the whole row and over the holders; adds the block's FLOPs to the chosen
    rank's load.

    `_place_block` picks argmin(load - 1e-9 * flops * held), first position on ties. Loads are
    integers (sums of integer FLOPs); below 2**51 they stay distinct after the equal term is taken
    off, so among holders the pick is the least loaded (first position on ties), and so it is among
    the others, whose term is 0: the row's minimum when that is not a holder (else a holder wins).
    The two are compared with `_place_block`'s own arithmetic. None (caller falls back) above 2**51.
    """
    ranks, (mask, mask_key) = p.groups[0], masks[k]
    row_key, holder_key = (id(p.groups), b"row"), (id(p.groups), mask_key)
    low = _heap_top(heaps, row_key, ranks, None, loads)
    best = _heap_top(heaps, holder_key, ranks, mask, loads) if share > 0 and not mask[low[1]] else None
    if low[0] >= 2.0**51 or (best is not None and best[0] >= 2.0**51):
        return None
    pos = low[1]
    if best is not None:
        pos = min((best[0] - 1e-9 * p.flops * share, best[1]), (low[0] - 1e-9 * p.flops * 0.0, low[1]))[1]
    own = int(ranks[pos])
    loads[own] += p.flops
    for key in (row_key, holder_key):  # refresh the chosen rank where it is on top; elsewhere lazily
        heap = heaps.get(key)
        if heap and heap[0][1] == pos:
            heapq.heapreplace(heap, (loads[own], pos))
    return own


def _heap_top(heaps, key, ranks, member, loads):
    """(load, position) of the least loaded rank of ranks[member] (all when None; first position on
    ties), or None when there is none.

    A lazy heap, one entry per rank: loads only grow, so an entry is never above its rank's load;
    a current top entry is the true minimum, a stale one is refreshed in place.
    """
    heap = heaps.get(key)
    if heap is None:
        member = np.ones(len(ranks), dtype=bool) if member is None else member
        heap = heaps[key] = [(loads[r], int(i)) for i, r in zip(np.nonzero(member)[0], ranks[member])]
        heapq.heapify(heap)
    if not heap:
        return None
    while heap[0][0] != loads[ranks[heap[0][1]]]:
        heapq.heapreplace(heap, (loads[ranks[heap[0][1]]], heap[0][1]))
    return heap[0]


def _cat(arrays) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)


def _held_fraction(p, split):
    R, S = p.groups.shape
    out = np.zeros((len(p.block_boxes), S))
    blocks = np.repeat(np.arange(len(p.block_boxes)), np.diff(p.pieces.start))
    total = np.maximum(1, np.bincount(blocks, weights=p.pieces.numel, minlength=len(out)))
    out[blocks, p.pieces.shard] = p.pieces.numel / total[blocks]
    return np.tile(out, (1, R)) if split else out


def _place_block(p, b, loads, cap, split, held):
    """Owners (one per candidate row) and replicas of block b.

    Candidate rows: each replica's group (no replica split), or all replicas' ranks as one row.
    A block held whole goes to its holder (across replicas: the least loaded holder) while the
    holder stays under `cap` (the mean load); anything else goes to the least loaded candidate,
    ties to the rank holding the largest piece.
    """
    R, S = p.groups.shape
    whole = p.pieces.whole_on[b]
    cands = p.groups.reshape(1, -1) if split else p.groups  # [rows, candidates]
    rows = np.arange(len(cands))
    load = loads[cands]
    pick = np.argmin(load - 1e-9 * p.flops * held, axis=1)
    if whole >= 0 and R > 1:
        holder = (whole + np.argmin(load[:, whole::S], axis=1) * S) if split else np.full(R, whole)
        pick = np.where(load[rows, holder] + p.flops <= cap, holder, pick)
    return cands[rows, pick], (pick // S if split else rows)


# ---------------------------------------------------------------- buckets


def _buckets(plan: Plan) -> int:
    """Step 4: cut each rank's owned blocks every bucket_mb; sort instances into the global order."""
    inst, params = plan.inst, plan.params
    nbytes = np.array([p.nbytes for p in params])[inst["param"]]
    sg = np.array([p.shape_group for p in params])[inst["param"]]
    order = _lexsort(inst["owner"], sg, inst["param"], inst["block"], inst["replica"])
    owner_sorted, bytes_sorted = inst["owner"][order], nbytes[order]
    cum = np.cumsum(bytes_sorted)
    first = np.searchsorted(owner_sorted, owner_sorted)  # first row of each owner's run
    offset = cum - bytes_sorted - (cum[first] - bytes_sorted[first])
    bucket = np.empty(len(order), dtype=np.int64)
    bucket[order] = offset // max(1, int(plan.options.bucket_mb * 2**20))
    inst["bucket"] = bucket
    canon = _lexsort(bucket, sg, inst["param"], inst["block"], inst["replica"])
    for k in list(inst):
        inst[k] = inst[k][canon]
    return int(bucket.max()) + 1 if len(bucket) else 0


def _lexsort(*keys) -> np.ndarray:
    """`np.lexsort(keys[::-1])` (first key most significant) for non-negative int keys, as one stable
    sort of a mixed-radix int64 key (5x faster on a million instances)."""
    radix = [int(k.max()) + 1 if len(k) else 1 for k in keys]
    if np.prod(np.array(radix, dtype=np.float64)) >= 2.0**62:
        return np.lexsort(keys[::-1])
    combined = np.zeros(len(keys[0]), dtype=np.int64)
    for k, n in zip(keys, radix):
        combined = combined * n + k
    return np.argsort(combined, kind="stable")
