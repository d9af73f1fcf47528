"""Runs of equal blocks for the owner assignment (optim/planner/owners.py): per piece template, which
rank positions hold each block's pieces (`_info`), and the loops that place a run of blocks held in
pieces with equal shares one after the other (`_fill_row`; a level of equal loads at a time:
`_fill_by_level`, and `_fill_holders` under the holders' cap), picking exactly what
`planner.owners._place_block` would. Pure numpy, no process group.
"""

import heapq

import numpy as np


def _info(info, p):
    """Per (piece template, split), computed once per pass: (held fraction [n_blocks, positions],
    whole_on as a list, then `_equal_shares`: holder masks, mask index and share of each block)."""
    t = (id(p.pieces), p.split)
    if t not in info:
        held = _held_fraction(p, p.split)
        info[t] = (held, p.pieces.whole_on.tolist(), *_equal_shares(held))
    return info[t]


def _run(items, i, params, info, holders) -> tuple[list, list]:
    """items[i] and the items after it that `_place_block` places by the same rule (same group
    array, split and FLOPs, held in pieces with equal shares): their (parameter, block), and their
    (holder mask, holder positions as a set, mask key, share) for `_fill_row`. `holders`: the sets
    by mask key, kept for the pass. A parameter's items are its blocks in order (`assign`), so a
    run takes slices of them up to the template's next block of another rule (`_run_template`)."""
    p = params[items[i][0]]
    run, blocks = [], []
    j = i
    while j < len(items):
        pi, b = items[j]
        q = params[pi]
        if q.groups is not p.groups or q.split != p.split or q.flops != p.flops:
            break
        per_block, end = _run_template(info, q, holders)
        stop = end[b]
        run += items[j : j + stop - b]
        blocks += per_block[b:stop]
        j += stop - b
        if stop < len(end):
            break
    return run, blocks


def _run_template(info, p, holders) -> tuple[list, list]:
    """Per (piece template, split), computed once per pass: each block's `_run` entry (None for a
    block held whole or with unequal shares) and the first such block at or after each block."""
    t = (id(p.pieces), p.split, "run")
    if t not in info:
        _, whole_on, masks, pattern, share = _info(info, p)
        per_block = []
        for b, k in enumerate(pattern):
            if whole_on[b] >= 0 or k < 0:
                per_block.append(None)
                continue
            mask, mask_key = masks[k]
            if mask_key not in holders:
                holders[mask_key] = frozenset(np.nonzero(mask)[0].tolist())
            per_block.append((mask, holders[mask_key], mask_key, share[b]))
        stops = np.array([b for b, e in enumerate(per_block) if e is None] + [len(per_block)], dtype=np.int64)
        end = stops[np.searchsorted(stops, np.arange(len(per_block)))].tolist()
        info[t] = per_block, end
    return info[t]


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
    loaded holder while under it (`planner.owners._holder_under_cap`). Adds the FLOPs to `loads`.

    The rule of `planner.owners._least_loaded_equal`, inlined over a list copy of the loads: the least loaded of
    the row, unless it is no holder and the least loaded holder, less its bonus, is below it (loads
    are integers, so below 2**51 the bonus changes nothing among holders: the loop stops at a load
    of 2**51, leaving the rest of the blocks to the caller). Heaps as `planner.owners._heap_top`'s (the keys of
    the per-block paths): lazy, a stale entry refreshed when it comes on top."""
    picks = (_fill_by_level(ranks, flops, blocks, loads) if cap is None
             else _fill_holders(ranks, flops, blocks, loads, cap))
    load = loads.tolist()
    row, holder_heaps, replace = _heap(heaps, (key, b"row"), ranks, None, loads), {}, heapq.heapreplace
    for mask, holder_set, mask_key, share in blocks[len(picks) :]:
        holders = holder_heaps.get(mask_key)
        if holders is None:
            holders = holder_heaps[mask_key] = _heap(heaps, (key, mask_key), ranks, mask, loads)
        pick = holders[0] if cap is not None and holders else None
        while pick is not None and pick[0] != load[pick[2]]:  # _top, inlined: the loop's hot spots
            replace(holders, (load[pick[2]], pick[1], pick[2]))
            pick = holders[0]
        if pick is None or pick[0] + flops > cap:
            pick = row[0]
            while pick[0] != load[pick[2]]:
                replace(row, (load[pick[2]], pick[1], pick[2]))
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


def _fill_holders(ranks, flops, blocks, loads, cap, min_level=4) -> list[int]:
    """`_fill_row`'s picks with `cap` for a first part of `blocks`, a level at a time: per holder
    mask, its holders at their least load v are taken in position order (the least loaded holder,
    first position on ties: a taken one rises above v, the others were above v and only grow),
    and the level is found again once used up. Stops at the first block whose least loaded holder
    would pass `cap` or whose mask's level is narrower than `min_level` (the heaps go on from there).
    Adds the FLOPs to `loads`."""
    row = loads[ranks]  # the levels are found in this copy, the picks read the list
    load, levels, holders, picks = row.tolist(), {}, {}, []  # levels: mask key -> [v, positions, next]
    for mask, _, mask_key, _ in blocks:
        level = levels.get(mask_key)
        if level is not None:
            v, at, i = level
            while i < len(at) and load[at[i]] != v:  # taken by a block of another mask
                i += 1
            level[2] = i
        if level is None or level[2] == len(level[1]):
            where = holders.get(mask_key)
            if where is None:
                where = holders[mask_key] = np.flatnonzero(mask)
            if not len(where):
                break
            held = row[where]
            v = float(held.min())
            level = levels[mask_key] = [v, where[held == v].tolist(), 0]
            if len(level[1]) < min_level:
                break
        v, at, i = level
        if v + flops > cap:
            break
        level[2], pos = i + 1, at[i]
        load[pos] += flops
        row[pos] = load[pos]
        picks.append(pos)
    loads[ranks] = row
    return picks


# `_fill_level` finds a mask's holders at the level by intersecting Python sets when the level has at most
# this many positions per block (Kimi K2 narrow, W = 4096: 275k blocks on 850k positions), else by one numpy
# lookup per mask (wide: 1.8k blocks on 233k positions, where building the level's set costs more).
LEVEL_SET = 8


def _fill_level(level, v, flops, blocks) -> list[int]:
    """Positions (of `level`, ascending, all at load v) of blocks placed one after the other:
    the first untaken holder where the bonus counts, else the first untaken position."""
    order, at, taken, chosen = level.tolist(), 0, set(), []
    holders, bonus = {}, {}  # holders: per mask, its holders at v, last first
    at_level = set(order) if LEVEL_SET * len(blocks) >= len(order) else None
    for mask, holder_set, mask_key, share in blocks:
        if share not in bonus:
            bonus[share] = share > 0 and v - 1e-9 * flops * share < v
        if bonus[share]:
            mine = holders.get(mask_key)
            if mine is None:
                mine = holders[mask_key] = (sorted(holder_set & at_level, reverse=True) if at_level is not None
                                            else level[mask[level]][::-1].tolist())
            while mine and mine[-1] in taken:
                mine.pop()
            if mine:
                chosen.append(mine.pop())
                taken.add(chosen[-1])
                continue
        while order[at] in taken:
            at += 1
        chosen.append(order[at])
        taken.add(order[at])
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


def _held_fraction(p, split):
    R, S = p.groups.shape
    out = np.zeros((len(p.block_boxes), S))
    blocks = np.repeat(np.arange(len(p.block_boxes)), np.diff(p.pieces.start))
    total = np.maximum(1, np.bincount(blocks, weights=p.pieces.numel, minlength=len(out)))
    out[blocks, p.pieces.shard] = p.pieces.numel / total[blocks]
    return np.tile(out, (1, R)) if split else out
