"""Expert parallelism: one dispatcher object per MoE layer, built once from the frozen EP config.

    config.py      EPConfig: the `[parallel]` EP knobs, declared once (layout.ep_config; ParallelConfig inherits them)
    refusals.py    the one table of refused combinations, run once by Layout.validate (docs/expert_parallel.md)
    dispatcher.py  Dispatcher / DedupDispatcher, apply_expert_parallel: what an MoE layer calls
    direct.py      the direct dispatch: count exchange, the all-to-alls of rows (compute dtype or FP8)
    capacity.py    fixed capacity: constant split sizes, no host sync, dropped copies counted
    dedup.py       node-deduplicated routing: one row per (token, node), fanned out inside the node
    pieces.py      the all-to-alls in pieces, one in flight while another computes (direct and dedup)
    keep.py        `ep_recompute = "keep"`: a recompute replays what the forward's exchanges received
    plan.py        the pure dispatch plan (placement, rows per stage) the runtime and the projection share
"""
