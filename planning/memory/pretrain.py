"""Per-rank peak memory of a pretraining job before launch: no GPU, no process group (launch/estimate_memory.py
is its command line; post-training adds its terms in planning/memory/posttrain.py).

What is counted, for one rank (default rank 0, which holds the largest torch.chunk shards) of what it holds
(planning/memory/stages.py `Holding`): the whole model, or under pipeline parallelism its pipeline rank's stages
as the runtime splits them (parallel/pp/plan.py; the embedding with stage 0, the final norm and head with the
last), the micro-batches in flight its schedule keeps, and every unit unsharded for the step
(`estimate_stages`: every pipeline rank at this rank's coordinate, and the worst):
  params        fp32 master shards (placements of parallel/fsdp.py, boxes of models/boxes.py)
  grads         fp32 gradient shards
  optimizer     Muon momentum (1 x fp32) for declared matrices, AdamW exp_avg + exp_avg_sq (2 x fp32) for the rest
  fsdp_buffers  unsharded FSDP units in param_dtype while a unit runs its backward: the unit and the
                prefetched ones before it (training.fsdp_prefetch, at least 1), the unit's unsharded gradient
                (param_dtype) and its reduce-scatter input (reduce_dtype); units = embedding, each block with its
                ep rank's experts, final norm + head. Under pipeline parallelism every unit held stays unsharded
                for the step, with its accumulated unsharded gradient (reduce_dtype) (`fsdp_buffers`)
  activations   what autograd keeps for one micro-batch under training.activation_checkpoint, measured
                (planning/memory/probe.py) at the job's micro-batch for every layer, plus the embedding output
                and final norm; a pipeline rank keeps its schedule's micro-batches in flight of each of its
                stages (planning/memory/stages.py, read off torch's schedules)
  recompute     checkpointed modes: the activations of one block (full) or of one block's regions
                (selective) while it is recomputed in backward
  dispatch      expert parallelism: the received token copies and the combine output of one MoE layer,
                x routing_skew (the busiest ep rank's share of the routed rows over the mean; 1.0: uniform)
  ep_kept       parallel.ep_recompute = "keep" under checkpointing: every MoE layer's kept all-to-all
                receive buffers until its backward (parallel/ep/keep.kept_bytes_per_layer, the mean over
                ranks; dedup: at most min(K, nodes of the ep group, n_limited_groups x nodes a group spans)
                nodes per token); at block l's backward, those of blocks 0..l (the dispatch term above still
                counts the recompute's working copies: an upper bound), x routing_skew as the dispatch
  logits        logits and their gradient in the compute dtype, plus one fp32 loss chunk (x3: upcast,
                log-softmax, gradient; parallel/gradients.py)
  muon_step     the optimizer step's transients: STEP_BUCKETS x this rank's largest bucket of blocks
                (next in flight, received and orthogonalized, returning; optim/sharded/pipeline.py)
  runtime       CUDA context, NCCL and allocator reserve (planning/devices.py; 0 on cpu)
Peak = params + grads + optimizer + runtime + max(forward/backward peak, muon_step), where the
forward/backward peak is the largest moment of the backward timeline: the head's backward (every
block's activations, the logits and their gradient alive) or block l's backward (blocks 0..l still
saved, block l's recompute and FSDP buffers, its dispatch). `per_rank_gib` shows the parts at that moment
(`peak_at`), so they add up to the total (when the optimizer step is the peak, the total is the sharded
state, runtime and muon_step).
"""

import dataclasses
import math

import numpy as np
import torch

from planning.devices import DEVICES
from planning.memory import stages
from planning.memory.probe import block_fits
from planning.memory.stages import Holding

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
DEVICE_CHOICES = (*DEVICES, "cpu")  # "cpu": no memory limit, no runtime reserve (the CPU validation runs)


def device_gib(device: str) -> float | None:
    """Memory torch reports on `device` (planning/devices.py), None on the CPU (no limit)."""
    return None if device == "cpu" else DEVICES[device].memory_gib


def runtime_gib(device: str) -> float:
    return 0.0 if device == "cpu" else DEVICES[device].runtime_gib


@dataclasses.dataclass(frozen=True)
class Job:
    config: object
    layout: object  # the ranks that hold one copy of the stage (without PP: the whole job)
    rank: int
    device: str  # DEVICE_CHOICES
    routing_skew: float = 1.0  # the busiest ep rank's routed rows over the mean (dispatch and kept buffers)

    @property
    def tokens(self) -> tuple[int, int]:
        """(sequences, tokens per sequence) of one micro-batch on one rank."""
        t, d = self.config.training, self.config.data
        return d.batch_size // (self.layout.dp * t.grad_accum), d.seq_len // self.layout.cp

    @property
    def c(self) -> int:
        return DTYPE_BYTES[self.config.training.param_dtype]

    @property
    def local_rank(self) -> int:
        """This rank's coordinate inside its pipeline stage (the rank itself without pipeline parallelism)."""
        return self.rank % self.layout.stage_size


def whole_model(model_config) -> Holding:
    return stages.whole_model(model_config.n_layers)


def rank_holding(job: Job) -> Holding:
    """What `job.rank` holds: the whole model, or its pipeline rank's stages and micro-batches in flight."""
    layout = job.layout
    return stages.pipeline_holding(job.config.model.n_layers, layout.pp_config, job.rank // layout.stage_size,
                                   job.config.training.grad_accum)


def stage_layout(layout):
    """The layout of one pipeline stage's ranks (the dense and expert meshes of pp = 1 on stage_size ranks)."""
    from parallel.pp.config import PipelineConfig

    if layout.pp == 1:
        return layout
    return dataclasses.replace(layout, world_size=layout.stage_size, pp_config=PipelineConfig())


# ---- sharded state ------------------------------------------------------------------------------

def rank_boxes(model_config, layout, rank: int):
    """[(fqn, full shape, local shape, offset, is_expert)] of every parameter on `rank` (no process group)."""
    from torch.distributed.tensor import Replicate, Shard

    from models import Transformer
    from models.boxes import local_box
    from models.experts import GroupedExperts
    from optim.planner.specs import expert_placements
    from parallel.layout import EXPERT_AXES
    from parallel.meshes import rank_mesh

    with torch.device("meta"):
        model = Transformer(model_config)
    experts = {f"{p}.{n}" for p, m in model.named_modules() if isinstance(m, GroupedExperts)
               for n, _ in m.named_parameters()}
    meshes = {False: (torch.arange(layout.world_size).view(layout.dp_replicate, layout.dp_shard * layout.cp),
                      (Replicate(), Shard(0))),
              True: (torch.from_numpy(rank_mesh(layout, EXPERT_AXES)),  # parallel.expert_inner's numbering
                     expert_placements(model_config.n_routed_experts, layout))}
    out = []
    for fqn, p in model.named_parameters():
        ranks, placements = meshes[fqn in experts]
        coordinate = [int(c) for c in ranks.eq(rank).nonzero()[0]]
        box = local_box(tuple(p.shape), tuple(ranks.shape), placements, coordinate)
        out.append((fqn, tuple(p.shape), tuple(b - a for a, b in box), tuple(a for a, _ in box), fqn in experts))
    return out


def in_stage(fqn: str, stage: Holding) -> bool:
    """Whether parameter `fqn` is held: its block's layer, or the embedding / final norm and head."""
    if fqn.startswith("layers."):
        return int(fqn.split(".")[1]) in stage.layers()
    return stage.embedding if fqn.startswith("tok_embeddings.") else stage.head


def sharded_state(job: Job, stage: Holding | None = None) -> dict:
    """{params, grads, optimizer} bytes of the rank's shards of what it holds (default: `rank_holding`)."""
    from models import Transformer
    from models.splits import muon_splits

    stage = stage or rank_holding(job)
    with torch.device("meta"):
        splits = muon_splits(Transformer(job.config.model))
    muon = job.config.optim.name == "muon"
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for fqn, _, shape, _, _ in rank_boxes(job.config.model, stage_layout(job.layout), job.local_rank):
        if not in_stage(fqn, stage):
            continue
        n = math.prod(shape)
        out["params"] += 4 * n
        out["grads"] += 4 * n
        is_muon = muon and fqn in splits
        out["optimizer"] += 4 * n * (1 if is_muon else 2)
    return out


# ---- FSDP buffers -------------------------------------------------------------------------------

def unit_sizes(model_config, layout, stage: Holding | None = None) -> list[int]:
    """Unsharded elements of each FSDP unit held in execution order: embedding, each block (its dense part
    plus its ep rank's experts, gathered over the expert mesh), final norm + head."""
    from models import Transformer
    from models.experts import GroupedExperts

    stage = stage or whole_model(model_config)
    with torch.device("meta"):
        model = Transformer(model_config)
    sizes = [model.tok_embeddings.weight.numel()] if stage.embedding else []
    for i in stage.layers():
        n = 0
        for module in model.layers[i].modules():
            for p in module.parameters(recurse=False):
                n += p.numel() // layout.ep if isinstance(module, GroupedExperts) else p.numel()
        sizes.append(n)
    if stage.head:
        sizes.append(model.norm.weight.numel() + model.output.weight.numel())
    return sizes


def fsdp_buffers(job: Job, stage: Holding | None = None) -> list[int]:
    """Per unit u held (execution order), FSDP bytes while u runs its backward.
    Without pipeline parallelism: u and the prefetched units before it unsharded (param_dtype;
    training.fsdp_prefetch of them, 1 for FSDP2's implicit prefetch), u's unsharded gradient (param_dtype)
    and its reduce-scatter input (reduce_dtype); its forward (u and the next units unsharded) needs less.
    Gathered for the step (pipeline parallelism: torch's stage turns reshard-after-backward and the gradient
    sync off until the last micro-batch): every unit unsharded (param_dtype), every unit's accumulated
    unsharded gradient (reduce_dtype: FSDP2 upcasts it between micro-batches) and u's new gradient
    (param_dtype); the reduce-scatter runs after the stage's last backward, when its activations are gone."""
    stage = stage or rank_holding(job)
    sizes, c = unit_sizes(job.config.model, job.layout, stage), job.c
    r = DTYPE_BYTES[job.config.training.reduce_dtype]
    if stage.gathered:
        return [sum(sizes) * (c + r) + size * c for size in sizes]
    depth = max(1, job.config.training.fsdp_prefetch)
    return [(size + sum(sizes[max(0, u - depth):u])) * c + size * (c + r) for u, size in enumerate(sizes)]


# ---- activations (measured on the CPU at the real widths: planning/memory/probe.py) ---------------

def activations(job: Job, stage: Holding | None = None) -> tuple[list, list, int, dict]:
    """(kept per layer held, in increasing layer order; recomputed per layer during its backward; embedding
    output + final norm held; GiB per block kind) for one micro-batch."""
    cfg, mode = job.config.model, job.config.training.activation_checkpoint
    stage = stage or rank_holding(job)
    dtype = torch.bfloat16 if job.c == 2 else torch.float32
    n_seq, s_local = job.tokens
    s_keys = s_local * job.layout.cp  # under cp each query chunk attends over the gathered sequence
    quadratic = 1.0 if job.device == "cpu" else 0.0

    def kept(fit, n_experts):
        a, b, e = fit
        return n_seq * (a * s_local + quadratic * b * s_local * s_keys + e * s_local * n_experts)

    kinds = [("dense", 0, False)] if cfg.n_dense_layers else []
    kinds += [("moe", cfg.n_dense_layers, True)] if cfg.n_moe_layers else []
    per_kind, recompute_kind = {}, {}
    modes = ("none",) if mode == "none" else ("none", mode)
    for name, layer_id, moe in kinds:
        fits = block_fits(cfg, layer_id, dtype, modes, moe)
        none, chosen = kept(fits["none"], cfg.n_routed_experts), kept(fits[mode], cfg.n_routed_experts)
        per_kind[name] = chosen
        recompute_kind[name] = 0.0 if mode == "none" else none - chosen + (chosen if mode == "full" else 0)
    kind_of = ["moe" if cfg.is_moe_layer(i) else "dense" for i in stage.layers()]
    return ([per_kind[k] for k in kind_of], [recompute_kind[k] for k in kind_of], sum(chunk_edges(job, stage)),
            {k: v / GIB for k, v in per_kind.items()})


def chunk_edges(job: Job, stage: Holding) -> list[int]:
    """Per chunk, one micro-batch's embedding output (stage 0's, the rank's first chunk) and final norm's fp32
    copy and output (the last stage's, the rank's last chunk)."""
    n_seq, s_local = job.tokens
    dim, out = job.config.model.dim, [0] * len(stage.chunks)
    out[0] += n_seq * s_local * dim * job.c if stage.embedding else 0
    out[-1] += n_seq * s_local * dim * (4 + job.c) if stage.head else 0
    return out


def in_flight_others(stage: Holding, full: list[dict]) -> list[dict]:
    """Per chunk c: the activations and kept EP buffers of the OTHER micro-batches in flight while one
    micro-batch runs c's backward, at the heaviest of the schedule's moments (`full[j]`: one micro-batch's
    {"activations", "ep_kept"} of chunk j)."""
    totals = [{k: sum(m[j] * full[j][k] for j in range(len(full))) for k in full[0]} for m in stage.moments]
    heaviest = max(totals, key=lambda t: sum(t.values()))
    return [{k: max(0.0, heaviest[k] - f[k]) for k in f} for f in full]


def step_peak(job: Job, kept_L: list, recompute_L: list, edges: int, stage: Holding | None = None) -> tuple[str, dict]:
    """(moment, parts) at the peak of forward/backward: the head's backward (the chunk's activations and
    the logits alive; the last stage only) or a block's backward (the chunk's blocks before it still saved,
    its own recompute); under pipeline parallelism the rank also holds its other micro-batches in flight
    (`in_flight_others`)."""
    cfg = job.config.model
    stage = stage or rank_holding(job)
    buffers, disp, ep_kept = fsdp_buffers(job, stage), dispatch(job), kept_rows(job)
    first_block = 1 if stage.embedding else 0  # index of the first block's unit in `buffers`
    unit = {layer: first_block + i for i, layer in enumerate(stage.layers())}
    kept_L, recompute_L = dict(zip(stage.layers(), kept_L)), dict(zip(stage.layers(), recompute_L))
    edges = chunk_edges(job, stage)  # `edges`: their sum
    full = [{"activations": sum(kept_L[i] for i in chunk) + edges[c],
             "ep_kept": ep_kept * sum(cfg.is_moe_layer(i) for i in chunk)} for c, chunk in enumerate(stage.chunks)]
    others = in_flight_others(stage, full)
    moments = {}
    if stage.head:
        c = len(stage.chunks) - 1
        moments["head"] = {"fsdp_buffers": buffers[-1],
                           "activations": full[c]["activations"] + others[c]["activations"],
                           "recompute": 0, "dispatch": 0, "ep_kept": full[c]["ep_kept"] + others[c]["ep_kept"],
                           "logits": logits(job)}
    for c, chunk in enumerate(stage.chunks):
        for i, layer in enumerate(chunk):
            moe = cfg.is_moe_layer(layer)
            moments[f"block {layer}"] = {
                "fsdp_buffers": buffers[unit[layer]],
                "activations": sum(kept_L[j] for j in chunk[: i + 1]) + edges[c] + others[c]["activations"],
                "recompute": recompute_L[layer], "dispatch": disp if moe else 0,
                "ep_kept": ep_kept * sum(cfg.is_moe_layer(j) for j in chunk[: i + 1]) + others[c]["ep_kept"],
                "logits": 0}
    at = max(moments, key=lambda k: sum(moments[k].values()))
    return at, moments[at]


# ---- the rest ------------------------------------------------------------------------------------

def dispatch(job: Job) -> int:
    cfg = job.config.model
    if job.layout.ep == 1 or not cfg.n_moe_layers:
        return 0
    n_seq, s_local = job.tokens
    return int(2 * n_seq * s_local * cfg.n_activated_experts * cfg.dim * job.c * job.routing_skew)


def kept_rows(job: Job) -> float:
    """Bytes one MoE layer keeps for its recompute under parallel.ep_recompute = "keep" (else 0), on the
    busiest ep rank (x job.routing_skew)."""
    from parallel.ep.keep import kept_bytes_per_layer
    from parallel.layout import EXPERT_AXES
    from parallel.meshes import rank_mesh

    cfg, layout = job.config.model, job.layout
    if layout.ep == 1 or not layout.ep_config.keep or job.config.training.activation_checkpoint == "none":
        return 0.0
    ep_axis = rank_mesh(layout, EXPERT_AXES).reshape(-1, layout.ep)  # ep is the last of EXPERT_AXES
    (group,) = [row for row in ep_axis if job.local_rank in row]
    node_of_expert = [int(group[e // layout.local_experts(cfg.n_routed_experts)]) // layout.ep_config.ranks_per_node
                      for e in range(cfg.n_routed_experts)]
    nodes = min(cfg.n_activated_experts, len(set(node_of_expert)))
    if cfg.n_expert_groups > 1:  # group-limited routing: a token reaches at most n_limited_groups groups
        per_group = cfg.n_routed_experts // cfg.n_expert_groups
        span = max(len(set(node_of_expert[g * per_group:(g + 1) * per_group])) for g in range(cfg.n_expert_groups))
        nodes = min(nodes, cfg.n_limited_groups * span)
    n_seq, s_local = job.tokens
    return job.routing_skew * kept_bytes_per_layer(n_seq * s_local, cfg, layout.ep_config, job.c, nodes)


def logits(job: Job) -> int:
    from parallel.gradients import LOSS_CHUNK_BYTES

    n_seq, s_local = job.tokens
    v = job.config.model.vocab_size
    chunk = max(1, LOSS_CHUNK_BYTES // (4 * v))
    temporaries = 2 if job.c == 4 else 3  # (fp32 upcast,) log-softmax, gradient of one chunk
    return 2 * n_seq * s_local * v * job.c + temporaries * min(chunk, n_seq * s_local) * v * 4


# The sharded Muon step's transients as a multiple of this rank's largest bucket (NS-dtype bytes of
# the blocks it owns in one bucket): with overlap, bucket k+1's send and receive buffers in flight,
# bucket k's blocks and Newton-Schulz working set, bucket k-1's results returning; without, one
# bucket at a time. Measured (benchmarks/lib/counters.py, peak extra memory of one step / largest bucket,
# 2 ranks, debug and kimi_slice, fp32 and bf16, 1 and 4 MiB buckets): at most 6.57 and 4.77;
# tests/ranks/test_memory.py re-measures it. The update direction is never materialized whole.
STEP_BUCKETS = {True: 6.6, False: 4.8}


def muon_step(job: Job, stage: Holding | None = None) -> int:
    """Peak transient bytes of the optimizer step on `job.rank`: STEP_BUCKETS x its largest bucket,
    planned as the runtime plans it (optim/sharded/muon.py: under pipeline parallelism over the stage's
    ranks, the parameters it holds)."""
    from optim.planner.plan import make_plan
    from optim.planner.specs import model_specs
    from optim.sharded.muon import plan_options

    if job.config.optim.name != "muon":
        return 0
    o, layout = job.config.optim, stage_layout(job.layout)
    stage = stage or rank_holding(job)
    specs = [s for s in model_specs(job.config.model, layout) if in_stage(s.name, stage)]  # parallel.expert_inner
    options = plan_options(o, "cpu" if job.device == "cpu" else "cuda", bucket_mb=o.bucket_mb,
                           replica_split=o.replica_split, ranks_per_node=job.layout.ep_config.ranks_per_node)
    plan = make_plan(specs, layout.world_size, options)
    return int(STEP_BUCKETS[o.overlap] * largest_bucket(plan, job.local_rank))


def largest_bucket(plan, rank: int) -> int:
    """NS-dtype bytes of the blocks `rank` owns in its largest bucket."""
    inst = plan.inst
    mine = inst["owner"] == rank
    nbytes = np.array([p.nbytes for p in plan.params], dtype=np.int64)[inst["param"][mine]]
    return int(np.bincount(inst["bucket"][mine], weights=nbytes, minlength=1).max())


def estimate(job: Job, stage: Holding | None = None) -> dict:
    """The peak of one rank of `job` (module docstring): what it holds (`rank_holding`: the whole model, or its
    pipeline rank's stages), unless `stage` says otherwise."""
    stage = stage or rank_holding(job)
    state = sharded_state(job, stage)
    kept_L, recompute_L, edges, per_block = activations(job, stage)
    at, step = step_peak(job, kept_L, recompute_L, edges, stage)
    parts = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"], **step,
             "muon_step": muon_step(job, stage), "runtime": runtime_gib(job.device) * GIB}
    total = (parts["params"] + parts["grads"] + parts["optimizer"] + parts["runtime"]
             + max(sum(step.values()), parts["muon_step"]))
    limit = device_gib(job.device)
    fits = limit is None or total / GIB <= limit
    return {"per_rank_gib": {k: v / GIB for k, v in parts.items()}, "total_gib": total / GIB,
            "device_gib": limit, "fits": fits, "suggestions": [] if fits else suggestions(job, parts, total),
            "peak_at": at if sum(step.values()) >= parts["muon_step"] else "optimizer step",
            "activation_gib_per_block": per_block, "rank": job.rank, "world": job.layout.world_size,
            "routing_skew": job.routing_skew, "stage": dataclasses.asdict(stage),
            "states_bytes": state, "micro_batch": {"sequences": job.tokens[0], "tokens_per_sequence": job.tokens[1]}}


def estimate_stages(job: Job) -> dict:
    """Under pipeline parallelism: the estimate of each pipeline rank at `job.rank`'s coordinate inside its
    stage ({"stages": [...], "worst": the pipeline rank with the highest peak}); the worst decides the fit."""
    size = job.layout.stage_size
    rows = [estimate(dataclasses.replace(job, rank=p * size + job.local_rank)) for p in range(job.layout.pp)]
    worst = max(range(len(rows)), key=lambda p: rows[p]["total_gib"])
    return {"stages": rows, "worst": worst}


def suggestions(job: Job, parts: dict, total: int) -> list[str]:
    t, out = job.config.training, []
    over = total / GIB - device_gib(job.device)
    out.append(f"needs {over:.1f} GiB less per rank")
    if t.param_dtype == "float32":
        out.append("training.param_dtype=bfloat16 (halves FSDP buffers and activations)")
    if t.activation_checkpoint != "full":
        out.append("training.activation_checkpoint=full (keeps one block input per layer)")
    if job.tokens[0] > 1:
        out.append(f"training.grad_accum={t.grad_accum * job.tokens[0]} (one sequence per micro-batch)")
    state = parts["params"] + parts["grads"] + parts["optimizer"]
    out.append(f"more ranks in the shard groups (sharded state is {state / GIB:.1f} GiB: "
               f"parallel.edp_shard / dp_shard, or a larger world)")
    return out
