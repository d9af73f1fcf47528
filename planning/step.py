"""One training step of a layout with pipeline (PP), tensor (TP) and expert (EP) parallelism and ZeRO-1 or
FSDP data parallelism, on the calibrated device and network (planning/network.py): how published
runs ran (benchmarks/calibrate.py) and PP layouts the runtime does not implement (docs/performance.md).

Per GPU and step, `step_terms` (ranks: tp innermost, then cp and the data-parallel ranks of a stage, then pp;
ep folds over a stage's dp x cp ranks, consecutive, so an EP group of ep ranks spans ceil(ep / 8) nodes):
  compute   model FLOPs (runtime.metrics.flops_per_token x global tokens / GPUs; split by
            block_flops.flops_split) at the rates of DEFAULT_EFFICIENCY x bf16 peak (FP8 GEMMs: x
            FP8_GEMM_SPEEDUP), + what activation checkpointing reruns; the routed experts' part x skew
  ep        per MoE layer of a stage and micro-batch: dispatch + combine all-to-alls forward (again in a
            recompute that reruns the experts) and their gradients backward. Rows from the model's own
            routing (ep_projection.sampled_routing: group-limited where the config is): "nccl" sends one
            row per token copy (K per token), "deepep" one per destination node (node-deduplicated,
            NVLink forwarding inside the node); FP8 rows (D + 4 bytes) for the forward dispatch of FP8 runs
            (DeepSeek-V3's); x skew (the busiest rank receives skew x the mean)
  tp        per layer and micro-batch 2 all-reduces of the activations forward, 2 backward (+2 per
            recompute), over NVLink, exposed
  fsdp      all-gather of the stage's parameter shards twice per micro-batch (forward, backward) in bf16
            and a reduce-scatter of fp32 gradients per micro-batch; zero1: one fp32 reduce-scatter and one
            bf16 all-gather per step (at the step's end: exposed)
  pp        the schedule's bubble on top of the stage's busy time: 1f1b (pp - 1) / m, interleaved
            (pp - 1) / (v m), dualpipe (pp / 2 - 1)(F + B / 2) / (m (F + B)) = (pp / 2 - 1) 2 / (3 m)
            (DeepSeek-V3 report, W = B / 2, B = 2 F); activations point-to-point ride beside it
  syncs     a host sync per MoE layer, micro-batch and forward pass (the dispatch's split sizes)
Overlap: the all-to-alls are on the critical path (torch all_to_all_single between compute kernels)
except under "dualpipe", whose paired forward and backward chunks hide them behind compute, which then
runs contended (network_model.contended_compute_s). FSDP traffic runs beside compute (contended) and
shares the NIC with the all-to-alls: only what does not fit in the NIC's idle time is exposed.
Multi-token prediction (`mtp_layers`) costs time, not model FLOPs (the published accounting).
Not modelled: memory per stage, CP's ring attention.
"""

import math
from dataclasses import dataclass

import torch

from planning import network as net
from planning.flops import DEFAULT_EFFICIENCY, RATE, block_parts, flops_split, recompute_flops
from planning.fsdp_traffic import peers
from planning.memory.coarse import activation_bytes

# FP8 GEMMs' end-to-end rate over the bf16 rate at the same efficiency. The datasheet doubles the peak;
# DeepSeek-V3's run (fine-grained 1 x 128 / 128 x 128 scaling: quantize kernels, promotion to CUDA cores
# every 128 accumulations) shows about none of it end to end: fitted on that run, the only FP8 anchor
# (docs/performance.md#calibration); torchtitan's MXFP8 grouped GEMMs gave +7% end to end on B200.
FP8_GEMM_SPEEDUP = 1.0
SYNC_S = 50e-6  # idle device per host sync (benchmarks/step_projection.py's figure)
SCHEDULES = ("1f1b", "interleaved", "dualpipe")
CHECKPOINTING = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class Run:
    """One training run: cluster, model, step and layout (the case file's sections, benchmarks/calibrate.py)."""
    model: object  # models.config.ModelConfig
    device: object  # planning.devices.DeviceModel
    gpus: int
    gpus_per_node: int
    seq_len: int
    global_batch: int  # sequences per step
    micro_batch: int  # sequences per micro-batch and data-parallel replica
    gemm_precision: str = "bf16"
    dispatcher: str = "nccl"
    activation_checkpoint: str = "none"
    skew: float = 1.0
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp_sharding: str = "fsdp"
    mtp_layers: int = 0  # multi-token-prediction modules trained beside the model (time, not model FLOPs)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)


def check_run(r: Run) -> None:
    """ValueError naming the key and every number when the layout cannot run as given."""
    c = r.model
    if r.gpus % r.gpus_per_node:
        raise ValueError(f"cluster.gpus = {r.gpus} is not a multiple of cluster.gpus_per_node = {r.gpus_per_node}")
    if r.gpus % (r.tp * r.pp * r.cp):
        raise ValueError(f"layout tp x pp x cp = {r.tp} x {r.pp} x {r.cp} = {r.tp * r.pp * r.cp} does not divide "
                         f"cluster.gpus = {r.gpus}")
    if r.pp * r.virtual_stages > c.n_layers:
        raise ValueError(f"layout.pp x virtual_stages = {r.pp} x {r.virtual_stages} exceeds the model's "
                         f"{c.n_layers} layers")
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


def compute_rates(device, precision: str) -> dict:
    """FLOP/s per kind of compute (block_flops.RATE's names)."""
    rates = {k: f * device.peak_tflops * 1e12 for k, f in DEFAULT_EFFICIENCY.items()}
    if precision == "fp8":
        for kind in ("matmul_bf16", "grouped_mm_bf16"):
            rates[kind] *= FP8_GEMM_SPEEDUP
    return rates


def compute_s(r: Run) -> tuple[float, float]:
    """(compute seconds per GPU and step, of which the routed experts')."""
    tokens = r.global_batch * r.seq_len / r.gpus
    rates = compute_rates(r.device, r.gemm_precision)
    split = flops_split(r.model, r.seq_len)
    experts = split["experts"] / rates["grouped_mm_bf16"] * r.skew
    rest = split["dense"] / rates["matmul_bf16"] + split["attention"] / rates["attention_bf16"]
    rerun = recompute_flops(r.model, r.seq_len, r.activation_checkpoint)
    rerun_s = sum(v / rates[k] for k, v in rerun.items())
    return tokens * (experts + rest + rerun_s + r.mtp_layers * mtp_s(r.model, r.seq_len, rates)), tokens * experts


def mtp_s(config, seq_len: int, rates: dict) -> float:
    """Seconds per token of one multi-token-prediction module (DeepSeek-V3 report, section 2.2): one more
    MoE block, its 2D -> D projection and the (shared) output head, forward and backward."""
    parts = block_parts(config, seq_len)[-1]
    block = sum(3 * flops / rates[RATE[part]] for part, flops in parts.items())
    return block + 6 * (2 * config.dim * config.dim + config.vocab_size * config.dim) / rates["matmul_bf16"]


def routing_rows(model, ep: int, gpus_per_node: int) -> dict:
    """Per token and MoE layer, mean over the ep ranks (the model's own routing, sampled):
    {"copies_intra", "copies_inter"}: token copies to other GPUs of my node / to other nodes;
    {"nodes_inter"}: distinct other nodes a token reaches (what a node-deduplicated dispatch sends)."""
    from planning.ep_traffic import sampled_routing

    local = model.n_routed_experts // ep
    node_of = torch.arange(ep) // gpus_per_node
    intra = inter = nodes = 0.0
    for p, experts_TK in enumerate(sampled_routing(model, ep)):
        dest_TK = node_of[experts_TK // local]
        rank_TK = experts_TK // local
        remote_TK = dest_TK != node_of[p]
        intra += ((~remote_TK) & (rank_TK != p)).float().sum(1).mean().item()
        inter += remote_TK.float().sum(1).mean().item()
        present = torch.zeros(experts_TK.shape[0], int(node_of.max()) + 1, dtype=torch.bool)
        present.scatter_(1, dest_TK, True)
        present[:, node_of[p]] = False
        nodes += present.float().sum(1).mean().item()
    return {"copies_intra": intra / ep, "copies_inter": inter / ep, "nodes_inter": nodes / ep}


def ep_s(r: Run) -> tuple[float, int]:
    """(EP all-to-all seconds per GPU and step, host syncs per step: one per MoE layer, micro-batch and
    forward pass, the dispatch's split sizes)."""
    if r.ep == 1:
        return 0.0, 0
    c = r.model
    rows = routing_rows(c, r.ep, r.gpus_per_node)
    tokens = r.micro_batch * r.seq_len / (r.cp * r.tp)  # per GPU and micro-batch (TP: sequence-parallel split)
    row = 2 * c.dim
    dispatch_row = c.dim + 4 if r.gemm_precision == "fp8" else row
    if r.dispatcher == "deepep":  # one row per destination node over the network, forwarded over NVLink there
        inter_rows = rows["nodes_inter"]
        intra_rows = rows["copies_intra"] + rows["copies_inter"]
    else:
        inter_rows, intra_rows = rows["copies_inter"], rows["copies_intra"]
    reruns = 1 if r.activation_checkpoint in ("full", "selective") else 0
    exchanges = [dispatch_row, row] * (1 + reruns) + [row, row]  # forward (+ recompute), then the gradients
    layers = (c.n_layers - c.n_dense_layers) * r.micro_batches / r.pp
    nodes = math.ceil(r.ep / r.gpus_per_node)
    seconds = sum(net.collective_s(r.device, "all_to_all", tokens * intra_rows * b * r.skew,
                                   tokens * inter_rows * b * r.skew, nodes, r.dispatcher) for b in exchanges)
    return layers * seconds, round(layers * (1 + reruns))


def tp_s(r: Run) -> float:
    """TP's activation all-reduces per GPU and step (NVLink)."""
    if r.tp == 1:
        return 0.0
    c = r.model
    nbytes = r.micro_batch * r.seq_len / r.cp * c.dim * 2 * 2 * (r.tp - 1) / r.tp  # ring all-reduce, bf16
    reductions = 4 + (2 if r.activation_checkpoint == "full" else 0)
    count = c.n_layers / r.pp * r.micro_batches * reductions
    return net.collective_s(r.device, "all_reduce", count * nbytes, 0.0, 1, count=int(count))


def stage_params(r: Run) -> tuple[float, float]:
    """(dense, expert) parameters one GPU holds before data-parallel sharding (its stage's, / tp, / ep x etp)."""
    from models import count_params

    c = r.model
    total, _ = count_params(c)
    expert = 3 * c.dim * c.moe_inter_dim * c.n_routed_experts * (c.n_layers - c.n_dense_layers)
    return (total - expert) / (r.pp * r.tp), expert / (r.pp * r.ep * r.etp)


def data_parallel_s(r: Run) -> tuple[float, float]:
    """(FSDP seconds that run beside compute, ZeRO-1 seconds at the step's end) per GPU and step."""
    dense, expert = stage_params(r)
    groups = [(dense, r.dp * r.cp, r.tp), (expert, r.dp * r.cp * r.tp // (r.ep * r.etp), r.ep * r.etp)]
    background = exposed = 0.0
    for params, size, stride in groups:
        if size == 1:
            continue
        same, other = peers(size, stride, r.gpus_per_node)
        inter = other / (size - 1)
        if r.dp_sharding == "fsdp":  # all-gather bf16 twice, reduce-scatter fp32, every micro-batch
            nbytes = params * (2 * 2 + 4) * (size - 1) / size * r.micro_batches
            count = 3 * r.micro_batches
        else:
            nbytes = params * (2 + 4) * (size - 1) / size
            count = 2
        seconds = net.collective_s(r.device, "ring", nbytes * (1 - inter), nbytes * inter,
                                   math.ceil(size * stride / r.gpus_per_node), count=count)
        if r.dp_sharding == "fsdp":
            background += seconds
        else:
            exposed += seconds
    return background, exposed


def bubble_fraction(r: Run) -> float:
    """The pipeline schedule's idle time over the stage's busy time (module docstring)."""
    m = r.micro_batches
    if r.pp == 1:
        return 0.0
    if r.pp_schedule == "dualpipe":
        return (r.pp / 2 - 1) * 2 / (3 * m)
    return (r.pp - 1) / (m * (r.virtual_stages if r.pp_schedule == "interleaved" else 1))


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


def step_terms(r: Run) -> dict:
    """Every term of the step (seconds per GPU) and the throughput it implies (module docstring)."""
    compute, experts = compute_s(r)
    ep, syncs = ep_s(r)
    tp = tp_s(r)
    fsdp, zero1 = data_parallel_s(r)
    overlap_ep = r.pp_schedule == "dualpipe" and r.pp > 1
    busy_compute = net.contended_compute_s(compute, (ep if overlap_ep else 0.0) + min(fsdp, compute))
    core = max(busy_compute, ep) if overlap_ep else busy_compute + ep
    nic_idle = core - ep  # the NIC time the all-to-alls leave to FSDP
    fsdp_exposed = max(0.0, fsdp - nic_idle)
    busy = core + tp + fsdp_exposed + syncs * SYNC_S
    bubble = bubble_fraction(r) * busy
    step = busy + bubble + zero1
    tokens = r.global_batch * r.seq_len / r.gpus
    from runtime.metrics import flops_per_token

    model_flops = flops_per_token(r.model, r.seq_len) * tokens
    return {"compute": compute, "compute_contended": busy_compute, "experts": experts, "ep": ep,
            "ep_overlapped": overlap_ep, "tp": tp, "fsdp": fsdp, "fsdp_exposed": fsdp_exposed, "zero1": zero1,
            "syncs": syncs * SYNC_S, "bubble": bubble, "step": step, "tokens_per_gpu": tokens,
            "tokens_per_gpu_s": tokens / step, "mfu_bf16": model_flops / (step * r.device.peak_tflops * 1e12),
            "memory_gib": memory_gib(r)}
