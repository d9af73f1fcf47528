"""One training step of a layout with pipeline (PP), tensor (TP) and expert (EP) parallelism and ZeRO-1 or
FSDP data parallelism: how published runs ran (planning/calibration/) and PP layouts the runtime does not
implement (planning/pipeline.py).

Per GPU and step, `step_terms(run, efficiency)` (ranks: tp innermost, then cp and the data-parallel ranks of a
stage, then pp; ep folds over a stage's tp x dp x cp ranks, consecutive, so an EP group of ep ranks spans
ceil(ep / gpus_per_node) nodes):
  compute   model FLOPs (runtime.metrics.flops_per_token x global tokens / GPUs) by kernel class
            (planning/flops.py: GEMMs, the routed experts' grouped GEMMs, attention), each at its share of the
            bf16 peak (`Efficiency`, fitted on the published runs: planning/parameters.py); FP8 GEMMs
            (gemm_precision "fp8", or "fp8_experts" for the routed experts' only) x Efficiency.fp8_speedup; + what
            activation checkpointing reruns and the multi-token-prediction modules; the routed experts' part x skew
  ep        per MoE layer of a stage and micro-batch: dispatch + combine all-to-alls forward (again in a
            recompute that reruns the experts) and their gradients backward. Rows from the routing
            (`routing_rows`): "nccl" sends one row per token copy; "deepep" one per destination node over the
            NIC and one per destination rank over NVLink (DeepEP's forwarding); dispatch_precision "fp8" sends
            D + 4 bytes per row in the forward dispatch (and its recompute), else 2 D; x skew (the busiest rank
            receives skew x the mean). Seconds by planning/network.py (NCCL by message size per peer, DeepEP
            from its table)
  tp        sequence-parallel all-gathers and reduce-scatters around each TP region (the attention; the FFN of
            dense layers), one all-reduce's bytes forward, one backward (+1 per full recompute), over NVLink, exposed
  fsdp      fsdp_gather "per_microbatch": all-gathers of the stage's parameter shards forward and backward in
            bf16 and a reduce-scatter of fp32 gradients, every micro-batch; "per_step": one all-gather and one
            reduce-scatter per step (the stack keeps parameters gathered across the step's micro-batches);
            "default": per_step when pp > 1, else per_microbatch (torchtitan's rule). zero1: one fp32
            reduce-scatter and one bf16 all-gather per step, at the step's end (exposed)
  pp        the schedule's bubble on top of the stage's busy time: 1f1b (pp - 1) / m, interleaved
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
Not modelled: memory per stage beyond the coarse formula, CP's ring attention.
"""

import functools
import math
from dataclasses import dataclass

import torch

from planning import network as net
from planning.flops import RATE, block_parts, flops_split, recompute_flops
from planning.fsdp_traffic import peers
from planning.memory.coarse import activation_bytes
from planning.parameters import Efficiency, fitted

SCHEDULES = ("1f1b", "interleaved", "dualpipe")
CHECKPOINTING = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp8", "fp8_experts")  # GEMMs in FP8: all, or the routed experts' grouped GEMMs only
DISPATCH_PRECISIONS = ("bf16", "fp8")
EP_OVERLAPS = ("none", "microbatch")
FSDP_GATHERS = ("default", "per_step", "per_microbatch")
ROUTINGS = ("sampled", "aligned_blocks")


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
    if r.pp_schedule == "dualpipe" and (r.pp % 2 or r.micro_batches < r.pp):
        raise ValueError(f"layout.pp_schedule = \"dualpipe\" needs an even pp (got {r.pp}) and at least pp "
                         f"micro-batches per replica (got {r.micro_batches})")


# ---- what a step does, independent of the fitted parameters (computed once per run) --------------------

@functools.lru_cache(maxsize=None)
def work(r: Run) -> dict:
    """FLOPs by kernel class, the EP exchanges, TP, FSDP and ZeRO-1 bytes, syncs and bubble of one GPU's step."""
    tokens = r.global_batch * r.seq_len / r.gpus
    split = flops_split(r.model, r.seq_len)
    flops = {"gemm": split["dense"], "grouped": split["experts"], "attention": split["attention"]}
    for kind, n in recompute_flops(r.model, r.seq_len, r.activation_checkpoint).items():
        flops[CLASS[kind]] += n
    for kind, n in mtp_flops(r.model, r.seq_len).items():
        flops[CLASS[kind]] += r.mtp_layers * n
    exchanges, syncs = ep_exchanges(r)
    from runtime.metrics import flops_per_token

    return {"tokens": tokens, "flops": {k: v * tokens for k, v in flops.items()},
            "model_flops": flops_per_token(r.model, r.seq_len) * tokens, "ep": exchanges, "syncs": syncs,
            "tp": tp_bytes(r), "data_parallel": data_parallel_bytes(r), "bubble": bubble_fraction(r)}


CLASS = {"matmul_bf16": "gemm", "grouped_mm_bf16": "grouped", "attention_bf16": "attention"}  # flops.RATE -> class


def mtp_flops(config, seq_len: int) -> dict:
    """Training FLOPs per token of one multi-token-prediction module by rate (DeepSeek-V3 report, section 2.2): one
    more MoE block, its 2D -> D projection and the (shared) output head, forward and backward."""
    out = {}
    for part, f in block_parts(config, seq_len)[-1].items():
        out[RATE[part]] = out.get(RATE[part], 0.0) + 3 * f
    out["matmul_bf16"] += 6 * (2 * config.dim * config.dim + config.vocab_size * config.dim)
    return out


@functools.lru_cache(maxsize=None)
def routing_rows(model, ep: int, gpus_per_node: int, routing: str = "sampled") -> dict:
    """Per token and MoE layer, mean over the ep ranks: {"copies_intra", "copies_inter"}: token copies to other
    GPUs of my node / to other nodes; {"ranks_intra", "ranks_inter"}: distinct other GPUs a token reaches on my
    node / on other nodes; {"nodes_inter"}: distinct other nodes it reaches. "sampled": the model's own router on
    random inputs (planning/ep_traffic.sampled_routing: group-limited where the config is); "aligned_blocks":
    token t of every rank goes to experts K t .. K t + K - 1 (mod E), one aligned block of K experts (NeMo
    AutoModel's fake balanced gate)."""
    from planning.ep_traffic import sampled_routing

    E, K = model.n_routed_experts, model.n_activated_experts
    if routing == "aligned_blocks":
        block_TK = (K * torch.arange(E // math.gcd(E, K))[:, None] + torch.arange(K)) % E  # one cycle of blocks
        routed = [block_TK] * ep
    else:
        routed = sampled_routing(model, ep)
    local = E // ep
    node_of = torch.arange(ep) // gpus_per_node
    out = dict.fromkeys(("copies_intra", "copies_inter", "ranks_intra", "ranks_inter", "nodes_inter"), 0.0)
    for p, experts_TK in enumerate(routed):
        rank_TK = experts_TK // local
        remote_TK = node_of[rank_TK] != node_of[p]
        out["copies_intra"] += ((~remote_TK) & (rank_TK != p)).float().sum(1).mean().item()
        out["copies_inter"] += remote_TK.float().sum(1).mean().item()
        ranks = torch.zeros(experts_TK.shape[0], ep, dtype=torch.bool).scatter_(1, rank_TK, True)
        ranks[:, p] = False
        mine = node_of == node_of[p]
        out["ranks_intra"] += ranks[:, mine].float().sum(1).mean().item()
        out["ranks_inter"] += ranks[:, ~mine].float().sum(1).mean().item()
        nodes = torch.zeros(experts_TK.shape[0], int(node_of.max()) + 1, dtype=torch.bool)
        nodes.scatter_(1, node_of[rank_TK], True)
        nodes[:, node_of[p]] = False
        out["nodes_inter"] += nodes.float().sum(1).mean().item()
    return {k: v / ep for k, v in out.items()}


def ep_exchanges(r: Run) -> tuple[list, int]:
    """([(intra bytes, inter bytes, calls) per step of each all-to-all kind], host syncs per step): one host sync
    per MoE layer, micro-batch and forward pass (the dispatch's split sizes)."""
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
    layers = (c.n_layers - c.n_dense_layers) * r.micro_batches / r.pp
    out = [(layers * tokens * intra_rows * b * r.skew, layers * tokens * inter_rows * b * r.skew, layers)
           for b in sizes]
    return out, round(layers * (1 + reruns))


def ep_inter_peers(r: Run) -> int:
    """Ranks of an EP group on other nodes than mine (the peers an NCCL all-to-all's inter-node bytes split over)."""
    return r.ep - min(r.ep, r.gpus_per_node)


def tp_bytes(r: Run) -> tuple[float, int]:
    """(TP's activation bytes per GPU and step, their count): with sequence parallelism an all-gather before and a
    reduce-scatter after each TP region, the bytes of one ring all-reduce each way; the attention is a TP region in
    every layer, the FFN only in dense layers (the routed experts run on EP, etp = 1); forward, backward, and the
    forward again under full recompute. Over NVLink, exposed."""
    if r.tp == 1:
        return 0.0, 0
    c = r.model
    nbytes = r.micro_batch * r.seq_len / r.cp * c.dim * 2 * 2 * (r.tp - 1) / r.tp  # one ring all-reduce, bf16
    regions = (c.n_layers + c.n_dense_layers) / r.pp * r.micro_batches
    count = regions * (2 + (1 if r.activation_checkpoint == "full" else 0))
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

def compute_s(r: Run, eff: Efficiency) -> tuple[float, float]:
    """(compute seconds per GPU and step, of which the routed experts')."""
    w = work(r)["flops"]
    peak = r.device.peak_tflops * 1e12
    fp8_gemm = eff.fp8_speedup if r.gemm_precision == "fp8" else 1.0
    fp8_grouped = eff.fp8_speedup if r.gemm_precision in ("fp8", "fp8_experts") else 1.0
    experts = w["grouped"] / (eff.grouped * fp8_grouped * peak) * r.skew
    rest = w["gemm"] / (eff.gemm * fp8_gemm * peak) + w["attention"] / (eff.attention * peak)
    return experts + rest, experts


def ep_s(r: Run) -> float:
    """EP all-to-all seconds per GPU and step (planning/network.py)."""
    nodes = math.ceil(r.ep / r.gpus_per_node)
    return sum(net.all_to_all_s(r.device, intra, inter, r.dispatcher, ep_inter_peers(r) if nodes > 1 else 1,
                                count=round(calls)) for intra, inter, calls in work(r)["ep"])


def step_terms(r: Run, eff: Efficiency | None = None) -> dict:
    """Every term of the step (seconds per GPU) and the throughput it implies (module docstring), with the fitted
    parameters unless `eff` is given (the fit and its cross-validation pass their own)."""
    eff = eff or fitted()
    w = work(r)
    compute, experts = compute_s(r, eff)
    ep = ep_s(r)
    tp_nbytes, tp_count = w["tp"]
    tp = net.ring_s(r.device, tp_nbytes, 0.0, count=tp_count) if tp_count else 0.0
    fsdp = sum(net.ring_s(r.device, a, b, count=n) for a, b, _, n, exposed in w["data_parallel"] if not exposed)
    zero1 = sum(net.ring_s(r.device, a, b, count=n) for a, b, _, n, exposed in w["data_parallel"] if exposed)
    busy_compute = net.contended_compute_s(compute, (ep if r.overlaps_ep else 0.0) + min(fsdp, compute))
    core = max(busy_compute, ep) if r.overlaps_ep else busy_compute + ep
    nic_idle = core - ep  # the NIC time the all-to-alls leave to FSDP
    fsdp_exposed = max(0.0, fsdp - nic_idle)
    busy = core + tp + fsdp_exposed + w["syncs"] * eff.sync_s
    bubble = w["bubble"] * busy
    step = busy + bubble + zero1
    tokens = w["tokens"]
    return {"compute": compute, "compute_contended": busy_compute, "experts": experts, "ep": ep,
            "ep_overlapped": r.overlaps_ep, "tp": tp, "fsdp": fsdp, "fsdp_exposed": fsdp_exposed, "zero1": zero1,
            "syncs": w["syncs"] * eff.sync_s, "bubble": bubble, "step": step, "tokens_per_gpu": tokens,
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
