"""Bytes on the wire of one collective, from what this rank passes in: the one conversion shared by the
dry run (launch/dry_run.py, on every collective it dispatches) and the whole-step projection
(benchmarks/step_projection.py, from shapes), so that their terms compare to the byte.

Convention (benchmarks/lib/counters.py's): what leaves this rank for its peers, itself excluded, whatever
the backend's algorithm; g = group size:
  all_gather      passes its shard S           -> S to each of the g - 1 peers
  reduce_scatter  passes its whole input I      -> I / g to each peer (the peer's shard)
  all_reduce      passes its buffer B           -> 2 B / g to each peer (ring: a reduce-scatter, then an all-gather)
  all_to_all      passes rows split by peer     -> each peer's rows (split_bytes[i] to group index i)
A peer is intra-node (NVLink) when its global rank is on this rank's node (nodes of `ranks_per_node`
consecutive global ranks, parallel.ranks_per_node), else inter-node (the network).
"""

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def to_each_peer(kind: str, passed_bytes: int, size: int, split_bytes=None) -> list[float]:
    """Bytes this rank sends to each group index (its own index included: callers drop it)."""
    if kind == "all_gather":
        return [passed_bytes] * size
    if kind == "reduce_scatter":
        return [passed_bytes / size] * size
    if kind == "all_reduce":
        return [2 * passed_bytes / size] * size
    if kind == "all_to_all":
        if split_bytes is None:  # even split (an all-to-all without split sizes)
            return [passed_bytes / size] * size
        return list(split_bytes)
    raise ValueError(f"collective kind {kind!r}: expected one of {', '.join(KINDS)}")


def wire_bytes(kind: str, passed_bytes: int, group_ranks, me: int, ranks_per_node: int,
               split_bytes=None) -> tuple[float, float]:
    """(intra-node, inter-node) bytes this rank sends for one collective. `group_ranks`: the global
    ranks of the group in group order; `me`: this rank's index in it."""
    node = group_ranks[me] // ranks_per_node
    intra = inter = 0.0
    for i, sent in enumerate(to_each_peer(kind, passed_bytes, len(group_ranks), split_bytes)):
        if i == me:
            continue
        if group_ranks[i] // ranks_per_node == node:
            intra += sent
        else:
            inter += sent
    return intra, inter
