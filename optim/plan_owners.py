"""Owner assignment of the sharded Muon plan (optim/plan.py, step 3): which rank orthogonalizes each
block instance, balancing estimated NS FLOPs greedily over all ranks. Pure numpy, no process group.
`assign` is the entry point; the heaps are fast paths that pick exactly what `_place_block` would.
"""

import heapq

import numpy as np


def assign(params, world_size, prefer_holders=False):
    """Owner of every block instance (module docstring, step 3): a greedy pass in each of two
    orders, keeping the one with the lower maximum load (the second only if the first leaves a rank
    1% over the mean). Each parameter's `split` says whether its blocks are split across replicas:
    then a block has one instance, whose candidates are every replica's ranks (its all-gather costs
    each rank of a replica group its share whichever replica computes it, so FLOPs alone decide).

    `prefer_holders`: a block held in pieces by one replica group goes to its least loaded holder
    while that one stays under the mean load (rule 3a for whole blocks, extended to pieces): its
    pieces then travel only among its holders (inside a node when the shard axis is, e.g. an
    expert mesh with edp_shard inside a node); else the rules below.

    Orders: fewest candidate ranks first, then largest (so blocks that may go anywhere in a wide
    group, like experts, fill what narrow groups left), and plain largest first (LPT). Without replica split
    a block has R instances, placed together: row r of its candidates is replica r's group.
    """
    reps = [1 if p.split else p.groups.shape[0] for p in params]
    n_blocks = [len(p.block_boxes) for p in params]
    cap = sum(p.flops * n * r for p, n, r in zip(params, n_blocks, reps)) / world_size
    width = [p.groups.size if p.split else p.groups.shape[1] for p in params]
    largest = max((p.flops for p, n in zip(params, n_blocks) if n), default=0)  # no rank can load less
    best = None
    for key in (lambda pi: (width[pi], -params[pi].flops), lambda pi: -params[pi].flops):
        # a parameter's blocks share its key, and sorts are stable: ties keep parameter/block order
        items = [(pi, b) for pi in sorted(range(len(params)), key=key) for b in range(n_blocks[pi])]
        loads, owner, replica = _greedy(params, items, world_size, cap, reps, prefer_holders)
        if best is None or loads.max() < best[0].max():
            best = loads, owner, replica
        if best[0].max() <= max(1.01 * cap, largest):  # balanced within 1%, or no order can do better
            break
    _, owner, replica = best
    counts = np.array([n * r for n, r in zip(n_blocks, reps)], dtype=np.int64)
    inst = {"param": np.repeat(np.arange(len(params), dtype=np.int64), counts),
            "block": _per_instance(n_blocks, reps, lambda n, r: np.arange(n)[:, None]),
            "replica": replica, "owner": owner,
            "flops": np.repeat(np.array([p.flops for p in params], dtype=np.float64), counts)}
    return inst


def _per_instance(n_blocks, reps, fill, dtype=np.int64) -> np.ndarray:
    """A flat array in (parameter, block, replica) order, each parameter's [n_blocks, R] part
    filled with fill(n_blocks, R) (broadcast)."""
    ends = np.cumsum([n * r for n, r in zip(n_blocks, reps)], dtype=np.int64)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    for n, r, e in zip(n_blocks, reps, ends.tolist()):
        out[e - n * r : e].reshape(n, r)[:] = fill(n, r)
    return out


def _greedy(params, items, world_size, cap, reps, prefer_holders=False):
    """One greedy pass over `items`: (loads, owner and replica of every instance, flat in (parameter,
    block, replica) order; the per-parameter [n_blocks, R] arrays written below are views of them)."""
    loads = np.zeros(world_size)
    counts = [len(p.block_boxes) * r for p, r in zip(params, reps)]
    ends = np.cumsum(counts, dtype=np.int64)
    flat_owner = np.full(int(ends[-1]) if counts else 0, -1, dtype=np.int64)
    flat_replica = _per_instance([len(p.block_boxes) for p in params], reps, lambda n, r: np.arange(r))
    owner = [flat_owner[e - c : e].reshape(-1, r) for c, e, r in zip(counts, ends, reps)]
    replica = [flat_replica[e - c : e].reshape(-1, r) for c, e, r in zip(counts, ends, reps)]
    info, heaps, share_heaps, holders = {}, {}, {}, {}  # per (piece template, split) / group / mask
    symmetric = None  # the group array whose replica rows hold equal loads, if the last block kept them so
    unequal = set()  # group arrays found with unequal rows in this pass: not checked again (slow path, same picks)
    i = 0
    while i < len(items):
        pi, b = items[i]
        i += 1
        p = params[pi]
        last, symmetric = symmetric, None
        held, whole_on, masks, pattern, share = _info(info, p)
        whole = whole_on[b]
        if whole >= 0 and p.groups.shape[0] == 1:  # fast path (whole experts): one candidate row
            own = int(p.groups[0, whole])
            if loads[own] + p.flops > cap:
                own = _least_loaded(heaps, p.groups, loads, own)
            owner[pi][b, 0] = own
            loads[own] += p.flops
            if id(p.groups) in heaps:
                heapq.heappush(heaps[id(p.groups)], (loads[own], own))
            continue
        kind = _run_kind(p, whole, pattern[b], last, loads, unequal)
        if kind is not None:  # a run of blocks placed by one loop (experts, per-head blocks)
            run = _place_run(*_run(items, i - 1, params, info, holders), kind, p, owner, replica, loads, share_heaps,
                             cap if prefer_holders else None)
            if run:  # else (loads of 2**51 or more) per block below
                i += run - 1
                symmetric = p.groups if kind == "row0" else None
                continue
        if not p.split and p.groups.shape[0] > 1 and (last is p.groups or _symmetric(p.groups, loads, unequal)):
            pos = _place_in_row0(share_heaps, p, whole, masks, pattern[b], share[b], held[b], loads, cap)
            loads[p.groups[1:, pos]] += p.flops  # every replica the same: rows stay equal
            owner[pi][b], symmetric = p.groups[:, pos], p.groups
            continue
        if p.split:  # fast paths over every replica's ranks as one row
            pos = _split_owner(heaps, share_heaps, p, whole, masks, pattern[b], share[b], loads, cap)
            if pos is not None:
                owner[pi][b, 0], replica[pi][b, 0] = p.groups.flat[pos], pos // p.groups.shape[1]
                continue
        if prefer_holders and whole < 0 and p.groups.shape[0] == 1:
            own = _holder_under_cap(share_heaps, p, masks, pattern[b], held[b], loads, cap)
            if own is not None:
                owner[pi][b, 0] = own
                continue
        if whole < 0 and p.groups.shape[0] == 1 and pattern[b] >= 0:  # fast path (split experts)
            pos = _least_loaded_equal(share_heaps, p.groups[0], id(p.groups), p.flops, masks, pattern[b], share[b],
                                      loads)
            if pos is not None:
                owner[pi][b, 0] = p.groups[0, pos]
                continue
        own, rep = _place_block(p, b, loads, cap, p.split, held[b])
        owner[pi][b], replica[pi][b] = own, rep
        loads[own] += p.flops  # owners of one block's replica instances are distinct ranks
    return loads, flat_owner, flat_replica


def _info(info, p):
    """Per (piece template, split), computed once per pass: (held fraction [n_blocks, positions],
    whole_on as a list, then `_equal_shares`: holder masks, mask index and share of each block)."""
    t = (id(p.pieces), p.split)
    if t not in info:
        held = _held_fraction(p, p.split)
        info[t] = (held, p.pieces.whole_on.tolist(), *_equal_shares(held))
    return info[t]


def _run_kind(p, whole, k, last, loads, unequal) -> str | None:
    """How `_place_block` places a block held in pieces with equal shares (mask index k >= 0), as
    an argmin over one row of candidates: "row" (one replica), "all" (split across replicas: every
    replica's ranks), "row0" (repeated in replicas whose rows hold equal loads: row 0 for all);
    None for any other block (held whole, unequal shares, unequal rows)."""
    if whole >= 0 or k < 0:
        return None
    if p.split:
        return "all"
    if p.groups.shape[0] == 1:
        return "row"
    return "row0" if last is p.groups or _symmetric(p.groups, loads, unequal) else None


def _run(items, i, params, info, holders) -> tuple[list, list]:
    """items[i] and the items after it that `_place_block` places by the same rule (same group
    array, split and FLOPs, held in pieces with equal shares): their (parameter, block), and their
    (holder mask, holder positions as a set, mask key, share) for `_fill_row`. `holders`: the sets
    by mask key, kept for the pass."""
    p = params[items[i][0]]
    run, blocks, last = [], [], None
    for j in range(i, len(items)):
        pi, b = items[j]
        if pi != last:
            q, last = params[pi], pi
            if q.groups is not p.groups or q.split != p.split or q.flops != p.flops:
                break
            _, whole_on, masks, pattern, share = _info(info, q)
        k = pattern[b]
        if whole_on[b] >= 0 or k < 0:
            break
        mask, mask_key = masks[k]
        if mask_key not in holders:
            holders[mask_key] = frozenset(np.nonzero(mask)[0].tolist())
        run.append((pi, b))
        blocks.append((mask, holders[mask_key], mask_key, share[b]))
    return run, blocks


def _place_run(run, blocks, kind, p, owner, replica, loads, heaps, cap) -> int:
    """Place the blocks of `run` (`_run`, of kind `_run_kind`, parameters with p's groups) one
    after the other with `_fill_row`, then write their owners (and replicas); "row0" adds each
    block's FLOPs to every replica row at the position it picked in row 0. `cap`: prefer holders
    under it ("row" only). Returns how many blocks it placed (`_fill_row` stops at 2**51)."""
    ranks = p.groups.ravel() if kind == "all" else p.groups[0]
    key = id(p.groups) if kind == "row" else (id(p.groups), kind)  # the heaps of the per-block paths
    pos = np.array(_fill_row(heaps, key, ranks, p.flops, blocks, loads, cap if kind == "row" else None),
                   dtype=np.int64)
    pis, bs = np.array(run[: len(pos)], dtype=np.int64).reshape(-1, 2).T
    for pi in np.unique(pis).tolist():
        at = pis == pi
        if kind == "row0":
            owner[pi][bs[at]] = p.groups[:, pos[at]].T
        else:
            owner[pi][bs[at], 0] = ranks[pos[at]]
            replica[pi][bs[at], 0] = pos[at] // p.groups.shape[1]
    if kind == "row0":  # integer sums below 2**51: exact in any order
        loads += np.bincount(p.groups[1:, pos].ravel(), minlength=len(loads)) * float(p.flops)
    return len(pos)


def _fill_row(heaps, key, ranks, flops, blocks, loads, cap=None) -> list[int]:
    """Positions in `ranks` of equal blocks placed one after the other by `_place_block`'s rule,
    `blocks` giving each one's holders (bool array, positions as a set, mask key) and equal share:
    argmin of load - 1e-9 * flops * held, first position on ties; with `cap`, first the least
    loaded holder while under it (`_holder_under_cap`). Adds the FLOPs to `loads`.

    The rule of `_least_loaded_equal`, inlined over a list copy of the loads: the least loaded of
    the row, unless it is no holder and the least loaded holder, less its bonus, is below it (loads
    are integers, so below 2**51 the bonus changes nothing among holders: the loop stops at a load
    of 2**51, leaving the rest of the blocks to the caller). Heaps as `_heap_top`'s (the keys of
    the per-block paths): lazy, a stale entry refreshed when it comes on top."""
    picks = _fill_by_level(ranks, flops, blocks, loads) if cap is None else []
    load = loads.tolist()
    row, holder_heaps = _heap(heaps, (key, b"row"), ranks, None, loads), {}
    for mask, holder_set, mask_key, share in blocks[len(picks) :]:
        holders = holder_heaps.get(mask_key)
        if holders is None:
            holders = holder_heaps[mask_key] = _heap(heaps, (key, mask_key), ranks, mask, loads)
        pick = _top(holders, load) if cap is not None and holders else None
        if pick is None or pick[0] + flops > cap:
            pick = row[0]
            while pick[0] != load[pick[2]]:  # _top, inlined: the loop's hot spot
                heapq.heapreplace(row, (load[pick[2]], pick[1], pick[2]))
                pick = row[0]
            best = _top(holders, load) if share > 0 and pick[1] not in holder_set else None
            if pick[0] >= 2.0**51 or (best is not None and best[0] >= 2.0**51):
                break
            if best is not None:
                bonus = best[0] - 1e-9 * flops * share
                if bonus < pick[0] or (bonus == pick[0] and best[1] < pick[1]):
                    pick = best
        load[pick[2]] += flops
        picks.append(pick[1])
    loads[:] = load
    return picks


def _fill_by_level(ranks, flops, blocks, loads, min_level=64) -> list[int]:
    """`_fill_row`'s picks (no cap) for a first part of `blocks`, a level of equal loads at a time:
    while the least loaded positions of the row (load v) number at least `min_level` and no other
    load lies within twice the largest bonus possible (plus 1) above v, every pick of the next |level|
    blocks is among them (the others' load, less any bonus, stays above v), so block after block
    takes the first untaken holder at v when its bonus lowers v - bonus below v (the very float
    `_place_block` computes), else the first untaken position at v. Adds the FLOPs to `loads`."""
    row = loads[ranks]
    window = 2 * 1e-9 * flops + 1  # bonuses are 1e-9 * flops * share, shares at most 1
    picks = []
    while len(picks) < len(blocks):
        v = row.min()
        level = np.flatnonzero(row == v)
        if len(level) < min_level or v + flops >= 2.0**51 or ((row > v) & (row <= v + window)).any():
            break
        chosen = _fill_level(level, v, flops, blocks[len(picks) : len(picks) + len(level)])
        row[chosen] += flops
        picks += chosen
    loads[ranks] = row
    return picks


def _fill_level(level, v, flops, blocks) -> list[int]:
    """Positions (of `level`, ascending, all at load v) of blocks placed one after the other:
    the first untaken holder where the bonus counts, else the first untaken position."""
    order, taken, at, holders = level.tolist(), set(), 0, {}  # holders: per mask, (its level positions, next)
    chosen = []
    for mask, _, mask_key, share in blocks:
        pos = None
        if share > 0 and v - 1e-9 * flops * share < v:
            if mask_key not in holders:
                holders[mask_key] = [level[mask[level]].tolist(), 0]
            mine = holders[mask_key]
            while mine[1] < len(mine[0]) and mine[0][mine[1]] in taken:
                mine[1] += 1
            if mine[1] < len(mine[0]):
                pos = mine[0][mine[1]]
        if pos is None:
            while order[at] in taken:
                at += 1
            pos = order[at]
        taken.add(pos)
        chosen.append(pos)
    return chosen


def _heap(heaps, key, ranks, member, loads) -> list:
    """The lazy heap of (load, position, rank) over ranks[member] (all when None) kept under `key`."""
    heap = heaps.get(key)
    if heap is None:
        where = np.arange(len(ranks)) if member is None else np.nonzero(member)[0]
        heap = heaps[key] = [(loads[r], i, r) for i, r in zip(where.tolist(), ranks[where].tolist())]
        heapq.heapify(heap)
    return heap


def _top(heap, load) -> tuple:
    """The current top of a non-empty lazy heap: loads only grow, so an entry is never above its
    rank's load, and a current top entry is the true minimum; a stale one is refreshed in place."""
    top = heap[0]
    while top[0] != load[top[2]]:
        heapq.heapreplace(heap, (load[top[2]], top[1], top[2]))
        top = heap[0]
    return top


def _symmetric(groups, loads, unequal) -> bool:
    """Whether every replica row of `groups` [R, S] holds the same loads, position by position: then
    `_place_block` picks the same position in every row (each row's argmin sees the same numbers),
    so placing the block in row 0 places it everywhere (the rows of Kimi K2's dense parameters, 512
    replicas at W = 4096, are equal while the greedy places them). `unequal`: group arrays found
    unequal before in this pass, not checked again (the caller's slow path picks the same)."""
    if id(groups) in unequal:
        return False
    load = loads[groups]
    if not (load == load[:1]).all():
        unequal.add(id(groups))
        return False
    return True


def _place_in_row0(share_heaps, p, whole, masks, k, share, held, loads, cap) -> int:
    """`_place_block`'s pick in row 0 of a block without replica split (a position of the row):
    its holder while under `cap`, else the least loaded rank (ties: the largest piece), by the
    holders' heaps when their shares are equal. Adds the block's FLOPs to that rank's load."""
    row = p.groups[0]
    if whole >= 0 and loads[row[whole]] + p.flops <= cap:
        pos = whole
    else:
        pos = _least_loaded_equal(share_heaps, row, (id(p.groups), "row0"), p.flops, masks, k, share, loads) \
            if k >= 0 else None
        if pos is not None:
            return pos
        pos = int(np.argmin(loads[row] - 1e-9 * p.flops * held))
    loads[row[pos]] += p.flops
    return pos


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


def _split_owner(heaps, share_heaps, p, whole, masks, k, share, loads, cap) -> int | None:
    """`_place_block` for a block split across replicas, as a position in `p.groups.flat`, via lazy
    heaps (None: the caller falls back): a block held whole goes to the least loaded holder over the
    replicas (first replica on ties) while under `cap`; otherwise, and for a block whose holders hold
    equal shares, `_least_loaded_equal` over every replica's ranks. Adds the block's FLOPs."""
    ranks = p.groups.ravel()
    if whole >= 0:
        column = np.zeros(len(ranks), dtype=bool)
        column[whole :: p.groups.shape[1]] = True
        top = _heap_top(heaps, (id(p.groups), "column", whole), ranks, column, loads)
        if top[0] + p.flops <= cap:
            loads[ranks[top[1]]] += p.flops
            return top[1]
    if k < 0:
        return None
    return _least_loaded_equal(share_heaps, ranks, (id(p.groups), "all"), p.flops, masks, k, share, loads)


def _least_loaded_equal(heaps, ranks, key, flops, masks, k, share, loads) -> int | None:
    """`_place_block` for a block whose candidates are the one row `ranks` (a one-replica group, or
    every replica's ranks of a split block) and whose holders (mask k) hold equal shares, via lazy
    heaps over the row and over the holders (keyed by `key`): the chosen position in `ranks`, whose
    load gets the block's FLOPs.

    `_place_block` picks argmin(load - 1e-9 * flops * held), first position on ties. Loads are
    integers (sums of integer FLOPs); below 2**51 they stay distinct after the equal term is taken
    off, so among holders the pick is the least loaded (first position on ties), and so it is among
    the others, whose term is 0: the row's minimum when that is not a holder (else a holder wins).
    The two are compared with `_place_block`'s own arithmetic. None (caller falls back) above 2**51.
    """
    mask, mask_key = masks[k]
    row_key, holder_key = (key, b"row"), (key, mask_key)
    low = _heap_top(heaps, row_key, ranks, None, loads)
    best = _heap_top(heaps, holder_key, ranks, mask, loads) if share > 0 and not mask[low[1]] else None
    if low[0] >= 2.0**51 or (best is not None and best[0] >= 2.0**51):
        return None
    _, pos, own = low  # positions differ (best only when low is no holder): ranks never compared
    if best is not None:
        _, pos, own = min((best[0] - 1e-9 * flops * share, best[1], best[2]), (low[0] - 1e-9 * flops * 0.0, *low[1:]))
    loads[own] += flops
    for key in (row_key, holder_key):  # refresh the chosen rank where it is on top; elsewhere lazily
        heap = heaps.get(key)
        if heap and heap[0][1] == pos:
            heapq.heapreplace(heap, (loads[own], pos, own))
    return pos


def _holder_under_cap(heaps, p, masks, k, held, loads, cap) -> int | None:
    """The least loaded holder of a one-replica block (first position on ties) if the block fits
    under `cap` there (its FLOPs added to its load), else None. Equal shares (k >= 0): the holders'
    lazy heap; otherwise a scan of the holders."""
    ranks = p.groups[0]
    if k >= 0:
        mask, mask_key = masks[k]
        top = _heap_top(heaps, (id(p.groups), mask_key), ranks, mask, loads)
        if top is None or top[0] + p.flops > cap:
            return None
        pos = top[1]
    else:
        holders = np.nonzero(held > 0)[0]
        if not len(holders):
            return None
        pos = int(holders[np.argmin(loads[ranks[holders]])])
        if loads[ranks[pos]] + p.flops > cap:
            return None
    own = int(ranks[pos])
    loads[own] += p.flops
    return own


def _heap_top(heaps, key, ranks, member, loads):
    """(load, position, rank) of the least loaded rank of ranks[member] (all when None; first
    position on ties), or None when there is none (`_heap`, `_top`)."""
    heap = _heap(heaps, key, ranks, member, loads)
    return _top(heap, loads) if heap else None


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
    if whole >= 0 and R > 1 and not split:  # every replica's holder under cap: no argmin needed
        holders = p.groups[:, whole]
        if (loads[holders] + p.flops <= cap).all():
            return holders, np.arange(R)
    cands = p.groups.reshape(1, -1) if split else p.groups  # [rows, candidates]
    rows = np.arange(len(cands))
    load = loads[cands]
    pick = np.argmin(load - 1e-9 * p.flops * held, axis=1)
    if whole >= 0 and R > 1:
        holder = (whole + np.argmin(load[:, whole::S], axis=1) * S) if split else np.full(R, whole)
        pick = np.where(load[rows, holder] + p.flops <= cap, holder, pick)
    return cands[rows, pick], (pick // S if split else rows)
