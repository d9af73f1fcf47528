"""Owner assignment of the sharded Muon plan (optim/planner/plan.py, step 3): which rank orthogonalizes each
block instance, balancing estimated NS FLOPs greedily over all ranks. Pure numpy, no process group.
`assign` is the entry point; the heaps are fast paths that pick exactly what `_place_block` would.
"""

import heapq

import numpy as np

from optim.planner.runs import _heap, _info, _place_run, _run, _top


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
    Where a block above the mean load is not the first order's first (Kimi K2's mixed replica split
    at W >= 1024: a dense FFN block after the attention blocks), LPT runs first; when it reaches
    that block's FLOPs, which no order beats, the first order stops as soon as it is sure to end
    past the 1% bound, where it would lose (the same pick as the plain sequence, a pass saved).
    """
    reps = [1 if p.split else p.groups.shape[0] for p in params]
    n_blocks = [len(p.block_boxes) for p in params]
    cap = sum(p.flops * n * r for p, n, r in zip(params, n_blocks, reps)) / world_size
    width = [p.groups.size if p.split else p.groups.shape[1] for p in params]
    largest = max((p.flops for p, n in zip(params, n_blocks) if n), default=0)  # no rank can load less
    bound = max(1.01 * cap, largest)  # balanced within 1%, or no order can do better
    by_width = sorted(range(len(params)), key=lambda pi: (width[pi], -params[pi].flops))
    lpt = sorted(range(len(params)), key=lambda pi: -params[pi].flops)

    def run(order, stop=None):  # a parameter's blocks share its key, sorts are stable: ties keep order
        return _greedy(params, _items(order, n_blocks), world_size, cap, reps, prefer_holders, stop)

    first = next((pi for pi in by_width if n_blocks[pi]), None)
    if largest > 1.01 * cap and first is not None and params[first].flops < largest:
        # the largest block, above the mean, comes after others in the first order, so it likely
        # lands on a loaded rank there: LPT first, and if LPT reaches `largest`, which no order
        # beats, the first order only until it is sure to end past `bound` (then it would lose):
        # a load past it, or, before the largest block is placed, every rank it may go to (one
        # replica's) loaded more than bound - largest
        second = run(lpt)
        big = next(pi for pi in by_width if n_blocks[pi] and params[pi].flops == largest)
        ranks = params[big].groups.ravel() if params[big].split else params[big].groups[0]
        ahead = set(by_width[: by_width.index(big) + 1])  # at their start, the largest block is still to place

        def lost(pi, loads):
            return loads.max() > bound or (pi in ahead and loads[ranks].min() + largest > bound)

        best = _pick(run(by_width, lost if second[0].max() == largest else None), second, bound)
    else:  # the first order; LPT only if it is not balanced
        best = run(by_width)
        if best[0].max() > bound:
            best = _pick(best, run(lpt), bound)
    _, owner, replica = best
    counts = np.array([n * r for n, r in zip(n_blocks, reps)], dtype=np.int64)
    inst = {"param": np.repeat(np.arange(len(params), dtype=np.int64), counts),
            "block": _per_instance(n_blocks, reps, lambda n, r: np.arange(n)[:, None]),
            "replica": replica, "owner": owner,
            "flops": np.repeat(np.array([p.flops for p in params], dtype=np.float64), counts)}
    return inst


def _pick(first, second, bound):
    """The first order's pass if it ends within `bound` (None: it stopped, sure to end past it), else
    the one with the lower largest load, the first on a tie."""
    if first is not None and (first[0].max() <= bound or second[0].max() >= first[0].max()):
        return first
    return second


def _items(order, n_blocks) -> list[tuple[int, int]]:
    """(parameter, block) of every block, parameters in `order`, each one's blocks in order."""
    counts = np.array([n_blocks[pi] for pi in order], dtype=np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return list(zip(np.repeat(np.array(order, dtype=np.int64), counts).tolist(),
                    (np.arange(int(counts.sum())) - first).tolist()))


def _per_instance(n_blocks, reps, fill, dtype=np.int64) -> np.ndarray:
    """A flat array in (parameter, block, replica) order, each parameter's [n_blocks, R] part
    filled with fill(n_blocks, R) (broadcast)."""
    ends = np.cumsum([n * r for n, r in zip(n_blocks, reps)], dtype=np.int64)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    for n, r, e in zip(n_blocks, reps, ends.tolist()):
        out[e - n * r : e].reshape(n, r)[:] = fill(n, r)
    return out


def _greedy(params, items, world_size, cap, reps, prefer_holders=False, stop=None):
    """One greedy pass over `items`: (loads, owner and replica of every instance, flat in (parameter,
    block, replica) order; the per-parameter [n_blocks, R] arrays written below are views of them).
    None as soon as stop(parameter, loads) holds, asked where the items' parameter changes."""
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
    i, previous = 0, None
    while i < len(items):
        pi, b = items[i]
        i += 1
        if stop is not None and pi != previous and stop(pi, loads):
            return None
        previous = pi
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
        if not p.split and p.groups.shape[0] > 1 and id(p.groups) in unequal:  # rows apart: all rows at once
            i += _place_rows(items, i - 1, params, info, owner, loads, cap) - 1
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


def _place_rows(items, i, params, info, owner, loads, cap) -> int:
    """`_place_block` for items[i] and the items after it of parameters with its group array (not
    split across replicas), one block after the other on a copy of the group's loads [R, S]
    (Kimi K2's per-head attention blocks once a replica split made the rows' loads differ): the
    numpy of `_place_block` without gathering the loads per block. Returns how many it placed."""
    groups = params[items[i][0]].groups
    L, rows, j = loads[groups], np.arange(groups.shape[0]), i
    while j < len(items) and params[items[j][0]].groups is groups and not params[items[j][0]].split:
        pi, b = items[j]
        p, held = params[pi], _info(info, params[pi])[0][b]
        whole = p.pieces.whole_on[b]
        if whole >= 0:  # its holder in each row where under cap (nearly all), else the argmin
            over = np.flatnonzero(L[:, whole] + p.flops > cap)
            if not len(over):
                owner[pi][b] = groups[:, whole]
                L[:, whole] += p.flops
                j += 1
                continue
            pick = np.full(len(rows), whole)
            pick[over] = np.argmin(L[over] - 1e-9 * p.flops * held, axis=1)
        else:
            pick = np.argmin(L - 1e-9 * p.flops * held, axis=1)
        owner[pi][b] = groups[rows, pick]
        L[rows, pick] += p.flops
        j += 1
    loads[groups] = L
    return j - i


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
