"""Sharded Muon's plan: which rank orthogonalizes which block, and in which bucket. Pure: no process
group calls, so a 1T-parameter model on 2048 ranks plans on a laptop in seconds.

Input: one `ParamSpec` per Muon parameter (global shape, dtype, `MatrixSplit`, the global ranks of
its DTensor mesh, its placements). Every rank computes the same plan from the same specs.

1. Geometry. Mesh axes with Replicate placements are replica axes (R replicas); the others shard
   (S shard positions). A replica's "communication group" is its S ranks. Each shard position holds a
   box of the parameter (see `models/boxes.py`); a block's pieces are its intersections with
   the boxes. Parameters of equal shape, split, mesh shape and placements share one piece template.
2. Shape groups: blocks with equal (short side, long side, NS dtype), across parameters and layers,
   are orthogonalized in one batched call per bucket; tall blocks join transposed (Newton-Schulz
   commutes with transposition and `orthogonalize` itself works on the wide orientation), so an
   expert's w2 [D, F] batches with its w1 and w3 blocks [F, D] (of the fused w13 [E, 2F, D]).
3. Owners (optim/planner/owners.py), balancing estimated NS FLOPs (`ns_flops`) over ALL ranks at once (a rank's load counts
   every group it belongs to), greedily, largest first (LPT) or fewest candidate ranks first,
   whichever order ends with the lower maximum load:
   a. a block one rank holds whole stays there (no communication) while that rank's load stays
      under the mean load (total FLOPs / world size);
   b. any other block goes to the least loaded rank of its group (ties: the rank holding the
      largest piece), so a parameter's blocks spread over owners, and whole blocks leave ranks that
      hold more than their share (e.g. FSDP's torch.chunk leaving some ranks without experts).
   A parameter not split across replicas (`ParamLayout.split` False) has every replica repeat this
   for its own copy; for a split one each block is computed by one replica and its result
   all-gathered over the replica axis: per replica group, an all-to-all moves every member's results
   into R equal chunks, then an all-gather of the chunks (a ring on NCCL; optim/sharded/schedule.py).
   Each member then sends and receives about (R - 1) / R of its shard position's results, whichever
   replica computed them, so the (replica, owner) of a split block is chosen by FLOPs alone, among
   every replica's ranks (rules a and b with the replica groups as one candidate row).
   Speed (Kimi K2, 69k expert blocks and 12k dense blocks x 512 replicas at W = 4096): the greedy stays
   sequential, but the common blocks skip numpy: whole blocks of one-replica groups take their rank
   from lazy heaps; a run of consecutive blocks with the same groups, split and FLOPs, held in
   pieces with equal shares (experts split on a matrix dim, whatever their holders), is placed by
   one loop over a list of the loads and lazy heaps (`planner.runs._fill_row`); a block repeated in
   replicas whose rows hold equal loads is placed in row 0 for all, and in all rows at once by
   numpy when the rows differ (`planner.owners._place_rows`: the per-head attention blocks after a
   mixed replica split); each picks exactly what
   `_place_block` would (tests pin plans made before these fast paths and compare them with
   `_place_block` and a plain argmin loop); "auto" buckets only the plan it keeps.
4. Buckets: each rank's owned blocks, in (shape group, parameter, block) order, are cut every
   `bucket_mb`; bucket k is the union of every rank's k-th cut, so all ranks run the same bucket
   sequence and every group member issues the same collectives (empty pieces are zero-length splits).

Replica split: repeating a block's NS in each of R replicas costs R x its FLOPs; splitting costs one
computation and (R - 1) x its bytes received over the replica groups (the ring). Per block the split
pays when its NS takes longer than its bytes cross the replica axis' link (`_split_pays`): on Kimi K2
(H200 numbers: 600 TFLOP/s, 40 GB/s between nodes, bf16) the dense FFN's 7168 x 18432 blocks (22.6
TFLOP in 5 standard steps against 264 MB) and the shared experts' 2048 x 7168 blocks (0.69 TFLOP
against 29 MB), not the per-head attention blocks. The largest dense block bounds the max load once
computed once: at W = 4096 a 7168 x 18432 block exceeds the mean. "auto" compares "off", "on" and
this mixed split with the cost model below; benchmarks/projection.py reports which one it keeps.
Mixed plans: the split is per parameter (`ParamLayout.split`, read by the owners, the stats and the
schedule).

Cost model (for replica_split="auto" and `describe`): a rank's step time is
  NS FLOPs / flops_per_s + max(sent, received) intra-node bytes / intra_node_bytes_per_s
                         + max(sent, received) inter-node bytes / inter_node_bytes_per_s,
nothing overlapped, with the replica all-gather's bytes as the ring and the all-to-all into its
chunks move them (`planner.stats._replica_gather`); the plan's estimate is the maximum over
ranks (`est_overlapped`: the same with the three terms overlapped, the max of them instead of the
sum). The bucket pipeline overlaps between the two, so "auto" plans "off", "on" and the mixed split, and keeps a later one only when
it is cheaper than the one kept under both.
"""

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from models.boxes import all_boxes, placement_kind
from models.splits import MatrixSplit
from optim.newton_schulz import NS_METHODS, ns_flops
from optim.planner.owners import assign
from optim.planner.stats import PlanStats, describe, plan_stats

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
    ns_method: str = "standard"  # "standard" | "gram": what `orthogonalize` runs (FLOPs counted for it)
    ranks_per_node: int = 8  # for intra/inter-node traffic in the stats and the cost model
    prefer_holders: bool = False  # a block held in pieces goes to its least loaded holder while under the mean load
    flops_per_s: float = 400e12
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 40e9

    def __post_init__(self):
        if self.replica_split not in REPLICA_SPLIT:
            raise ValueError(f"replica_split={self.replica_split!r}: expected one of {REPLICA_SPLIT}")
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"ns_method={self.ns_method!r}: expected one of {NS_METHODS}")
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
    split: bool = False  # replica split: each block computed by one replica, its result all-gathered


@dataclass(eq=False)
class Plan:
    options: PlanOptions
    world_size: int
    params: list[ParamLayout]
    shape_groups: list[tuple[int, int, torch.dtype]]  # (short side, long side, NS dtype)
    replica_split: bool | str  # True: every replicated parameter split, False: none, "mixed": some
    # one row per block instance (a block, or a block in one replica when each replica computes it)
    inst: dict[str, np.ndarray] = field(repr=False)  # param, block, replica, owner, bucket, flops
    num_buckets: int = 0
    stats: PlanStats | None = None

    def describe(self, max_rows: int = 16) -> str:
        """Readable summary: totals, shape groups, and a per-rank table (the most loaded ranks)."""
        return describe(self, max_rows)


def make_plan(specs: list[ParamSpec], world_size: int, options: PlanOptions = PlanOptions(),
              split: set[str] | None = None) -> Plan:
    """Plan every Muon parameter in `specs` (see the module docstring). `split`: names of the
    parameters to split across replicas, overriding `options.replica_split` (tests, experiments)."""
    layouts, shape_groups = _layouts(specs, options)
    byte_flops = _byte_flops(layouts, options)
    replicated = [p.groups.shape[0] > 1 for p in layouts]
    none = [False] * len(layouts)
    if split is not None:
        chosen = [r and p.spec.name in split for p, r in zip(layouts, replicated)]
        kind = "mixed" if chosen not in (none, replicated) else any(chosen)
        return _bucketed(_plan(layouts, shape_groups, world_size, options, kind, chosen))
    mixed = _split_pays(layouts, byte_flops)
    candidates = {"off": [(False, none)], "on": [(True, replicated)], "auto": [(False, none)]}
    if options.replica_split == "auto" and any(replicated):  # after "off": "on", then mixed if it differs
        candidates["auto"] += [(True, replicated)] + ([("mixed", mixed)] if mixed not in (none, replicated) else [])
    best, cache = None, {}  # the stats' per-template arrays, shared by the candidates
    for kind, chosen in candidates[options.replica_split]:
        plan = _plan(layouts, shape_groups, world_size, options, kind, chosen, cache)
        if best is None or _cheaper(plan.stats, best.stats):
            best = plan
    return _bucketed(best)


def _plan(layouts, shape_groups, world_size, options, kind, split, cache=None) -> Plan:
    """The plan (owners and stats, no buckets yet) with parameter i split across replicas where
    split[i] (`kind`: Plan.replica_split)."""
    params = [replace(p, split=True) if s else p for p, s in zip(layouts, split)]
    inst = assign(params, world_size, options.prefer_holders)
    plan = Plan(options, world_size, params, shape_groups, kind, inst)
    plan.stats = plan_stats(plan, cache)  # independent of the instances' order: integer byte and FLOP sums
    return plan


def _bucketed(plan: Plan) -> Plan:
    plan.num_buckets = _buckets(plan)
    return plan


def _split_pays(params, byte_flops) -> list[bool]:
    """Per parameter, the "auto" rule for a mixed plan: split across replicas when the NS of a block
    takes longer than its all-gather's bytes (both in FLOP-equivalents, `byte_flops`). Per block,
    splitting saves R - 1 of its R computations, and the ring all-gather makes R - 1 of the R
    members of each replica group receive their piece of the result: (R - 1) x block bytes in all."""
    return [p.groups.shape[0] > 1 and p.flops > p.nbytes * bf for p, bf in zip(params, byte_flops)]


def _cheaper(a: PlanStats, b: PlanStats) -> bool:
    """Whether plan a beats plan b with and without overlap (how much the pipeline overlaps is
    between the two; at Kimi K2 W = 256 they disagree on replica split, and "off" is the safer)."""
    return a.est_seconds < b.est_seconds and a.est_overlapped < b.est_overlapped


def _byte_flops(params, options) -> list[float]:
    """Per parameter: NS FLOPs that take as long as one byte of its replica all-gather (inter-node
    bandwidth when the replica axis crosses nodes)."""
    out = []
    for p in params:
        nodes = p.groups // options.ranks_per_node
        crosses = bool((nodes != nodes[:1]).any())
        bw = options.inter_node_bytes_per_s if crosses else options.intra_node_bytes_per_s
        out.append(options.flops_per_s / bw)
    return out


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
        flops = ns_flops(r, c, options.ns_steps, options.ns_method, dtype)
        params.append(ParamLayout(spec, groups, boxes, block_boxes, pieces, (r, c), flops, nbytes, sg))
    return params, list(shape_groups)


def _block_boxes(split: MatrixSplit, shape: tuple[int, ...]) -> np.ndarray:
    """[n_blocks, ndim, 2] box of each block in parameter coordinates."""
    return split.block_boxes(shape)


def _pieces(block_boxes: np.ndarray, shard_boxes: np.ndarray) -> Pieces:
    """Each block's intersections with the shard boxes: a [blocks, shards] boolean per dim (the
    two intervals overlap, both non-empty), the boxes only where every dim overlaps."""
    hit = np.ones((len(block_boxes), len(shard_boxes)), dtype=bool)
    for d in range(block_boxes.shape[1]):
        (blo, bhi), (slo, shi) = block_boxes[:, d].T, shard_boxes[:, d].T
        hit &= (bhi[:, None] > slo[None, :]) & (shi[None, :] > blo[:, None])
        hit &= (bhi > blo)[:, None] & (shi > slo)[None, :]
    blocks, shards = np.nonzero(hit)  # row-major: grouped by block, shards ascending
    lo = np.maximum(block_boxes[blocks, :, 0], shard_boxes[shards, :, 0])
    hi = np.minimum(block_boxes[blocks, :, 1], shard_boxes[shards, :, 1])
    box = np.stack([lo, hi], axis=-1)
    numel = np.prod(box[..., 1] - box[..., 0], axis=-1)
    counts = np.bincount(blocks, minlength=len(block_boxes))
    start = np.concatenate([[0], np.cumsum(counts)])
    block_numel = np.prod(block_boxes[:, :, 1] - block_boxes[:, :, 0], axis=-1)
    whole_on = np.full(len(block_boxes), -1, dtype=np.int64)
    single = (counts == 1) & (block_numel > 0)
    whole_on[single] = shards[start[:-1][single]]
    return Pieces(start, shards, box, numel, whole_on)


# ---------------------------------------------------------------- buckets


def _buckets(plan: Plan) -> int:
    """Step 4: cut each rank's owned blocks every bucket_mb; sort instances into the global order
    (bucket, shape group, parameter, block, replica).

    A rank's blocks in (shape group, parameter, block, replica) order: `assign` lists instances in
    (parameter, block, replica) order, so an instance's byte offset among its owner's is the bytes of
    the (owner, parameter) segments before its own (a [world, params] table) plus its rank inside its
    segment, which only the few segments that straddle a bucket boundary need. The global order is a
    stable sort of the instances by (bucket, shape group): a radix sort; the permuted arrays reuse
    one buffer (at W = 4096 each is 6.1 M instances: fresh memory is page faults)."""
    inst, params = plan.inst, plan.params
    sg_of = np.array([p.shape_group for p in params], dtype=np.int64)
    by_col = np.argsort(sg_of, kind="stable")  # parameters in (shape group, parameter) order
    col = np.empty(len(params), dtype=np.int64)
    col[by_col] = np.arange(len(params))
    nbytes = np.array([p.nbytes for p in params], dtype=np.int64)[by_col]
    seg = inst["owner"] * len(params) + col[inst["param"]]  # (owner, column)
    seg_bytes = np.bincount(seg, minlength=plan.world_size * len(params)) * np.tile(nbytes, plan.world_size)
    start = (np.cumsum(seg_bytes.reshape(plan.world_size, -1), axis=1).ravel() - seg_bytes)  # bytes before
    size = max(1, int(plan.options.bucket_mb * 2**20))
    straddles = start // size < (start + seg_bytes - np.tile(nbytes, plan.world_size)) // size
    bucket = (start // size)[seg]
    at = np.flatnonzero(straddles[seg])  # instances of segments across a boundary, in instance order
    if len(at):
        bucket[at] = (start[seg[at]] + _rank_in_group(seg[at]) * nbytes[seg[at] % len(params)]) // size
    inst["bucket"] = bucket
    key = sg_of[inst["param"]]  # (bucket, shape group); a stable sort keeps (parameter, block, replica) inside
    key += bucket * len(plan.shape_groups)
    canon = _stable_argsort(key)
    del key
    n_buckets = int(bucket.max()) + 1 if len(bucket) else 0
    scratch = np.empty(len(canon), dtype=np.int64)  # one buffer for the permuted arrays (all 8-byte)
    for k in list(inst):
        out = scratch.view(inst[k].dtype)
        np.take(inst[k], canon, out=out, mode="clip")  # "raise" would buffer: a fresh array each
        inst[k], scratch = out, inst[k].view(np.int64)  # the old array is the next one's buffer
    return n_buckets


def _rank_in_group(key: np.ndarray) -> np.ndarray:
    """How many earlier entries of `key` equal each entry."""
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    first = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
    out = np.empty(len(key), dtype=np.int64)
    out[order] = np.arange(len(key)) - np.repeat(first, np.diff(np.r_[first, len(key)]))
    return out


def _stable_argsort(key: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative ints; numpy radix-sorts 16-bit keys (7x faster on millions)."""
    if len(key) and int(key.max()) < 2**16:
        key = key.astype(np.uint16)
    return np.argsort(key, kind="stable")
