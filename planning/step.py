"""One training step of a layout with pipeline (PP), tensor (TP) and expert (EP) parallelism and ZeRO-1 or
FSDP data parallelism: how published runs ran (planning/calibration/) and PP layouts the runtime does not
implement (planning/pipeline.py).

Per GPU and step, `step_terms(run, efficiency)` (ranks: tp innermost, then cp and the data-parallel ranks of a
stage, then pp; ep folds over a stage's tp x dp x cp ranks, consecutive, so an EP group of ep ranks spans
ceil(ep / gpus_per_node) nodes). Each pipeline rank is charged the work of its own stages (planning/stages.py:
its layers, and the embedding, the output head and loss, the multi-token-prediction modules where its stages hold
them); the slowest rank sets the pace, and the terms are its:
  compute   its FLOPs (the forward of each of its blocks x 3, planning/flops.py; the head 6 V D per token) by kernel
            class (GEMMs, the routed experts' grouped GEMMs, attention), each at its share of the bf16 peak
            (`Efficiency`, fitted on the published runs: planning/parameters.py); FP8 GEMMs (gemm_precision "fp8",
            or "fp8_experts" for the routed experts' only) x Efficiency.fp8_speedup; + what activation
            checkpointing reruns; the routed experts' part x skew; all / Efficiency.eager on a plain-PyTorch kernel
            stack (kernels "eager": torch._grouped_mm, SDPA, unfused norms and activations; "fused": Transformer
            Engine, cuDNN attention, fused permutation and cross-entropy). Beside the FLOPs, every micro-batch
            moves each weight the rank holds through HBM, WEIGHT_BYTES per parameter (+2 per recompute), at the
            datasheet's HBM rate: the per-micro-batch cost that makes small micro-batches and thin expert shards
            slow (a grouped GEMM of a few hundred rows per expert is bound by its weights, not its FLOPs)
  ep        per MoE layer (the multi-token-prediction modules' included) and micro-batch: dispatch + combine
            all-to-alls forward (again in a recompute that reruns the experts) and their gradients backward. Rows
            from the routing (`routing_rows`): "nccl" sends one row per token copy; "deepep" one per destination
            node over the NIC and one per destination rank over NVLink (DeepEP's forwarding); dispatch_precision
            "fp8" sends D + 4 bytes per row in the forward dispatch (and its recompute), else 2 D; x skew (the
            busiest rank receives skew x the mean). Seconds by planning/network.py (NCCL by message size per peer,
            DeepEP from its table)
  tp        sequence-parallel all-gathers and reduce-scatters around each TP region (the attention; the FFN of
            dense layers), one all-reduce's bytes forward, one backward (+1 per full recompute), over NVLink, exposed
  fsdp      fsdp_gather "per_microbatch": all-gathers of the stage's parameter shards forward and backward in
            bf16 and a reduce-scatter of fp32 gradients, every micro-batch; "per_step": one all-gather and one
            reduce-scatter per step (the stack keeps parameters gathered across the step's micro-batches);
            "default": per_step when pp > 1, else per_microbatch (torchtitan's rule). zero1: one fp32
            reduce-scatter and one bf16 all-gather per step, at the step's end (exposed)
  pp        the schedule's bubble on top of the slowest rank's busy time: 1f1b (pp - 1) / m, interleaved
            (pp - 1) / (v m), dualpipe (pp / 2 - 1)(F + B / 2) / (m (F + B)) = (pp / 2 - 1) 2 / (3 m)
            (DeepSeek-V3 report, W = B / 2, B = 2 F); activations point-to-point ride beside it
  syncs     a host sync per MoE layer, micro-batch and forward pass (the dispatch's split sizes), each idling
            the device Efficiency.sync_s (fitted: the sync and the launches behind it)
Overlap: ep_overlap "none" keeps the all-to-alls on the critical path (an all_to_all between compute kernels);
"microbatch" hides them behind another micro-batch's compute (Megatron's overlap_moe_expert_parallel_comm,
DualPipe's paired forward and backward chunks; pp_schedule "dualpipe" implies it), which then runs contended
(network.contended_compute_s). FSDP traffic runs beside compute (contended) and shares the NIC with the
all-to-alls: only what does not fit in the NIC's idle time is exposed.
Multi-token prediction (`mtp_layers`) costs time, not model FLOPs (the published accounting).
Not modelled: memory per stage beyond the coarse formula, CP's ring attention, pipeline point-to-point traffic.
"""

import functools
import math
from dataclasses import dataclass

from planning import network as net
from planning.ep_traffic import routing_rows
from planning.flops import RATE, RECOMPUTED, block_parts
from planning.fsdp_traffic import peers
from planning.memory.coarse import activation_bytes
from planning.parameters import Efficiency, fitted
from planning.stages import RankLoad, rank_loads

SCHEDULES = ("1f1b", "interleaved", "dualpipe")
CHECKPOINTING = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp8", "fp8_experts")  # GEMMs in FP8: all, or the routed experts' grouped GEMMs only
DISPATCH_PRECISIONS = ("bf16", "fp8")
EP_OVERLAPS = ("none", "microbatch")
FSDP_GATHERS = ("default", "per_step", "per_microbatch")
ROUTINGS = ("sampled", "aligned_blocks")
KERNELS = ("fused", "eager")


@dataclass(frozen=True)
class Run:
    """One training run: cluster, model, step and layout (the case file's sections, planning/calibration/case.py)."""
    model: object  # models.config.ModelConfig
    device: object  # planning.devices.DeviceModel
    gpus: int
    gpus_per_node: int
    seq_len: int
    global_batch: int  # sequences per step
    micro_batch: int  # sequences per micro-batch and data-parallel replica
    gemm_precision: str = "bf16"
    dispatch_precision: str | None = None  # None: "fp8" when gemm_precision is "fp8", else "bf16"
    dispatcher: str = "nccl"
    activation_checkpoint: str = "none"
    ep_overlap: str = "none"
    routing: str = "sampled"  # the model's own router on random inputs, or "aligned_blocks" (`routing_rows`)
    skew: float = 1.0
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp_sharding: str = "fsdp"
    fsdp_gather: str = "default"
    mtp_layers: int = 0  # multi-token-prediction modules trained beside the model (time, not model FLOPs)
    kernels: str = "fused"
    pipeline_layout: str | None = None  # planning/stages.py: None (the default split), "balanced" or Megatron's

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def dispatch_fp8(self) -> bool:
        return (self.dispatch_precision or ("fp8" if self.gemm_precision == "fp8" else "bf16")) == "fp8"

    @property
    def overlaps_ep(self) -> bool:
        return self.ep_overlap == "microbatch" or (self.pp_schedule == "dualpipe" and self.pp > 1)

    @property
    def gathers_per_step(self) -> bool:
        return self.fsdp_gather == "per_step" or (self.fsdp_gather == "default" and self.pp > 1)


def check_run(r: Run) -> None:
    """ValueError naming the key and every number when the layout cannot run as given."""
    c = r.model
    if r.gpus % r.gpus_per_node:
        raise ValueError(f"cluster.gpus = {r.gpus} is not a multiple of cluster.gpus_per_node = {r.gpus_per_node}")
    if r.gpus % (r.tp * r.pp * r.cp):
        raise ValueError(f"layout tp x pp x cp = {r.tp} x {r.pp} x {r.cp} = {r.tp * r.pp * r.cp} does not divide "
                         f"cluster.gpus = {r.gpus}")
    if r.pp * r.virtual_stages > c.n_layers + 2:  # the embedding and the loss may take a stage each (Megatron)
        raise ValueError(f"layout.pp x virtual_stages = {r.pp} x {r.virtual_stages} exceeds the model's "
                         f"{c.n_layers} layers (+ 2: the embedding and the loss as pipeline layers)")
    if r.tp > r.gpus_per_node:
        raise ValueError(f"layout.tp = {r.tp} exceeds cluster.gpus_per_node = {r.gpus_per_node} (TP runs over NVLink)")
    if c.n_routed_experts % (r.ep * r.etp) or (r.dp * r.cp * r.tp) % (r.ep * r.etp):
        raise ValueError(f"layout.ep x etp = {r.ep} x {r.etp} must divide the {c.n_routed_experts} experts and a "
                         f"stage's {r.dp * r.cp * r.tp} GPUs (dp x cp x tp)")
    if r.global_batch % (r.dp * r.micro_batch):
        raise ValueError(f"step.global_batch = {r.global_batch} is not a multiple of data-parallel degree {r.dp} "
                         f"x step.micro_batch = {r.micro_batch}")
    if r.pipeline_layout not in (None, "balanced"):
        rank_loads(r.pipeline_layout, r.pp, r.virtual_stages, c.n_layers, r.mtp_layers, False)
    if r.pp_schedule == "dualpipe" and r.virtual_stages != 1:  # planning/stages.py: stages i and pp - 1 - i a rank
        raise ValueError(f"layout.pp_schedule = \"dualpipe\" runs two stages on each rank by itself: "
                         f"layout.virtual_stages must be 1 (got {r.virtual_stages})")
    if r.pp_schedule == "dualpipe" and (r.pp % 2 or r.micro_batches < r.pp):
        raise ValueError(f"layout.pp_schedule = \"dualpipe\" needs an even pp (got {r.pp}) and at least pp "
                         f"micro-batches per replica (got {r.micro_batches})")


# ---- what a step does, independent of the fitted parameters (computed once per run) --------------------

@functools.lru_cache(maxsize=None)
def work(r: Run) -> dict:
    """What one GPU does in a step, independent of the fitted parameters: per pipeline rank (`ranks`, the distinct
    loads of planning/stages.py) its FLOPs by kernel class, EP exchanges, TP bytes and host syncs; the GPU's FSDP
    and ZeRO-1 bytes, the bubble, the model FLOPs and the tokens per GPU."""
    from runtime.metrics import flops_per_token

    tokens = r.global_batch * r.seq_len / r.gpus
    loads = rank_loads(r.pipeline_layout, r.pp, r.virtual_stages, r.model.n_layers, r.mtp_layers,
                       r.pp_schedule == "dualpipe" and r.pp > 1)
    distinct = {load: loads.count(load) for load in loads}
    return {"tokens": tokens, "model_flops": flops_per_token(r.model, r.seq_len) * tokens,
            "ranks": [rank_work(r, load) | {"count": n} for load, n in distinct.items()],
            "data_parallel": data_parallel_bytes(r), "bubble": bubble_fraction(r)}


def rank_work(r: Run, load: RankLoad) -> dict:
    """FLOPs by kernel class, HBM weight bytes, EP exchanges, TP bytes and host syncs of one pipeline rank's step:
    its layers (their forward x 3, + what activation checkpointing reruns), multi-token-prediction modules and
    output head, over every micro-batch of its replica."""
    c = r.model
    tokens = r.micro_batches * r.micro_batch * r.seq_len / (r.cp * r.tp)  # through this rank's layers, per GPU
    parts = block_parts(c, r.seq_len)
    flops = dict.fromkeys(("gemm", "grouped", "attention"), 0.0)
    weights = 0.0  # HBM bytes of weights and weight gradients per micro-batch
    for layer, share in load.layers:
        for part, f in parts[layer].items():
            reruns = part in RECOMPUTED[r.activation_checkpoint]
            flops[CLASS[RATE[part]]] += share * f * (3 + reruns)
            weights += share * held_params(c, part, f, r.tp, r.ep * r.etp) * (WEIGHT_BYTES + 2 * reruns)
    flops["gemm"] += load.head * 6 * c.vocab_size * c.dim
    for kind, f in mtp_flops(c, r.seq_len).items():
        flops[CLASS[kind]] += load.mtp * f
    head = c.vocab_size * c.dim / r.tp
    mtp = sum(held_params(c, part, f, r.tp, r.ep * r.etp) for part, f in parts[-1].items())
    mtp += 2 * c.dim * c.dim / r.tp  # the module's 2D -> D projection
    weights += (load.head * head + load.mtp * mtp) * WEIGHT_BYTES
    moe = sum(share for layer, share in load.layers if layer >= c.n_dense_layers) + load.mtp
    dense = sum(share for layer, share in load.layers if layer < c.n_dense_layers)
    exchanges, syncs = ep_exchanges(r, moe)
    return {"flops": {k: v * tokens for k, v in flops.items()}, "weight_bytes": weights * r.micro_batches,
            "ep": exchanges, "syncs": syncs, "tp": tp_bytes(r, moe + 2 * dense)}


def held_params(config, part: str, forward_flops: float, tp: int, ep: int) -> float:
    """Parameters of one block part (planning/flops.block_parts: forward FLOPs per token) one GPU holds: the routed
    experts' all E (2 FLOPs per active parameter, K of E active) over ep (x etp), the rest over tp; the SDPA none."""
    if part == "sdpa":
        return 0.0
    if part == "routed":
        return forward_flops / 2 * config.n_routed_experts / config.n_activated_experts / ep
    return forward_flops / 2 / tp


def weight_bytes(config, seq_len: int, tp: int, ep: int, activation_checkpoint: str) -> float:
    """HBM bytes of the weights one GPU holds, moved by one micro-batch through every layer and the output head
    (WEIGHT_BYTES per parameter, +2 where activation checkpointing reruns the part): the runtime's dual-mesh
    projection (planning/dual_mesh.py), whose ranks each run every layer."""
    total = config.vocab_size * config.dim / tp * WEIGHT_BYTES
    for parts in block_parts(config, seq_len):
        for part, f in parts.items():
            reruns = part in RECOMPUTED[activation_checkpoint]
            total += held_params(config, part, f, tp, ep) * (WEIGHT_BYTES + 2 * reruns)
    return total


# HBM bytes per weight and micro-batch: read in bf16 forward, again for the input gradient, and the weight gradient
# accumulated into fp32 (read + write: Megatron's gradient_accumulation_fusion, FSDP's fp32 gradient accumulation)
WEIGHT_BYTES = 2 + 2 + 8
CLASS = {"matmul_bf16": "gemm", "grouped_mm_bf16": "grouped", "attention_bf16": "attention"}  # flops.RATE -> class


def mtp_flops(config, seq_len: int) -> dict:
    """Training FLOPs per token of one multi-token-prediction module by rate (DeepSeek-V3 report, section 2.2): one
    more MoE block, its 2D -> D projection and the (shared) output head, forward and backward."""
    out = {}
    for part, f in block_parts(config, seq_len)[-1].items():
        out[RATE[part]] = out.get(RATE[part], 0.0) + 3 * f
    out["matmul_bf16"] += 6 * (2 * config.dim * config.dim + config.vocab_size * config.dim)
    return out


def ep_exchanges(r: Run, moe_layers: float) -> tuple[list, int]:
    """([(intra bytes, inter bytes, calls) per step of each all-to-all kind], host syncs per step) of a pipeline
    rank running `moe_layers` MoE layers: one host sync per MoE layer, micro-batch and forward pass (the dispatch's
    split sizes)."""
    if r.ep == 1:
        return [], 0
    c = r.model
    rows = routing_rows(c, r.ep, r.gpus_per_node, r.routing)
    tokens = r.micro_batch * r.seq_len / (r.cp * r.tp)  # per GPU and micro-batch (TP: sequence-parallel split)
    row = 2 * c.dim
    dispatch_row = c.dim + 4 if r.dispatch_fp8 else row
    if r.dispatcher == "deepep":  # one row per destination node over the NIC, one per destination rank over NVLink
        inter_rows, intra_rows = rows["nodes_inter"], rows["ranks_intra"] + rows["ranks_inter"]
    else:
        inter_rows, intra_rows = rows["copies_inter"], rows["copies_intra"]
    reruns = 1 if r.activation_checkpoint in ("full", "selective") else 0
    sizes = [dispatch_row, row] * (1 + reruns) + [row, row]  # forward (+ recompute), then the gradients
    layers = moe_layers * r.micro_batches
    out = [(layers * tokens * intra_rows * b * r.skew, layers * tokens * inter_rows * b * r.skew, layers)
           for b in sizes]
    return out, round(layers * (1 + reruns))


def ep_inter_peers(r: Run) -> int:
    """Ranks of an EP group on other nodes than mine (the peers an NCCL all-to-all's inter-node bytes split over)."""
    return r.ep - min(r.ep, r.gpus_per_node)


def tp_bytes(r: Run, regions: float) -> tuple[float, int]:
    """(TP's activation bytes per GPU and step, their count) of a pipeline rank with `regions` TP regions per
    micro-batch: with sequence parallelism an all-gather before and a reduce-scatter after each region, the bytes of
    one ring all-reduce each way; the attention is a TP region in every layer, the FFN only in dense layers (the
    routed experts run on EP, etp = 1); forward, backward, and the forward again under full recompute. Over
    NVLink, exposed."""
    if r.tp == 1:
        return 0.0, 0
    c = r.model
    nbytes = r.micro_batch * r.seq_len / r.cp * c.dim * 2 * 2 * (r.tp - 1) / r.tp  # one ring all-reduce, bf16
    count = regions * r.micro_batches * (2 + (1 if r.activation_checkpoint == "full" else 0))
    return count * nbytes, int(count)


@functools.lru_cache(maxsize=None)
def model_params(config) -> tuple[float, float]:
    """(all parameters, routed-expert parameters) of the model."""
    from models import count_params

    total, _ = count_params(config)
    return total, 3 * config.dim * config.moe_inter_dim * config.n_routed_experts * config.n_moe_layers


def stage_params(r: Run) -> tuple[float, float]:
    """(dense, expert) parameters one GPU holds before data-parallel sharding (its stage's, / tp, / ep x etp)."""
    total, expert = model_params(r.model)
    return (total - expert) / (r.pp * r.tp), expert / (r.pp * r.ep * r.etp)


def data_parallel_bytes(r: Run) -> list:
    """[(intra bytes, inter bytes, nodes, count, exposed)] per GPU and step of the data-parallel collectives:
    FSDP's run beside compute (exposed False), ZeRO-1's at the step's end (module docstring)."""
    dense, expert = stage_params(r)
    groups = [(dense, r.dp * r.cp, r.tp), (expert, r.dp * r.cp * r.tp // (r.ep * r.etp), r.ep * r.etp)]
    out = []
    for params, size, stride in groups:
        if size == 1:
            continue
        same, other = peers(size, stride, r.gpus_per_node)
        inter = other / (size - 1)
        if r.dp_sharding == "zero1":
            nbytes, count = params * (2 + 4) * (size - 1) / size, 2
        elif r.gathers_per_step:  # all-gather once in bf16, reduce-scatter fp32 once
            nbytes, count = params * (2 + 4) * (size - 1) / size, 2
        else:  # all-gather bf16 twice, reduce-scatter fp32, every micro-batch
            nbytes, count = params * (2 * 2 + 4) * (size - 1) / size * r.micro_batches, 3 * r.micro_batches
        nodes = math.ceil(size * stride / r.gpus_per_node)
        out.append((nbytes * (1 - inter), nbytes * inter, nodes, count, r.dp_sharding == "zero1"))
    return out


def bubble_fraction(r: Run) -> float:
    """The pipeline schedule's idle time over the stage's busy time (module docstring)."""
    m = r.micro_batches
    if r.pp == 1:
        return 0.0
    if r.pp_schedule == "dualpipe":
        return (r.pp / 2 - 1) * 2 / (3 * m)
    return (r.pp - 1) / (m * (r.virtual_stages if r.pp_schedule == "interleaved" else 1))


# ---- the time, from the work and the fitted parameters -----------------------------------------------

def compute_s(r: Run, eff: Efficiency, flops: dict) -> tuple[float, float]:
    """(compute seconds of a pipeline rank's step of `flops` by kernel class, of which the routed experts')."""
    peak = r.device.peak_tflops * 1e12
    fp8_gemm = eff.fp8_speedup if r.gemm_precision == "fp8" else 1.0
    fp8_grouped = eff.fp8_speedup if r.gemm_precision in ("fp8", "fp8_experts") else 1.0
    experts = flops["grouped"] / (eff.grouped * fp8_grouped * peak) * r.skew
    rest = flops["gemm"] / (eff.gemm * fp8_gemm * peak) + flops["attention"] / (eff.attention * peak)
    stack = eff.eager if r.kernels == "eager" else 1.0
    return (experts + rest) / stack, experts / stack


def ep_s(r: Run, exchanges: list) -> float:
    """EP all-to-all seconds of a pipeline rank's step (planning/network.py)."""
    nodes = math.ceil(r.ep / r.gpus_per_node)
    return sum(net.all_to_all_s(r.device, intra, inter, r.dispatcher, ep_inter_peers(r) if nodes > 1 else 1,
                                count=round(calls)) for intra, inter, calls in exchanges)


def rank_terms(r: Run, eff: Efficiency, rank: dict, fsdp: float) -> dict:
    """The seconds one pipeline rank is busy in a step (module docstring), with the GPU's FSDP traffic beside."""
    compute, experts = compute_s(r, eff, rank["flops"])
    compute += rank["weight_bytes"] / (r.device.hbm_gbs * 1e9)
    ep = ep_s(r, rank["ep"])
    tp_nbytes, tp_count = rank["tp"]
    tp = net.ring_s(r.device, tp_nbytes, 0.0, count=tp_count) if tp_count else 0.0
    busy_compute = net.contended_compute_s(compute, (ep if r.overlaps_ep else 0.0) + min(fsdp, compute))
    core = max(busy_compute, ep) if r.overlaps_ep else busy_compute + ep
    nic_idle = core - ep  # the NIC time the all-to-alls leave to FSDP
    fsdp_exposed = max(0.0, fsdp - nic_idle)
    syncs = rank["syncs"] * eff.sync_s
    return {"compute": compute, "compute_contended": busy_compute, "experts": experts, "ep": ep, "tp": tp,
            "fsdp_exposed": fsdp_exposed, "syncs": syncs, "busy": core + tp + fsdp_exposed + syncs}


def step_terms(r: Run, eff: Efficiency | None = None) -> dict:
    """Every term of the step (seconds per GPU) and the throughput it implies (module docstring), with the fitted
    parameters unless `eff` is given (the fit and its cross-validation pass their own). The terms are the slowest
    pipeline rank's (it sets the pace; `stage_imbalance`: its busy time over the ranks' mean)."""
    eff = eff or fitted()
    w = work(r)
    fsdp = sum(net.ring_s(r.device, a, b, count=n) for a, b, _, n, exposed in w["data_parallel"] if not exposed)
    zero1 = sum(net.ring_s(r.device, a, b, count=n) for a, b, _, n, exposed in w["data_parallel"] if exposed)
    ranks = [rank_terms(r, eff, rank, fsdp) for rank in w["ranks"]]
    slowest = max(ranks, key=lambda t: t["busy"])
    busy = slowest["busy"]
    bubble = w["bubble"] * busy
    step = busy + bubble + zero1
    tokens = w["tokens"]
    mean = sum(t["busy"] * rank["count"] for t, rank in zip(ranks, w["ranks"])) / r.pp
    return {**{k: v for k, v in slowest.items() if k != "busy"}, "ep_overlapped": r.overlaps_ep, "fsdp": fsdp,
            "zero1": zero1, "bubble": bubble, "step": step, "stage_imbalance": busy / mean, "tokens_per_gpu": tokens,
            "tokens_per_gpu_s": tokens / step, "mfu_bf16": w["model_flops"] / (step * r.device.peak_tflops * 1e12),
            "memory_gib": memory_gib(r)}


def memory_gib(r: Run) -> float:
    """A coarse peak per GPU (for ranking layouts, like planning/dual_mesh.py's): bf16 weights (DualPipe: two
    copies) and fp32 gradients of the GPU's parameters, fp32 master weights and two optimizer states sharded
    over the data-parallel group (ZeRO-1) or everything over it (FSDP), and the activations of the micro-batches
    in flight on the first stage (1f1b, interleaved: pp; dualpipe: pp + 1; no PP: 1) for its layers: per token
    and layer planning/memory/coarse.py's formula."""
    c = r.model
    dense, expert = stage_params(r)
    groups = ((dense, r.dp * r.cp), (expert, max(1, r.dp * r.cp * r.tp // (r.ep * r.etp))))
    copies = 2 if r.pp_schedule == "dualpipe" and r.pp > 1 else 1
    if r.dp_sharding == "zero1":
        states = sum(p * (2 * copies + 4 + 12 / g) for p, g in groups)
    else:
        states = sum(p * (2 * copies + 4 + 12) / g for p, g in groups)
    in_flight = 1 if r.pp == 1 else r.pp + (r.pp_schedule == "dualpipe")
    tokens = r.micro_batch * r.seq_len / (r.cp * r.tp)
    activations = activation_bytes(c, tokens, c.n_layers / r.pp, r.activation_checkpoint, 2, in_flight)
    return (states + activations) / 2**30
