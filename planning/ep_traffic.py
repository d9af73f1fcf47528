"""EP traffic for the whole-step projection, from the runtime's dispatch plan (parallel/ep/plan.py).

benchmarks/step_projection.py calls `ep_bytes` for each layout and dispatch combination
(`dispatch_variants`): the stages of parallel/ep/plan.layer_traffic, the code the runtime dispatches
with, evaluated on the routing of the model's own Router (`sampled_routing`), so every projected EP
byte is one the runtime would send for that routing (tests/ranks/test_ep_dispatch.py checks it to the byte
on real 8-rank runs); the host syncs come from parallel/ep/plan.host_syncs_per_layer; the overlap is
modelled as the runtime does it (`exposed_ep_s`).
"""

import dataclasses
import functools
import math

import torch

from parallel.ep.config import EPConfig

SAMPLE_TOKENS = 128  # tokens per ep rank routed by the model's own Router to estimate EP bytes
INTEGER_STAGES = ("counts", "node_counts")  # per-expert/per-peer counts: they do not grow with tokens
EXPERT_STAGES = ("dispatch", "combine", "slot_ids", "fan_out", "fan_in")  # inside the GroupedExperts call
PIPELINED_STAGES = ("dispatch", "combine")  # what ep_overlap_chunks pipelines (parallel/ep/pieces.py)
NODE_HOP_STAGES = ("node_dispatch", "node_weights", "node_ids", "node_combine")  # with dedup (ep_dedup_overlap.py)


@functools.lru_cache(maxsize=None)
def sampled_routing(config, n_ranks: int, tokens: int = SAMPLE_TOKENS, seed: int = 0) -> tuple:
    """experts_TK of `tokens` tokens per ep rank from the model's own Router (models/moe.py: group-limited
    routing where the config has it) with a randomly initialized gate and standard normal inputs: the
    routing of an untrained model, close to uniform. Each rank's sample comes from its own gate draw,
    so that no single draw's favourite experts bias the mean over ranks. A trained router is more
    skewed (not modelled)."""
    from models.moe import Router

    generator = torch.Generator().manual_seed(seed)
    router = Router(config).eval()
    bound = 1 / math.sqrt(config.dim)  # nn.Linear's default init, drawn from our generator
    out = []
    with torch.no_grad():
        for _ in range(n_ranks):
            router.gate.weight.uniform_(-bound, bound, generator=generator)
            out.append(router(torch.randn(1, tokens, config.dim, generator=generator))[1])
    return tuple(out)


def placement(config, size: int, stride: int, gpus_per_node: int):
    """The plan's placement of an ep group of `size` ranks `stride` apart from rank 0."""
    from parallel.ep.plan import Placement

    return Placement(config.n_routed_experts, tuple(i * stride for i in range(size)), gpus_per_node)


def layer_stages(config, layout, routing, act_bytes: int, placement) -> list:
    """One MoE layer's all-to-alls from the runtime's dispatch plan (parallel/ep/plan.layer_traffic) for
    this routing (experts_TK per ep index) and the layout's dispatch knobs."""
    from parallel.ep.plan import layer_traffic

    fp8_row = config.dim + 4  # parallel/ep/direct.py (FP8 rows): D e4m3 values and one fp32 scale per row
    ep = layout.ep_config
    dispatch = fp8_row if ep.dispatch_fp8 else None
    combine_grad = fp8_row if ep.combine_grad_fp8 else None
    return layer_traffic(list(routing), placement, config.dim, act_bytes, ep.ep_dedup, dispatch,
                         capacity_factor=ep.ep_capacity_factor, chunks=ep.ep_overlap_chunks,
                         combine_grad_bytes=combine_grad)


def ep_bytes(config, layout, placement, local_tokens: int, micro_batches: int, act_bytes: int,
             activation_checkpoint: str = "none") -> tuple[dict, float]:
    """({stage name: (intra-node, inter-node bytes one rank sends per step)}, distinct nodes per token):
    `layer_bytes` of each exchange, forward (as often as `forward_passes` says: once, plus what
    activation checkpointing reruns: full, the layer's forward; selective, the experts' dispatch and
    combine; nothing with parallel.ep_recompute = "keep", parallel/ep/keep.py) and backward, every MoE
    layer and micro-batch."""
    from parallel.ep.plan import distinct_nodes_per_token

    n = (config.n_layers - config.n_dense_layers) * micro_batches
    out = {}
    for name, (forward, backward) in layer_bytes(config, layout, placement, local_tokens, act_bytes).items():
        passes = forward_passes(name, activation_checkpoint, layout)
        out[name] = tuple(n * (passes * f + b) for f, b in zip(forward, backward))
    routing = sampled_routing(config, layout.ep)
    nodes = float(torch.cat([distinct_nodes_per_token(r, placement) for r in routing]).float().mean())
    return out, nodes


def layer_bytes(config, layout, placement, local_tokens: int, act_bytes: int) -> dict:
    """{stage name: ((intra, inter) forward, (intra, inter) backward)}: bytes one rank sends in one
    exchange of each all-to-all of one MoE layer and micro-batch: the dispatch plan on the model's own
    routing of SAMPLE_TOKENS tokens per ep rank, mean over the ep ranks, token-proportional stages
    scaled to `local_tokens` (the count exchanges not); backward: the gradient rows
    (parallel/ep/plan.sent_bytes(..., backward=True)), none for integer stages."""
    from parallel.ep.plan import sent_bytes

    routing = sampled_routing(config, layout.ep)
    out = {}
    for stage in layer_stages(config, layout, routing, act_bytes, placement):
        k = 1.0 if stage.name in INTEGER_STAGES else local_tokens / SAMPLE_TOKENS
        sent = [sent_bytes([stage], placement, backward) for backward in (False, True)]
        out[stage.name] = tuple(tuple(k * s[link].double().mean().item() for link in ("intra", "inter"))
                                for s in sent)
    return out


def forward_passes(stage_name: str, activation_checkpoint: str, layout) -> int:
    """How often a stage's forward all-to-all runs per MoE layer and micro-batch: once, plus what
    activation checkpointing reruns (full: the layer's forward; selective: the all-to-alls issued inside
    the experts' call, `expert_call_stages`); none with `parallel.ep_recompute = "keep"`, whose recompute
    replays what the forward received (parallel/ep/keep.py). Its backward (differentiable stages) runs once."""
    if layout.ep_config.keep:
        return 1
    reruns = {"none": 0, "full": 1}.get(activation_checkpoint, 0)
    selective = activation_checkpoint == "selective" and stage_name in expert_call_stages(layout.ep_config)
    return 1 + reruns + selective


def layer_link_bytes(stages: list, placement, index: int, activation_checkpoint: str, layout) -> tuple[int, int]:
    """(intra-node, inter-node) bytes ep index `index` sends in one MoE layer and micro-batch for
    these stages (one routing): `ep_bytes`'s per-layer term for one rank, unscaled (launch/dry_run.py
    compares it with the all-to-alls it counts)."""
    from parallel.ep.plan import sent_bytes

    out = [0, 0]
    for stage in stages:
        sent = [sent_bytes([stage], placement, backward) for backward in (False, True)]
        for i, link in enumerate(("intra", "inter")):
            out[i] += forward_passes(stage.name, activation_checkpoint, layout) * int(sent[0][link][index]) \
                + int(sent[1][link][index])
    return out[0], out[1]


def expert_call_stages(ep_config) -> tuple:
    """The all-to-alls issued inside the GroupedExperts call (what `activation_checkpoint = "selective"`
    reruns): the dispatch and combine (capacity: and the slot ids; dedup: the fan-out and fan-in); with
    pieces also the count exchange (parallel/ep/pieces.py), and with dedup in pieces the whole node hop
    (parallel/ep/pieces.py; an upper bound there: torch's checkpoint stops the recompute after the
    last piece's fan-out, so that piece's node combine is not sent again, tests/ranks/test_ep_dispatch.py)."""
    if ep_config.ep_overlap_chunks > 1 and ep_config.ep_dedup:
        return EXPERT_STAGES + ("counts",) + NODE_HOP_STAGES
    return EXPERT_STAGES + (("counts",) if ep_config.ep_overlap_chunks > 1 else ())


def exposed_ep_s(ep_s: float, expert_s: float, chunks: int) -> float:
    """EP seconds on the critical path. Without overlap all of them. With n pieces
    (parallel/ep/pieces.py), a layer's all-to-alls (C) and grouped matmuls (E) pipeline: the first
    piece's dispatch and the last piece's combine wait for / are waited for by nothing, so the layer
    takes max(E + C/n, C + E/n), of which max(C/n, C - E (n-1)/n) beyond the matmuls. Only the routed
    experts' matmuls hide all-to-alls (the runtime overlaps nothing else with them)."""
    if chunks <= 1:
        return ep_s
    return max(ep_s / chunks, ep_s - expert_s * (chunks - 1) / chunks)


def dispatch_knobs(layout) -> dict:
    """The layout's EP dispatch knobs the projection varies (parallel/ep/config.py)."""
    return layout.ep_config.knobs()


def degrees_only(layout):
    """The layout without its EP dispatch knobs (the optimizer step does not depend on them; one plan per layout)."""
    return dataclasses.replace(layout, ep_config=EPConfig(ranks_per_node=layout.ep_config.ranks_per_node))


def dispatch_variants(layout, activation_checkpoint: str = "none") -> dict:
    """{name: layout} for every EP dispatch combination the runtime implements, ep > 1 only; each with FP8
    dispatch also with its combine gradient in FP8 (`_fp8g`: the low-precision communication DeepSeek-V3
    uses, parallel/ep/direct.py (FP8 rows); not alone, to keep the list short); under activation checkpointing each
    also with ep_recompute = "keep"."""
    if layout.ep == 1:
        return {}
    base = degrees_only(layout)
    fp8, dedup, overlap = {"ep_dispatch_dtype": "float8_e4m3"}, {"ep_dedup": True}, {"ep_overlap_chunks": 2}
    combos = {"direct": {}, "fp8": fp8, "overlap2": overlap, "overlap2_fp8": overlap | fp8,
              "dedup": dedup, "dedup_overlap2": dedup | overlap, "dedup_fp8": dedup | fp8,
              "dedup_overlap2_fp8": dedup | overlap | fp8,
              "capacity1.25": {"ep_capacity_factor": 1.25},
              "capacity1.25_fp8": {"ep_capacity_factor": 1.25} | fp8}
    combos |= {f"{name}_fp8g": knobs | {"ep_combine_grad_dtype": "float8_e4m3"} for name, knobs in combos.items()
               if "ep_dispatch_dtype" in knobs}
    if activation_checkpoint != "none":
        combos |= {f"{name}_keep": knobs | {"ep_recompute": "keep"} for name, knobs in combos.items()}
    return {name: dataclasses.replace(base, ep_config=dataclasses.replace(base.ep_config, **knobs))
            for name, knobs in combos.items()}


def describe_knobs(knobs: dict) -> str:
    parts = [("dedup" if knobs["ep_dedup"] else ""),
             (f"capacity {knobs['ep_capacity_factor']:g}" if knobs["ep_capacity_factor"] > 0 else ""),
             (f"{knobs['ep_overlap_chunks']} pieces" if knobs["ep_overlap_chunks"] > 1 else ""),
             ("fp8 dispatch" if knobs["ep_dispatch_dtype"] != "compute" else ""),
             ("fp8 combine gradient" if knobs.get("ep_combine_grad_dtype", "compute") != "compute" else ""),
             ("recompute keeps" if knobs.get("ep_recompute") == "keep" else "")]
    return "[" + (", ".join(p for p in parts if p) or "direct") + "]"
