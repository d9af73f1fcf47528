"""The whole training step of the runtime's dual-mesh layouts, projected per rank: FLOPs, bytes per mesh and
link, host syncs, time, MFU and a coarse memory (benchmarks/step_projection.py is its command line).

Dtypes, activation checkpointing, micro-batches (training.grad_accum) and grad_sync come from the config
(training.param_dtype: weights all-gathered and activations computed in it; training.reduce_dtype:
gradients reduced in it; training.activation_checkpoint); an `Options` field overrides one for a what-if.

No process group, nothing allocated: the model is built on the meta device and every number comes
from shapes, the layout and the runtime's own rules. Per rank and step (one rank stands for all;
token loads are assumed uniform):
  flops       model FLOPs (runtime.metrics.flops_per_token x tokens / world), split into dense
              matmuls, routed experts and attention; hardware FLOPs add what activation checkpointing
              reruns in backward (planning/flops.py: the forward share of 6N is 2N, and of
              the attention's 3 S (qk + v) per head S (qk + v), the same 1/3 by convention): "full"
              every block's forward (not the embedding, final norm or output head), "selective" the
              attention's (projections + SDPA) and the routed experts' (parallel/activation_checkpoint.py)
  fsdp        per FSDP unit (parallel/fsdp.py: each block's dense part on the dense mesh, each
              GroupedExperts on the expert mesh, the embedding, norm + output head): all-gather in
              forward and again in backward (reshard_after_forward), reduce-scatter of gradients,
              every micro-batch; HSDP all-reduce of the gradient shard over the replicate axis
              (every micro-batch; fewer with --grad-sync, parallel/overlap.py). Shards padded as
              FSDP2 pads them.
  ep          every all-to-all of the MoE layers (parallel/ep/plan.py, the plan the runtime dispatches
              with, for the layout's EP knobs: direct, node-dedup, fixed capacity, pieces, FP8), on
              the model's own Router's routing of sampled tokens scaled to the local tokens: forward,
              backward and the recompute of activation checkpointing (none with parallel.ep_recompute =
              "keep": its kept buffers go into the memory model instead), per MoE layer and micro-batch;
              each layout is also projected with every other dispatch combination the runtime
              implements, and the fastest row that fits is marked "recommended"
  cp          the keys' all-gather (backward: reduce-scatter) per layer and micro-batch, what
              parallel/context_parallel.py gathers: MLA's latent + rotary key (kv_lora_rank + rope
              dim values per token), GQA's kv heads (2 G E); --cp-gather expanded: the expanded K/V
              (H (qk + v), or 2 H E), as it gathered before, plus that version's positions all-gather
  optimizer   the sharded Muon step from the optimizer projection (benchmarks/projection.py's
              planner + device model)
  host_syncs  1 per step + (ep > 1) x MoE layers x micro-batches x the dispatch's readbacks per layer
              (parallel/ep/plan.host_syncs_per_layer; runtime/syncs.py,
              measured by benchmarks/host_syncs.py, tests/ranks/test_host_syncs.py and tests/ranks/test_ep_dispatch.py)
Bytes follow benchmarks/lib/counters.py's convention (what leaves a rank, self excluded: all-gather
shard x (g - 1), reduce-scatter input x (g - 1)/g, all-reduce 2 (g - 1)/g, all-to-all rows to
peers); a peer on the same node (GPUS_PER_NODE consecutive ranks) is intra-node (NVLink), else inter.
Groups follow the runtime's rank numbering (parallel/meshes.py): the dense mesh numbers cp innermost,
the expert mesh numbers `parallel.expert_inner` innermost, ep (the default: expert FSDP groups stride
across nodes) or edp_shard (expert FSDP inside a node, ep across nodes); --compare projects both.

Time (planning/devices.py links, planning/network.py efficiencies; compute rates the fitted shares of peak of
planning/parameters.py, or measured with --calibration from benchmarks/gpu_check.py):
    compute = model FLOPs / rates + recompute, recompute = the rerun FLOPs / rates (time_s["recompute"])
    step = max(compute + ep + cp, all bytes over NVLink, all bytes over the network) + optimizer
           + host_syncs x sync_s (fitted)
FSDP runs on its own streams and overlaps compute when prefetch keeps ahead (the max), sharing
the links with the EP and CP traffic (hence all bytes in the link terms); the EP and
CP collectives sit on the critical path, except what `parallel.ep_overlap_chunks` hides behind the
routed experts' matmuls (`exposed_ep_s`); --overlap-ep shows the what-if
max(compute, ep + cp) (an upper bound: no runtime path hides all of it); a host sync is charged
the fitted sync_s of idle device. Every row carries the band of the cross-validated error (planning/bands.py)
and, beside it, the central figure with the busiest expert rank at SKEW_LOW x the mean (`tokens_per_gpu_s_skew_1_2`:
the published runs were force-balanced, so the band does not cover routing skew).
MFU = model FLOPs / (step x peak) (the recompute's FLOPs are not model FLOPs).
Memory per GPU (a coarse model for ranking layouts, MEMORY_NOTE): fp32 weights + gradients + optimizer
state of the local shards, the two largest units unsharded in param_dtype (prefetch), and activations:
with training.activation_checkpoint = "full", one layer's plus a t x D checkpoint per layer; otherwise
("none", and "selective", counted like it: an upper bound) one layer's for every layer (the K2/V3 presets
then need ~1 MB per token and layer and fit no layout). A layout "fits" below FIT_FRACTION of memory.
"""

import dataclasses
import math

import torch

from planning import network as net
from planning import bands, ep_traffic
from planning.ep_traffic import degrees_only, dispatch_knobs, exposed_ep_s
from planning.devices import read_calibration
from planning.flops import flops_split, recompute_flops
from planning.fsdp_traffic import GPUS_PER_NODE, Link, all_gather, fsdp_traffic, fsdp_units, groups
from planning.memory.coarse import activation_bytes
from planning.optimizer_step import optimizer_step_s
from planning.parameters import fitted

SKEW_LOW = 1.2  # a what-if beside the band: the busiest expert rank at 1.2x the mean (routing skew)
FIT_FRACTION = 0.9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MEMORY_NOTE = ("memory: a coarse model (sharded fp32 states, 2 unsharded units, per-token activation formula) that "
               "ranks layouts; launch/estimate_memory.py also counts logits, EP dispatch, the Muon step's buffers, "
               "the CUDA runtime and measures activations: use it for the fit")


@dataclasses.dataclass(frozen=True)
class Options:
    """What-ifs over the config (None: the config's value) and the memory the fit is checked against."""
    act_dtype: str | None = None  # activations, dispatched tokens and gathered K/V (default training.param_dtype)
    param_dtype: str | None = None  # what FSDP all-gathers weights in
    reduce_dtype: str | None = None  # what gradients are reduced in
    activation_checkpoint: str | None = None
    grad_sync: str | None = None  # parallel/overlap.py
    cp_gather: str = "latent"  # "latent": what the runtime gathers; "expanded": the expanded K/V
    overlap_ep: bool = False  # step = max(compute, EP + CP): an upper bound beyond any runtime path
    memory_gib: float = 139.8


def ep_placement(config, layout):
    """The dispatch plan's placement of rank 0's ep group (mesh groups are translates of it)."""
    size, stride = groups(layout)["ep"]
    return ep_traffic.placement(config, size, stride, GPUS_PER_NODE)


def ep_links(config, layout, local_tokens: int, micro_batches: int, act_bytes: int,
               activation_checkpoint: str = "none") -> tuple[dict, float]:
    """({all-to-all stage: Link of the bytes one rank sends per step}, distinct nodes per token):
    planning/ep_traffic.py."""
    if layout.ep == 1:
        return {}, 1.0
    by_stage, nodes = ep_traffic.ep_bytes(config, layout, ep_placement(config, layout), local_tokens,
                                             micro_batches, act_bytes, activation_checkpoint)
    return {name: Link(*b) for name, b in by_stage.items()}, nodes


def ep_seconds(stages: dict, device, expert_s: float, chunks: int, inter_peers: int, collectives: dict) -> float:
    """EP time on the critical path: the all-to-alls of a layer run one after another (each waits for
    the previous one's data), each as long as its slower link at the NCCL all-to-all efficiency of its message
    to each of the `inter_peers` remote peers (planning/network.py), plus a latency per collective
    (`collectives[name]` per step); with pieces, the pipelined stages hide behind the routed experts' matmuls
    as `exposed_ep_s` says: the direct dispatch and combine, or with dedup its node hop (parallel/ep/pieces.py:
    each piece's fan-out stays serial)."""
    seconds = {name: net.all_to_all_s(device, link.intra, link.inter, "nccl", inter_peers,
                                      count=max(1, collectives[name]))
               for name, link in stages.items()}
    pipelined = ep_traffic.NODE_HOP_STAGES if "node_dispatch" in stages else ep_traffic.PIPELINED_STAGES
    piped = sum(t for name, t in seconds.items() if name in pipelined) if chunks > 1 else 0.0
    return sum(seconds.values()) - piped + (exposed_ep_s(piped, expert_s, chunks) if piped else 0.0)


def ep_collectives(config, layout, micro_batches: int, activation_checkpoint: str, names) -> dict:
    """{stage: all-to-alls per step}: per MoE layer and micro-batch its forward passes
    (ep_traffic.forward_passes) and its gradient (not the integer count exchanges), each in
    `ep_overlap_chunks` pieces where pipelined."""
    n = (config.n_layers - config.n_dense_layers) * micro_batches
    pipelined = ep_traffic.NODE_HOP_STAGES if "node_dispatch" in names else ep_traffic.PIPELINED_STAGES
    out = {}
    for name in names:
        calls = ep_traffic.forward_passes(name, activation_checkpoint, layout)
        calls += name not in ep_traffic.INTEGER_STAGES
        chunks = layout.ep_config.ep_overlap_chunks
        pieces = chunks if name in pipelined and chunks > 1 else 1
        out[name] = n * calls * pieces
    return out


def cp_traffic(config, layout, local_tokens: int, seq_len: int, micro_batches: int, act_bytes: int,
               gather: str) -> dict:
    """{"kv": the keys' all-gather forward + reduce-scatter backward, "positions": their all-gather
    (only --cp-gather expanded; the latent version derives key positions locally)} (Links), every
    layer and micro-batch."""
    if layout.cp == 1:
        return {"kv": Link(), "positions": Link()}
    mla = config.attn == "mla"
    if gather == "latent":
        values = config.kv_lora_rank + config.qk_rope_head_dim if mla else 2 * config.n_kv_heads * config.head_dim
    elif mla:
        values = config.n_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    else:
        values = config.n_heads * 2 * config.head_dim
    size, stride = groups(layout)["cp"]
    per_step = config.n_layers * micro_batches
    kv = all_gather(local_tokens * values * act_bytes, size, stride).scale(2 * per_step)  # keys, their gradients
    positions = Link() if gather == "latent" else all_gather(seq_len // layout.cp * 8, size, stride).scale(per_step)
    return {"kv": kv, "positions": positions}


def sync_count(config, layout, micro_batches: int, activation_checkpoint: str = "none") -> int:
    """1 per step + under EP the dispatch's split-size readbacks per MoE layer and micro-batch
    (parallel/ep/plan.host_syncs_per_layer: direct and overlapped 1, dedup 2, fixed capacity 0), twice
    when "full" checkpointing reruns the whole MoE layer (a "selective" recompute of the experts reuses
    the split sizes read before their call, and reads again those read inside it: the pieces'
    (parallel/ep/pieces.py: 1; with dedup each piece's fan-out: n); any recompute with
    parallel.ep_recompute = "keep" reads none)."""
    from parallel.ep.plan import host_syncs_per_layer

    ep = layout.ep_config
    per_layer = host_syncs_per_layer(ep)
    if ep.ep_recompute == "resend" and activation_checkpoint == "full":  # "keep": replayed (parallel/ep/keep.py)
        per_layer *= 2
    elif ep.ep_recompute == "resend" and activation_checkpoint == "selective" and ep.ep_overlap_chunks > 1:
        per_layer += ep.ep_overlap_chunks if ep.ep_dedup else 1  # read inside the experts' call
    return 1 + (layout.ep > 1) * (config.n_layers - config.n_dense_layers) * micro_batches * per_layer


def memory_bytes(model, config, layout, units, local_tokens: int, act_bytes: int, grad_sync: str = "every",
                 param_bytes: int = 4, activation_checkpoint: str = "full",
                 ep_nodes_per_token: float = 1.0) -> dict:
    """Per GPU (module docstring): states of the local shards, two unsharded units (in param_bytes),
    activations (with parallel.ep_recompute = "keep", every MoE layer's kept all-to-all buffers per
    micro-batch, parallel/ep/keep.kept_bytes_per_layer), and with grad_sync="last" the unsharded fp32
    gradients of every unit."""
    from models.splits import muon_splits

    muon = muon_splits(model)
    states = 0.0
    for name, p in model.named_parameters():
        expert = ".experts." in name
        shards = layout.ep * layout.edp_shard if expert else layout.dp_shard * layout.cp
        states += p.numel() / shards * (4 + 4 + (4 if name in muon else 8))
    gathered = 2 * max(sum(math.prod(s) // (layout.ep if mesh == "expert" else 1) for s in shapes) * param_bytes
                       for mesh, shapes in units)
    c = config
    n_moe = c.n_layers - c.n_dense_layers
    activations = activation_bytes(c, local_tokens, c.n_layers, activation_checkpoint, act_bytes)
    if layout.ep > 1 and layout.ep_config.keep and activation_checkpoint != "none":  # parallel/ep/keep.py
        from parallel.ep.keep import kept_bytes_per_layer

        activations += n_moe * kept_bytes_per_layer(local_tokens, c, layout.ep_config, act_bytes,
                                                    ep_nodes_per_token)
    unsharded_grads = 0.0
    if grad_sync == "last":
        unsharded_grads = 4.0 * sum(math.prod(s) // (layout.ep if mesh == "expert" else 1)
                                    for mesh, shapes in units for s in shapes)
    return {"states": states, "gathered_units": gathered, "activations": activations,
            "unsharded_grads": unsharded_grads, "total": states + gathered + activations + unsharded_grads}


def project_layout(config_job, layout, device, rates: dict, opts: "Options", optimizer=True) -> dict:
    """Every number of one row of the table (module docstring), per rank and step."""
    from models import Transformer

    c = config_job.model
    micro = config_job.training.grad_accum
    grad_sync = opts.grad_sync or config_job.training.grad_sync
    seq = config_job.data.seq_len
    tokens = config_job.data.tokens_per_step()
    local_tokens = tokens // (layout.world_size * micro)  # per rank and micro-batch (dp x cp = world)
    dtypes = resolved(config_job, opts)
    act_bytes = DTYPE_BYTES[dtypes["act_dtype"]]
    with torch.device("meta"):
        model = Transformer(c)
    units = fsdp_units(model)
    fsdp = fsdp_traffic(units, layout, c, micro, param_bytes=DTYPE_BYTES[dtypes["param_dtype"]],
                        grad_bytes=DTYPE_BYTES[dtypes["reduce_dtype"]], grad_sync=grad_sync)
    checkpointing = dtypes["activation_checkpoint"]
    ep_stages, nodes_per_token = ep_links(c, layout, local_tokens, micro, act_bytes, checkpointing)
    ep = sum(ep_stages.values(), Link())
    cp_parts = cp_traffic(c, layout, local_tokens, seq, micro, act_bytes, opts.cp_gather)
    cp = cp_parts["kv"] + cp_parts["positions"]
    split = {k: v * tokens / layout.world_size for k, v in flops_split(c, seq).items()}
    recompute = {k: v * tokens / layout.world_size for k, v in recompute_flops(c, seq, checkpointing).items()}
    recompute_s = sum(v / rates[k] for k, v in recompute.items())  # on the critical path, in backward
    compute = (split["dense"] / rates["matmul_bf16"] + split["experts"] / rates["grouped_mm_bf16"]
               + split["attention"] / rates["attention_bf16"]) + recompute_s
    fsdp_total = sum((v for m in fsdp.values() for v in m.values()), Link())
    opt_s = optimizer_step_s(c, degrees_only(layout), device) if optimizer else 0.0
    syncs = sync_count(c, layout, micro, checkpointing)
    shapes = {"micro": micro, "checkpointing": checkpointing, "expert_s": split["experts"] / rates["grouped_mm_bf16"],
              "fsdp_collectives": 3 * len(units) * micro, "cp_collectives": 2 * c.n_layers * micro * (layout.cp > 1)}
    times = {skew: step_times(c, layout, device, opts, compute, ep_stages, fsdp_total, cp, shapes, skew)
             for skew in (1.0, SKEW_LOW)}
    sync_s = syncs * fitted().sync_s
    t = times[1.0] | {"recompute": recompute_s, "optimizer": opt_s, "syncs": sync_s}
    t["step"] += opt_s + sync_s
    step = t["step"]
    per_gpu = tokens / layout.world_size
    band = bands.band(per_gpu / step)
    skewed = per_gpu / (times[SKEW_LOW]["step"] + opt_s + sync_s)
    flops = sum(split.values())
    memory = memory_bytes(model, c, layout, units, local_tokens, act_bytes, grad_sync,
                          DTYPE_BYTES[dtypes["param_dtype"]], dtypes["activation_checkpoint"], nodes_per_token)
    gb = lambda link: {"intra_gb": link.intra / 1e9, "inter_gb": link.inter / 1e9}  # noqa: E731
    return {
        "layout": describe(layout), "world": layout.world_size, "tokens_per_step": tokens, "micro_batches": micro,
        "grad_sync": grad_sync,
        "model_tflop_per_gpu": flops / 1e12, "flops_split_tflop": {k: v / 1e12 for k, v in split.items()},
        "hardware_tflop_per_gpu": (flops + sum(recompute.values())) / 1e12,
        "fsdp": {m: {k: gb(v) for k, v in d.items()} for m, d in fsdp.items()},
        "dispatch": dispatch_knobs(layout), "ep_nodes_per_token": nodes_per_token,
        "ep": gb(ep), "cp": gb(cp), "cp_parts": {k: gb(v) for k, v in cp_parts.items()}, "host_syncs": syncs,
        "time_s": t, "mfu": flops / (step * device.peak_tflops * 1e12),
        "tokens_per_gpu_s_band": band, "mfu_band": tuple(b * flops / per_gpu / (device.peak_tflops * 1e12) for b in band),
        "band_rests_on": bands.RESTS_ON, "tokens_per_gpu_s_skew_1_2": skewed, "cpu_paths": cpu_paths(layout),
        "memory_gib": {k: v / 2**30 for k, v in memory.items()},
        "fits": memory["total"] <= FIT_FRACTION * opts.memory_gib * 2**30,
    }


def step_times(c, layout, device, opts, compute: float, ep_stages: dict, fsdp_total, cp, shapes: dict,
               skew: float) -> dict:
    """The time terms of one row (module docstring) with the busiest EP rank at `skew` x the mean bytes
    and routed-expert compute; without the optimizer and host syncs."""
    compute = compute + (skew - 1) * shapes["expert_s"]
    stages = {name: link.scale(skew) for name, link in ep_stages.items()}
    peers = inter_peers(c, layout)
    collectives = ep_collectives(c, layout, shapes["micro"], shapes["checkpointing"], stages)
    serial = ep_seconds(stages, device, shapes["expert_s"] * skew, 1, peers, collectives)
    ep_s = ep_seconds(stages, device, shapes["expert_s"] * skew, layout.ep_config.ep_overlap_chunks, peers,
                    collectives)
    cp_s = max(_link_seconds(cp, device)) + shapes["cp_collectives"] * net.LATENCY_S
    fsdp_nvlink_s, fsdp_network_s = _link_seconds(fsdp_total, device)
    fsdp_network_s += shapes["fsdp_collectives"] * net.LATENCY_S
    ep_network_s = sum(net.all_to_all_links_s(device, 0.0, link.inter, "nccl", peers, max(1, collectives[name]))[1]
                       for name, link in stages.items())
    nvlink_s = _link_seconds(fsdp_total + sum(stages.values(), Link()) + cp, device)[0]
    network_s = fsdp_network_s + ep_network_s + _link_seconds(cp, device)[1]  # all traffic shares the NIC
    hidden = max(0.0, serial - ep_s) if not opts.overlap_ep else min(compute, ep_s + cp_s)
    contended = net.contended_compute_s(compute, hidden + min(compute, max(fsdp_nvlink_s, fsdp_network_s)))
    exposed = contended + ep_s + cp_s if not opts.overlap_ep else max(contended, ep_s + cp_s)
    return {"compute": compute, "compute_contended": contended, "ep": ep_s, "ep_serial": serial, "cp": cp_s,
            "fsdp_nvlink": fsdp_nvlink_s, "fsdp_network": fsdp_network_s, "all_nvlink": nvlink_s,
            "all_network": network_s, "step": max(exposed, nvlink_s, network_s)}


def cpu_paths(layout) -> list[str]:
    """The CPU-tested runtime paths a row's figure depends on (their tests count its bytes and syncs)."""
    knobs = dispatch_knobs(layout)
    paths = ["parallel/fsdp.py (tests/ranks/test_step_projection.py: FSDP bytes)", "optim/sharded (the Muon step)"]
    if layout.ep > 1:
        paths.append("parallel/ep/plan.py (tests/ranks/test_ep_dispatch.py: EP bytes)")
    paths += ["parallel/ep/dedup.py"] * knobs["ep_dedup"]
    paths += ["parallel/ep/pieces.py"] * (knobs["ep_overlap_chunks"] > 1)
    paths += ["parallel/ep/direct.py (FP8 rows)"] * (knobs["ep_dispatch_dtype"] != "compute")
    paths += ["parallel/ep/keep.py"] * (knobs.get("ep_recompute") == "keep")
    return paths


def resolved(job, opts: "Options") -> dict:
    """The dtypes and checkpointing the projection uses: the flag when given, else the config's."""
    t = job.training
    return {"param_dtype": opts.param_dtype or t.param_dtype, "act_dtype": opts.act_dtype or t.param_dtype,
            "reduce_dtype": opts.reduce_dtype or t.reduce_dtype,
            "activation_checkpoint": opts.activation_checkpoint or t.activation_checkpoint}


def _link_seconds(link: Link, device) -> tuple[float, float]:
    """(NVLink seconds, network seconds) of one rank's bytes in ring collectives (FSDP, CP)."""
    return (link.intra / (device.nvlink_line_gbs * 1e9 * net.NVLINK_EFFICIENCY),
            link.inter / (device.nic_line_gbs * 1e9 * net.RING_EFFICIENCY))


def inter_peers(config, layout) -> int:
    """Ranks of rank 0's ep group on other nodes (the peers an all-to-all's inter-node bytes split over)."""
    if layout.ep == 1:
        return 1
    placement = ep_placement(config, layout)
    return max(1, layout.ep - len(placement.members(placement.node_of_rank[0])))


def describe(layout) -> str:
    inner = "" if layout.expert_inner == "ep" or min(layout.ep, layout.edp_shard) == 1 else " (edp_shard inner)"
    return (f"dense {layout.dp_replicate}x{layout.dp_shard}x{layout.cp} | experts "
            f"{layout.edp_replicate}x{layout.edp_shard}x{layout.ep}{inner}")


def compute_rates(device, calibration: str | None) -> dict:
    """FLOP/s per kind of compute: measured (gpu_check "rates_tflops") where given, else the fitted shares of the
    bf16 peak (planning/parameters.py)."""
    eff = fitted()
    shares = {"matmul_bf16": eff.gemm, "grouped_mm_bf16": eff.grouped, "attention_bf16": eff.attention}
    rates = {k: f * device.peak_tflops * 1e12 for k, f in shares.items()}
    if calibration:
        measured = read_calibration(calibration).get("rates_tflops", {})
        rates.update({k: v * 1e12 for k, v in measured.items() if k in rates})
    return rates


EP_CANDIDATES = (8, 32, 64, 128, 256)


def candidate_layouts(job, world: int, base) -> dict:
    """{name: Layout} users would consider at `world` GPUs: dense FSDP inside a node (dp_shard=8)
    replicated across nodes, and experts with ep inside a node (8) or across 4, 8, 16... nodes,
    each with expert FSDP over the rest (edp_shard = world / ep), numbered with ep innermost (name
    "ep<N>") and with edp_shard innermost ("ep<N>_shard_inner", when both degrees exceed 1), plus
    `base` (the config's own, when it resolves at this world size). A layout the runtime refuses (its own
    checks of the model, batch and micro-batches) is not a candidate."""
    from parallel.layout import ParallelConfig

    E = job.model.n_routed_experts
    out = {}
    if base is not None:
        out["config"] = base
    for ep in EP_CANDIDATES:
        if E % ep or world % ep or ep > world or world % 8:
            continue
        for inner in ("ep", "edp_shard") if 1 < ep < world else ("ep",):
            parallel = ParallelConfig(dp_replicate=world // 8, dp_shard=8, cp=1, ep=ep, edp_replicate=1,
                                      edp_shard=world // ep, expert_inner=inner)
            try:
                layout = dataclasses.replace(job, parallel=parallel).layout(world)
            except ValueError:
                continue
            if layout != base:  # the config's own is listed once, as "config"
                out[f"ep{ep}" + ("_shard_inner" if inner == "edp_shard" else "")] = layout
    return out


def scaled_job(job, world: int, config_world: int):
    """The job with the same tokens per GPU and micro-batches at `world` GPUs (weak scaling)."""
    batch = job.data.batch_size * world // config_world
    return dataclasses.replace(job, data=dataclasses.replace(job.data, batch_size=batch))


