"""What a sharded-Muon plan costs, per rank: blocks and NS FLOPs owned, bytes sent and received
(intra- vs inter-node), the communication-free shape groups, max/mean load, and the cost estimate
of the module docstring of `optim/plan.py`. Pure numpy over the plan's arrays.

Traffic counted per step, both directions: a piece whose holder is not its block's owner crosses
once to the owner (forward all-to-all) and once back (return all-to-all); with replica split, every
piece of a result also goes from its holder to the same shard position in each other replica.
"""

from dataclasses import dataclass

import numpy as np
import torch


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


def expand_pieces(plan) -> dict[str, np.ndarray]:
    """One row per (block instance, piece): inst, param, piece (row in the param's Pieces), shard,
    holder, owner, numel. Rows follow the plan's instance order, then piece order."""
    inst = plan.inst
    by_param = np.argsort(inst["param"], kind="stable")
    bounds = np.searchsorted(inst["param"][by_param], np.arange(len(plan.params) + 1))
    parts = []
    for pi, p in enumerate(plan.params):
        idx = by_param[bounds[pi] : bounds[pi + 1]]
        if len(idx) == 0:
            continue
        first = p.pieces.start[inst["block"][idx]]
        counts = p.pieces.start[inst["block"][idx] + 1] - first
        rows = np.repeat(idx, counts)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        piece = np.repeat(first, counts) + within
        shard = p.pieces.shard[piece]
        parts.append(
            dict(inst=rows, param=np.full(len(rows), pi), piece=piece, shard=shard,
                 holder=p.groups[inst["replica"][rows], shard], owner=inst["owner"][rows],
                 numel=p.pieces.numel[piece])
        )
    keys = ("inst", "param", "piece", "shard", "holder", "owner", "numel")
    if not parts:
        return {k: np.zeros(0, dtype=np.int64) for k in keys}
    out = {k: np.concatenate([d[k] for d in parts]) for k in keys}
    order = np.lexsort((out["piece"], out["inst"]))
    return {k: v[order] for k, v in out.items()}


def plan_stats(plan) -> PlanStats:
    world, inst, opt = plan.world_size, plan.inst, plan.options
    flops = np.bincount(inst["owner"], weights=inst["flops"], minlength=world)
    blocks = np.bincount(inst["owner"], minlength=world)
    traffic = {k: np.zeros(world) for k in ("sent_intra", "sent_inter", "recv_intra", "recv_inter")}
    rows = expand_pieces(plan)
    itemsize = np.array([torch.empty((), dtype=plan.shape_groups[p.shape_group][2]).element_size() for p in plan.params])
    nbytes = rows["numel"] * itemsize[rows["param"]] if len(rows["param"]) else rows["numel"]
    moving = rows["holder"] != rows["owner"]
    for a, b in ((rows["holder"], rows["owner"]), (rows["owner"], rows["holder"])):  # forward, return
        _count(traffic, a[moving], b[moving], nbytes[moving], opt.ranks_per_node, world)
    communicated = set(np.array([p.shape_group for p in plan.params])[rows["param"][moving]].tolist())
    if plan.replica_split:
        communicated |= _replica_gather(plan, rows, nbytes, traffic)
    comm_free = [g for g in range(len(plan.shape_groups)) if g not in communicated]
    mean = flops.mean() if world else 0.0
    seconds = (
        flops / opt.flops_per_s
        + np.maximum(traffic["sent_intra"], traffic["recv_intra"]) / opt.intra_node_bytes_per_s
        + np.maximum(traffic["sent_inter"], traffic["recv_inter"]) / opt.inter_node_bytes_per_s
    )
    return PlanStats(
        blocks, flops, **traffic, comm_free_groups=comm_free,
        load_ratio=float(flops.max() / mean) if mean > 0 else 1.0,
        est_seconds=float(seconds.max()) if world else 0.0,
    )


def _count(traffic, src, dst, nbytes, ranks_per_node, world):
    intra = (src // ranks_per_node) == (dst // ranks_per_node)
    for mask, kind in ((intra, "intra"), (~intra, "inter")):
        traffic[f"sent_{kind}"] += np.bincount(src[mask], weights=nbytes[mask], minlength=world)
        traffic[f"recv_{kind}"] += np.bincount(dst[mask], weights=nbytes[mask], minlength=world)


def _replica_gather(plan, rows, nbytes, traffic) -> set[int]:
    """Traffic of the all-gather over the replica axis; returns the shape groups it touches."""
    touched = set()
    replica = plan.inst["replica"][rows["inst"]]
    for pi, p in enumerate(plan.params):
        R = p.groups.shape[0]
        mine = np.nonzero(rows["param"] == pi)[0]
        if R == 1 or len(mine) == 0:
            continue
        touched.add(p.shape_group)
        for r in range(R):  # receivers in replica r get every piece computed by another replica
            sel = mine[replica[mine] != r]
            dst = p.groups[r, rows["shard"][sel]]
            _count(traffic, rows["holder"][sel], dst, nbytes[sel], plan.options.ranks_per_node, plan.world_size)
    return touched


def describe(plan, max_rows: int = 16) -> str:
    s, opt = plan.stats, plan.options
    n_blocks = sum(len(p.block_boxes) for p in plan.params)
    lines = [
        f"Sharded Muon plan: {plan.world_size} ranks, {len(plan.params)} Muon params, {n_blocks} blocks "
        f"({len(plan.inst['owner'])} computed, replica split {'on' if plan.replica_split else 'off'}), "
        f"{plan.num_buckets} buckets of <= {opt.bucket_mb:g} MB per rank",
        f"NS FLOPs per rank: max {s.flops.max():.3e}, mean {s.flops.mean():.3e}, max/mean {s.load_ratio:.3f}; "
        f"estimated step {s.est_seconds * 1e3:.1f} ms (NS at {opt.flops_per_s:.2e} FLOP/s, "
        f"{opt.intra_node_bytes_per_s:.2e}/{opt.inter_node_bytes_per_s:.2e} B/s intra/inter, "
        f"{opt.ranks_per_node} ranks per node, no overlap)",
        "shape groups (rows x cols dtype: blocks, communication):",
    ]
    sg = np.array([p.shape_group for p in plan.params])
    counts = np.bincount(sg[plan.inst["param"]], minlength=len(plan.shape_groups))
    for g, (r, c, dtype) in enumerate(plan.shape_groups):
        free = "none" if g in s.comm_free_groups else "all-to-all"
        lines.append(f"  {r} x {c} {str(dtype).replace('torch.', '')}: {counts[g]} blocks, {free}")
    lines.append("rank  blocks   NS GFLOP  sent intra/inter MB  recv intra/inter MB")
    ranks = np.argsort(-s.flops, kind="stable")[:max_rows] if plan.world_size > max_rows else range(plan.world_size)
    mb = 2.0**20
    for r in sorted(ranks):
        lines.append(
            f"{r:4d} {s.blocks[r]:7d} {s.flops[r] / 1e9:10.1f} {s.sent_intra[r] / mb:10.1f}/{s.sent_inter[r] / mb:<9.1f}"
            f" {s.recv_intra[r] / mb:10.1f}/{s.recv_inter[r] / mb:<9.1f}"
        )
    if plan.world_size > max_rows:
        lines.append(f"({max_rows} most loaded of {plan.world_size} ranks shown)")
    return "\n".join(lines)
