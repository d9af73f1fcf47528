"""What a sharded-Muon plan costs, per rank: blocks and NS FLOPs owned, bytes sent and received
(intra- vs inter-node), the communication-free shape groups, max/mean load, and the cost estimate
of the module docstring of `optim/planner/plan.py`, summed and overlapped. Pure numpy over the plan's arrays.

Traffic counted per step, both directions: a piece whose holder is not its block's owner crosses
once to the owner (forward all-to-all) and once back (return all-to-all); for a parameter split across
replicas (`ParamLayout.split`), every piece of a result also reaches the same shard position in each
other replica, by a balancing all-to-all and a ring all-gather over the replica group (`_replica_gather`).
"""

from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class PlanStats:
    blocks: np.ndarray  # [world] block instances owned
    flops: np.ndarray  # [world] NS FLOPs owned
    sent_intra: np.ndarray  # [world] bytes
    sent_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    comm_free_groups: list[int]  # shape-group indices needing no communication at all
    load_ratio: float  # max / mean NS FLOPs over ranks
    est_seconds: float  # cost model, max over ranks
    est_overlapped: float  # the same with NS, intra- and inter-node traffic fully overlapped


def param_pieces(plan, pi: int, idx: np.ndarray) -> dict[str, np.ndarray]:
    """One row per (instance, piece) of parameter `pi`'s instances `idx` (in `idx` order, then piece
    order): inst, piece (row in the param's Pieces), shard, holder, owner, numel."""
    inst, p = plan.inst, plan.params[pi]
    first = p.pieces.start[inst["block"][idx]]
    counts = p.pieces.start[inst["block"][idx] + 1] - first
    rows = np.repeat(idx, counts)
    piece = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    shard = p.pieces.shard[piece]
    return dict(inst=rows, piece=piece, shard=shard, holder=p.groups[inst["replica"][rows], shard],
                owner=inst["owner"][rows], numel=p.pieces.numel[piece])


def instances_by_param(plan) -> list[np.ndarray]:
    """Instance indices of each parameter, in the plan's (canonical) order."""
    return instances_by(plan.inst["param"], np.arange(len(plan.params)))


def instances_by(param: np.ndarray, key_of_param: np.ndarray) -> list[np.ndarray]:
    """Instance indices per key (0..max key) of their parameter, each in the instances' order."""
    key = key_of_param[param]
    n = int(key_of_param.max()) + 1 if len(key_of_param) else 0
    if n < 2**16:  # numpy radix-sorts 16-bit keys
        key = key.astype(np.uint16)
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(n + 1))
    return [order[bounds[i] : bounds[i + 1]] for i in range(n)]


def plan_stats(plan, cache: dict | None = None) -> PlanStats:
    """`cache`: a dict kept across plans of the same parameter layouts (the piece templates' arrays)."""
    world, inst, opt = plan.world_size, plan.inst, plan.options
    flops = np.bincount(inst["owner"], weights=inst["flops"], minlength=world)
    blocks = np.bincount(inst["owner"], minlength=world)
    traffic = {k: np.zeros(world) for k in ("sent_intra", "sent_inter", "recv_intra", "recv_inter")}
    communicated, gathered, cache = set(), {}, {} if cache is None else cache
    batch_of, batches = _batches(plan.params)
    where = _param_instances(plan)
    for k, pi in enumerate(batches):  # parameters sharing template, groups, dtype
        p = plan.params[pi]
        H, part = _template(cache, p, opt.ranks_per_node)
        sets = _instance_sets(inst, p, part, [where[q] for q in np.flatnonzero(batch_of == k).tolist()])
        counted = [_all_to_all_traffic(traffic, p, H, part, *s) for s in sets]
        computed = sum((c for c, _ in counted), np.zeros(p.groups.shape))
        if any(moving for _, moving in counted):
            communicated.add(p.shape_group)
        if p.split and p.groups.shape[0] > 1 and sum(len(s[1]) for s in sets):
            entry = gathered.setdefault(id(p.groups), [p.groups, np.zeros(p.groups.shape)])
            entry[1] += computed
            communicated.add(p.shape_group)
    for groups, computed in gathered.values():
        _replica_gather(traffic, groups, computed, opt.ranks_per_node, world)
    comm_free = [g for g in range(len(plan.shape_groups)) if g not in communicated]
    mean = flops.mean() if world else 0.0
    parts = (
        flops / opt.flops_per_s,
        np.maximum(traffic["sent_intra"], traffic["recv_intra"]) / opt.intra_node_bytes_per_s,
        np.maximum(traffic["sent_inter"], traffic["recv_inter"]) / opt.inter_node_bytes_per_s,
    )
    return PlanStats(
        blocks, flops, **traffic, comm_free_groups=comm_free,
        load_ratio=float(flops.max() / mean) if mean > 0 else 1.0,
        est_seconds=float(sum(parts).max()) if world else 0.0,
        est_overlapped=float(np.maximum.reduce(parts).max()) if world else 0.0,
    )


def _batches(params) -> tuple[np.ndarray, list[int]]:
    """(batch of each parameter, first parameter of each batch): parameters whose instances the
    stats count together (same piece template, groups, split, NS dtype and shape group)."""
    keys = {}
    batch_of = np.array([keys.setdefault((id(p.pieces), id(p.groups), p.split, p.nbytes, p.shape_group), pi)
                         for pi, p in enumerate(params)], dtype=np.int64)
    firsts = sorted(set(batch_of.tolist()))
    renumber = {f: i for i, f in enumerate(firsts)}
    return np.array([renumber[f] for f in batch_of.tolist()], dtype=np.int64), firsts


def _param_instances(plan) -> list:
    """Each parameter's instances: a slice in `assign`'s (parameter-sorted) order, else indices."""
    param = plan.inst["param"]
    if len(param) and not (param[1:] >= param[:-1]).all():
        return instances_by_param(plan)
    bounds = np.searchsorted(param, np.arange(len(plan.params) + 1)).tolist()
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _instance_sets(inst, p, part, where) -> list[tuple]:
    """(rows, block, replica, owner's position in its row) of the instances `where` (per parameter:
    a slice or indices) of parameters batched with p: replica 0 alone (rows 1) for a parameter
    whose replicas place each block alike (`_replicas_alike`), every replica (rows R) otherwise."""
    R = p.groups.shape[0]
    alike_possible = not p.split and R > 1 and len(part["patterns"]) == 1
    sets = {1: [], R: []}
    for w in where:
        b, r, pos = inst["block"][w], inst["replica"][w], part["pos_of"][inst["owner"][w]]
        if alike_possible and _replicas_alike(b, r, pos, R):
            sets[1].append((b[::R], np.zeros(len(b) // R, dtype=np.int64), pos[::R]))  # count replica 0
        else:
            sets[R].append((b, r, pos))
    return [(rows, *(np.concatenate(a) for a in zip(*s))) for rows, s in sets.items() if s]


def _all_to_all_traffic(traffic, p, H, part, rows, b, r, pos) -> tuple[np.ndarray, bool]:
    """Add the forward and return all-to-all bytes of instances (block b, replica r, owner at
    position pos of its row) of parameter p (or of parameters with p's template, groups and dtype)
    to `traffic` (each rank sends what it receives); `rows` 1: replica 0's instances count for
    every replica. H, part: `_template`. Returns (bytes held at each [replica, shard position] of the
    blocks that replica computes, whether any piece moves).

    Per instance, not per piece: with the owner at position `pos` of its replica's row, the owner
    receives every piece but its own (from its node: the pieces at positions of its node), and the
    holder at (r, s) sends all it holds of replica r's instances except where it owns the block; of
    that, it sends inside its node what goes to owners on its node, found from the few pieces of
    each block on its owner's node (none to look up when a row is one node or one node per position).
    """
    R, S = p.groups.shape
    eb = p.nbytes // (p.block_shape[0] * p.block_shape[1])
    b, r, pos, w = _distinct(b, r, pos, rows, S, len(H))
    own = H[b, pos]
    total = part["block_total"][b]
    at = r * S + pos
    own_rs = np.bincount(at, weights=own * w, minlength=rows * S)
    # [rows, S]; einsum, not @: numpy's BLAS would wake its thread pool (which then spins on every
    # core for a while) for a product of a few ms, on every rank of a node at once
    computed = np.einsum("rb,bs->rs", np.bincount(r * len(H) + b, weights=w, minlength=rows * len(H))
                         .reshape(rows, len(H)), H)
    held = computed.ravel() - own_rs  # what each (r, s) sends to owners elsewhere
    same, same_rs = np.zeros(len(b)), np.zeros(rows * S)  # same-node elements: per owner, per holder
    for k, pattern in enumerate(part["patterns"]):
        mine = np.nonzero(part["pattern_of_row"][r] == k)[0] if len(part["patterns"]) > 1 else slice(None)
        cls = pattern[pos[mine]]
        same[mine] = part["H_cls"][k][b[mine], cls]
        if part["one_node"]:
            same_rs = computed.ravel()
        elif not part["own_node_only"]:
            same_rs += _same_node_pieces(part["csr"][k], p, b[mine], r[mine], cls, w[mine], rows * S)
    held_intra = held if part["one_node"] else (np.zeros(rows * S) if part["own_node_only"] else same_rs - own_rs)
    per_position = {  # [rows * S]: as owner plus as holder
        "intra": np.bincount(at, weights=(same - own) * w, minlength=rows * S) + held_intra,
        "inter": np.bincount(at, weights=(total - same) * w, minlength=rows * S) + held - held_intra,
    }
    world = len(traffic["sent_intra"])
    for kind, v in per_position.items():
        both = np.bincount(p.groups.ravel(), weights=np.tile(v, R // rows), minlength=world) * eb
        traffic[f"sent_{kind}"] += both
        traffic[f"recv_{kind}"] += both
    return np.broadcast_to(computed, (R, S)) * eb, bool((total > own).any())


def _distinct(b, r, pos, rows, S, n_blocks) -> tuple:
    """(block, replica, position, count) of the distinct instances (b, r, pos) when a table over
    every (replica, position, block) is smaller than the instances (parameters batched across
    layers repeat each one); else each instance with a count of 1. Every sum the traffic takes
    is of integers, so counting equal instances together changes nothing."""
    if rows * S * n_blocks >= len(b):
        return b, r, pos, np.ones(len(b))
    count = np.bincount((r * S + pos) * n_blocks + b, minlength=rows * S * n_blocks)
    key = np.flatnonzero(count)
    at, block = np.divmod(key, n_blocks)
    return block, at // S, at % S, count[key].astype(np.float64)


def _replicas_alike(b, r, pos, R) -> bool:
    """Whether instances (b, r, pos) list each block's R replicas in a row (assign's order) and
    every replica puts it at the same position: then replica 0 counts for all (the node partition
    of every row being the same)."""
    if len(b) % R:
        return False
    grid = lambda a: a.reshape(-1, R)  # noqa: E731
    return bool((grid(r) == np.arange(R)).all() and (grid(b) == grid(b)[:, :1]).all()
                and (grid(pos) == grid(pos)[:, :1]).all())


def _template(cache, p, ranks_per_node):
    """H [n_blocks, S] (elements of each block at each shard position) and the rows' node
    partitions (`patterns`: class of each position, its node's rank among the row's nodes; per
    pattern the elements of each block per class, and the block's pieces ordered by class), cached
    per piece template and group array."""
    key = (id(p.pieces), id(p.groups))
    if key not in cache:
        R, S = p.groups.shape
        n = len(p.block_boxes)
        block_of = np.repeat(np.arange(n), np.diff(p.pieces.start))
        H = np.zeros((n, S))
        H[block_of, p.pieces.shard] = p.pieces.numel
        node = p.groups // ranks_per_node
        order = np.argsort(node, axis=1, kind="stable")
        sorted_node = np.take_along_axis(node, order, axis=1)
        new_node = np.concatenate([np.zeros((R, 1), bool), sorted_node[:, 1:] != sorted_node[:, :-1]], axis=1)
        cls = np.empty_like(node)
        np.put_along_axis(cls, order, np.cumsum(new_node, axis=1), axis=1)  # the node's rank in the row
        patterns, pattern_of_row = np.unique(cls, axis=0, return_inverse=True)
        part = dict(patterns=list(patterns), pattern_of_row=pattern_of_row.ravel(),
                    one_node=bool((cls == 0).all()), own_node_only=bool((patterns.max(axis=1) == S - 1).all()),
                    pos_of=np.full(int(p.groups.max()) + 1, -1, dtype=np.int64), H_cls=[], csr=[])
        part["pos_of"][p.groups.ravel()] = np.tile(np.arange(S), R)
        part["block_total"] = H.sum(axis=1)
        for pattern in patterns:
            C = int(pattern.max()) + 1
            part["H_cls"].append(np.stack([np.bincount(pattern, weights=h, minlength=C) for h in H]) if n
                                 else np.zeros((0, C)))
            key_of = block_of * C + pattern[p.pieces.shard]
            order = np.argsort(key_of, kind="stable")
            part["csr"].append((C, order, np.searchsorted(key_of[order], np.arange(n * C + 1))))
        cache[key] = H, part
    return cache[key]


def _same_node_pieces(csr, p, b, r, cls, w, size) -> np.ndarray:
    """Per (replica, shard position): elements held there of the instances (b, r), each counted w
    times, whose owner is on the holder's node (owner's class `cls`), the owner's own piece included."""
    C, order, start = csr
    lo, hi = start[b * C + cls], start[b * C + cls + 1]
    count = hi - lo
    rows = np.repeat(np.arange(len(b)), count)
    piece = order[np.repeat(lo - np.cumsum(count) + count, count) + np.arange(count.sum())]
    S = p.groups.shape[1]
    return np.bincount(r[rows] * S + p.pieces.shard[piece], weights=p.pieces.numel[piece] * w[rows], minlength=size)


def _replica_gather(traffic, groups, computed, ranks_per_node, world):
    """Traffic of the all-gather over the replica axis as the pipeline runs it (sharded/pipeline.py),
    counted on the step's totals (the runtime does this per bucket). Per shard position s, the R
    members of the replica group groups[:, s], in rank order, hold segments of computed results
    (`computed` [R, S] bytes) laid end to end, T bytes in all: an all-to-all moves them into R
    equal chunks of T / R (a member keeps the part of its segment that falls in its own chunk), then
    an all-gather of the chunks runs as a ring, each member sending (R - 1) T / R to the next one
    (inside the node when the next one shares it) and receiving as much from the previous one."""
    R, S = groups.shape
    order = np.argsort(groups, axis=0, kind="stable")
    ranks = np.take_along_axis(groups, order, axis=0).T  # [S, R] members of each replica group, in rank order
    c = np.take_along_axis(computed, order, axis=0).T  # [S, R] bytes of each member's segment
    chunk = c.sum(axis=1, keepdims=True) / R  # [S, 1]
    start = np.cumsum(c, axis=1) - c
    j = np.arange(R)
    lo = np.maximum(start[:, :, None], j * chunk[:, :, None])
    hi = np.minimum((start + c)[:, :, None], (j + 1) * chunk[:, :, None])
    move = np.maximum(hi - lo, 0.0)  # [S, m, j] bytes of m's segment in j's chunk
    move[:, j, j] = 0.0
    node = ranks // ranks_per_node
    same = node[:, :, None] == node[:, None, :]
    ring = np.broadcast_to((R - 1) * chunk, (S, R))
    to_next = node == np.roll(node, -1, axis=1)  # [S, R] member m's ring link to m + 1 stays in the node
    parts = {
        "sent_intra": (move * same).sum(axis=2) + np.where(to_next, ring, 0.0),
        "sent_inter": (move * ~same).sum(axis=2) + np.where(to_next, 0.0, ring),
        "recv_intra": (move * same).sum(axis=1) + np.where(np.roll(to_next, 1, axis=1), ring, 0.0),
        "recv_inter": (move * ~same).sum(axis=1) + np.where(np.roll(to_next, 1, axis=1), 0.0, ring),
    }
    for k, v in parts.items():
        traffic[k] += np.bincount(ranks.ravel(), weights=v.ravel(), minlength=world)


def _split_word(plan) -> str:
    if plan.replica_split == "mixed":
        return f"on for {sum(p.split for p in plan.params)} of {len(plan.params)} params"
    return "on" if plan.replica_split else "off"


def describe(plan, max_rows: int = 16) -> str:
    s, opt = plan.stats, plan.options
    n_blocks = sum(len(p.block_boxes) for p in plan.params)
    lines = [
        f"Sharded Muon plan: {plan.world_size} ranks, {len(plan.params)} Muon params, {n_blocks} blocks "
        f"({len(plan.inst['owner'])} computed, replica split {_split_word(plan)}), "
        f"{plan.num_buckets} buckets of <= {opt.bucket_mb:g} MB per rank",
        f"NS FLOPs per rank: max {s.flops.max():.3e}, mean {s.flops.mean():.3e}, max/mean {s.load_ratio:.3f}; "
        f"estimated step {s.est_seconds * 1e3:.1f} ms, {s.est_overlapped * 1e3:.1f} ms overlapped "
        f"(NS at {opt.flops_per_s:.2e} FLOP/s, {opt.intra_node_bytes_per_s:.2e}/{opt.inter_node_bytes_per_s:.2e} "
        f"B/s intra/inter, {opt.ranks_per_node} ranks per node)",
        "shape groups (short x long side, dtype: block instances, communication):",
    ]
    sg = np.array([p.shape_group for p in plan.params], dtype=np.int64)
    counts = np.bincount(sg[plan.inst["param"]], minlength=len(plan.shape_groups))
    for g, (r, c, dtype) in enumerate(plan.shape_groups):
        free = "none" if g in s.comm_free_groups else "communicated"
        lines.append(f"  {r} x {c} {str(dtype).replace('torch.', '')}: {counts[g]} blocks, {free}")
    lines.append("rank  blocks   NS GFLOP  sent intra/inter MB  recv intra/inter MB")
    ranks = np.argsort(-s.flops, kind="stable")[:max_rows] if plan.world_size > max_rows else range(plan.world_size)
    mb = 2.0**20
    for r in sorted(ranks):
        sent = f"{s.sent_intra[r] / mb:10.1f}/{s.sent_inter[r] / mb:<9.1f}"
        received = f"{s.recv_intra[r] / mb:10.1f}/{s.recv_inter[r] / mb:<9.1f}"
        lines.append(f"{r:4d} {s.blocks[r]:7d} {s.flops[r] / 1e9:10.1f} {sent} {received}")
    if plan.world_size > max_rows:
        lines.append(f"({max_rows} most loaded of {plan.world_size} ranks shown)")
    return "\n".join(lines)
