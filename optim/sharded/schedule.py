"""One rank's view of a sharded-Muon plan: per bucket, what it packs, sends, assembles, computes,
returns and applies. Pure (numpy and slices); built once at optimizer construction.

Vocabulary: a "held" piece is a piece of a block inside one of this rank's local shards (the update
of that piece is applied here); an "owned" piece is a piece of a block this rank orthogonalizes.
A piece this rank both holds and owns is a copy (no communication).

Buffer order, identical on both ends of every collective: forward all-to-all segments by group
member (destination on the sender, source on the receiver), inside a segment by (instance, piece)
in the plan's canonical order; the return all-to-all is the same exchange with roles swapped.
Replica all-gather (for each parameter split across replicas, `ParamLayout.split`), per replica group
and bucket: each member's segment is its replica's results at its shard position, ordered by
(instance, piece); the segments, members in group order, are laid end to end (T elements) and cut
into R equal chunks of ceil(T / R); an uneven all-to-all moves every segment into the chunks, and
an all-gather of the chunks (a ring on NCCL) gives every member all segments: each member sends and
receives about (R - 1) T / R, however unevenly the replicas computed, instead of a holder sending
its segment R - 1 times. The pieces of parameters each replica computes itself (not split) never
enter it, even when they share the bucket and the replica group.
"""

from dataclasses import dataclass, field

import numpy as np

from optim.planner.stats import instances_by_param, param_pieces


@dataclass
class Held:
    param: int  # index into plan.params
    local: tuple[slice, ...]  # in this rank's local shard
    shape: tuple[int, ...]


@dataclass
class Owned:
    batch: int  # index into Bucket.batches
    pos: int  # block position in the batch
    block: tuple[slice, slice]  # in the block [r, c] as the parameter stores it


@dataclass
class Batch:
    shape_group: int
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (param, block) per position


@dataclass
class Exchange:
    """One collective in one group: forward sends held -> owners; return is the reverse."""

    group: tuple[int, ...]  # sorted global ranks
    send_sizes: list[int]  # elements per member
    recv_sizes: list[int]
    sends: list[int]  # Held indices in buffer order
    recvs: list[int]  # Owned indices in buffer order


@dataclass
class Gather:
    """One replica all-gather in one group (module docstring): my segment, the others' in buffer order."""

    group: tuple[int, ...]  # sorted global ranks
    segments: list[int]  # elements of each member's segment
    me: int  # my position in the group
    sends: list[int]  # Held indices of my segment, in order
    recvs: list[int]  # Held indices of the other members' segments, members in group order

    @property
    def chunk(self) -> int:
        return -(-sum(self.segments) // len(self.group))

    def balance_sizes(self) -> tuple[list[int], list[int]]:
        """(send, recv) elements per member of the all-to-all that moves the segments into the
        chunks: what of my segment falls in each member's chunk, and of each segment in mine."""
        q, starts = self.chunk, np.cumsum([0] + self.segments)
        return ([_overlap(starts[self.me], starts[self.me + 1], j * q, (j + 1) * q) for j in range(len(self.group))],
                [_overlap(starts[i], starts[i + 1], self.me * q, (self.me + 1) * q) for i in range(len(self.group))])


def _overlap(lo, hi, lo2, hi2) -> int:
    return int(max(0, min(hi, hi2) - max(lo, lo2)))


@dataclass
class Bucket:
    held: list[Held] = field(default_factory=list)
    owned: list[Owned] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (held, owned)
    exchanges: list[Exchange] = field(default_factory=list)  # all-to-all, forward direction
    gathers: list[Gather] = field(default_factory=list)  # replica all-gather


def group_keys(plan) -> tuple[list[tuple[int, ...]], list[np.ndarray], list[np.ndarray]]:
    """Sorted list of every group's sorted ranks; per param: id of each replica's communication
    group [R] and of each shard position's replica group [S]."""
    distinct = {id(p.groups): p.groups for p in plan.params}  # the planner shares equal group arrays
    comm = {i: [tuple(sorted(row.tolist())) for row in g] for i, g in distinct.items()}
    rep = {i: [tuple(sorted(col.tolist())) for col in g.T] for i, g in distinct.items()}
    keys = sorted({k for ks in list(comm.values()) + list(rep.values()) for k in ks})
    index = {k: i for i, k in enumerate(keys)}
    comm_id = {i: np.array([index[k] for k in ks]) for i, ks in comm.items()}
    rep_id = {i: np.array([index[k] for k in ks]) for i, ks in rep.items()}
    return keys, [comm_id[id(p.groups)] for p in plan.params], [rep_id[id(p.groups)] for p in plan.params]


def collectives(plan) -> list[list[tuple[str, int]]]:
    """Per bucket, the collectives that exist anywhere: ("a2a" | "gather", group id), sorted.
    Every member of a listed group issues it, with empty splits when it has nothing to move."""
    keys, comm_id, rep_id = group_keys(plan)
    found = set()
    for pi, idx in enumerate(instances_by_param(plan)):
        p, rows = plan.params[pi], param_pieces(plan, pi, idx)
        bucket = plan.inst["bucket"][rows["inst"]]
        replica = plan.inst["replica"][rows["inst"]]
        moving = rows["holder"] != rows["owner"]
        found |= {("a2a", int(k), int(g)) for k, g in set(zip(bucket[moving], comm_id[pi][replica[moving]]))}
        if p.split and p.groups.shape[0] > 1:
            found |= {("gather", int(k), int(g)) for k, g in set(zip(bucket, rep_id[pi][rows["shard"]]))}
    out = [[] for _ in range(plan.num_buckets)]
    for kind, k, g in sorted(found, key=lambda t: (t[1], t[0], t[2])):
        out[k].append((kind, g))
    return out


def rank_schedule(plan, me: int, listed=None) -> list[Bucket]:
    """The buckets as rank `me` runs them (`listed`: `collectives(plan)` if already computed)."""
    keys, comm_id, rep_id = group_keys(plan)
    buckets = [Bucket() for _ in range(plan.num_buckets)]
    mine = _my_rows(plan, me, comm_id, rep_id)
    held_at, owned_at = {}, {}
    for row in sorted(mine, key=lambda r: (r["inst"], r["piece"])):
        b = buckets[row["bucket"]]
        if row["held"]:
            held_at[row["id"]] = len(b.held)
            b.held.append(Held(row["param"], row["local"], row["shape"]))
        if row["owner"] == me:
            owned_at[row["id"]] = len(b.owned)
            b.owned.append(Owned(*_batch_slot(plan, b, row), row["block"]))
        if row["held"] and row["owner"] == me:
            b.copies.append((held_at[row["id"]], owned_at[row["id"]]))
    for k, in_bucket in enumerate(collectives(plan) if listed is None else listed):
        for kind, g in in_bucket:
            if me not in keys[g]:
                continue
            rows = [r for r in mine if r["bucket"] == k and r[kind] == g]
            make = _exchange if kind == "a2a" else _gather
            target = buckets[k].exchanges if kind == "a2a" else buckets[k].gathers
            target.append(make(keys[g], rows, me, held_at, owned_at))
    return buckets


def _my_rows(plan, me, comm_id, rep_id) -> list[dict]:
    """Every piece this rank holds (in the replica computing it, or receives by all-gather) or owns."""
    out = []
    for pi, idx in enumerate(instances_by_param(plan)):
        p = plan.params[pi]
        where = np.argwhere(p.groups == me)
        if len(where) == 0:
            continue
        my_rep, my_shard = (int(v) for v in where[0])
        rows = param_pieces(plan, pi, idx)
        replica = plan.inst["replica"][rows["inst"]]
        at_mine = rows["shard"] == my_shard
        held = at_mine & ((replica == my_rep) | p.split)
        for j in np.nonzero(held | (rows["owner"] == me))[0]:
            out.append(_row(plan, p, pi, rows, j, my_rep, my_shard, bool(held[j]), comm_id, rep_id))
    return out


def _row(plan, p, pi, rows, j, my_rep, my_shard, held, comm_id, rep_id) -> dict:
    inst, piece = int(rows["inst"][j]), int(rows["piece"][j])
    replica = int(plan.inst["replica"][inst])
    box = p.pieces.box[piece]  # [ndim, 2] in parameter coordinates
    block_lo = p.block_boxes[plan.inst["block"][inst], :, 0]
    block = tuple(slice(int(lo - o), int(hi - o)) for (lo, hi), o in zip(box, block_lo))
    local = tuple(slice(int(lo - o), int(hi - o)) for (lo, hi), o in zip(box, p.boxes[my_shard, :, 0]))
    return dict(
        id=(inst, piece), inst=inst, piece=piece, param=pi, bucket=int(plan.inst["bucket"][inst]),
        held=held, owner=int(rows["owner"][j]), holder=int(rows["holder"][j]),
        source=int(p.groups[replica, my_shard]),  # who has this piece's result in the computing replica
        gathered=held and replica != my_rep,
        a2a=int(comm_id[pi][replica]),
        gather=int(rep_id[pi][my_shard]) if p.split and p.groups.shape[0] > 1 else -1,  # split params only
        local=local, block=block[-2:], shape=tuple(int(hi - lo) for lo, hi in box),
        numel=int(rows["numel"][j]),
    )


def _batch_slot(plan, bucket: Bucket, row) -> tuple[int, int]:
    """(batch, position) of the row's block in the bucket, appending batch/block on first sight."""
    sg = plan.params[row["param"]].shape_group
    key = (row["param"], int(plan.inst["block"][row["inst"]]))
    for bi, batch in enumerate(bucket.batches):
        if batch.shape_group == sg:
            if not batch.blocks or batch.blocks[-1] != key:
                batch.blocks.append(key)
            return bi, len(batch.blocks) - 1
    bucket.batches.append(Batch(sg, [key]))
    return len(bucket.batches) - 1, 0


def _exchange(group, rows, me, held_at, owned_at) -> Exchange:
    pos = {r: i for i, r in enumerate(group)}
    sends = [r for r in rows if r["held"] and not r["gathered"] and r["owner"] != me]
    recvs = [r for r in rows if r["owner"] == me and r["holder"] != me]
    sends.sort(key=lambda r: pos[r["owner"]])  # stable: keeps (instance, piece) order inside
    recvs.sort(key=lambda r: pos[r["holder"]])
    return Exchange(
        group, _sizes(sends, "owner", pos), _sizes(recvs, "holder", pos),
        [held_at[r["id"]] for r in sends], [owned_at[r["id"]] for r in recvs],
    )


def _gather(group, rows, me, held_at, owned_at) -> Gather:
    pos = {r: i for i, r in enumerate(group)}
    sends = [r for r in rows if r["held"] and not r["gathered"]]
    recvs = sorted((r for r in rows if r["gathered"]), key=lambda r: pos[r["source"]])
    segments = _sizes(recvs, "source", pos)
    segments[pos[me]] = sum(r["numel"] for r in sends)
    return Gather(group, segments, pos[me], [held_at[r["id"]] for r in sends], [held_at[r["id"]] for r in recvs])


def _sizes(rows, who, pos) -> list[int]:
    sizes = [0] * len(pos)
    for r in rows:
        sizes[pos[r[who]]] += r["numel"]
    return sizes
