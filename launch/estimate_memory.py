"""Per-rank peak memory of a training job before launch: no GPU, no process group.

    python launch/estimate_memory.py --config configs/kimi_k2_256gpu.toml [--world 256] [--device h200]
                                     [--rank 0] [--routing-skew 1.0] [--json PATH]

What is counted, for one rank (default rank 0, which holds the largest torch.chunk shards):
  params        fp32 master shards (placements of parallel/fsdp.py, boxes of models/boxes.py)
  grads         fp32 gradient shards
  optimizer     Muon momentum (1 x fp32) for declared matrices, AdamW exp_avg + exp_avg_sq (2 x fp32) for the rest
  fsdp_buffers  unsharded FSDP units in param_dtype while a unit runs its backward: the unit and the
                prefetched ones before it (training.fsdp_prefetch, at least 1), the unit's unsharded gradient (param_dtype) and its
                reduce-scatter input (reduce_dtype); units = embedding, each block with its ep rank's
                experts, final norm + head
  activations   what autograd keeps for one micro-batch under training.activation_checkpoint, measured:
                one dense and one MoE block are built on the CPU at the real widths and run forward at
                two short sequence lengths and two expert counts; the kept bytes (torch's MemTracker)
                are fitted as a*S + b*S^2 + e*S*E per sequence and evaluated at the job's shapes.
                Evaluated at the job's micro-batch for every layer, plus the embedding output and final
                norm. On a GPU the S^2 term (attention probabilities, where the CPU runs the math SDPA
                kernel: GQA with a mask) is dropped: the fused kernels keep only a log-sum-exp per row.
  recompute     checkpointed modes: the activations of one block (full) or of one block's regions
                (selective) while it is recomputed in backward
  dispatch      expert parallelism: the received token copies and the combine output of one MoE layer,
                x --routing-skew (the busiest ep rank's share of the routed rows over the mean; 1.0: uniform)
  ep_kept       parallel.ep_recompute = "keep" under checkpointing: every MoE layer's kept all-to-all
                receive buffers until its backward (parallel/ep/keep.kept_bytes_per_layer, the mean over
                ranks; dedup: at most min(K, nodes of the ep group, n_limited_groups x nodes a group spans) nodes per token); at block l's
                backward, those of blocks 0..l (the dispatch term above still counts the recompute's
                working copies: an upper bound), x --routing-skew as the dispatch
  logits        logits and their gradient in the compute dtype, plus one fp32 loss chunk (x3: upcast,
                log-softmax, gradient; parallel/gradients.py)
  muon_step     the optimizer step's transients: STEP_BUCKETS x this rank's largest bucket of blocks
                (next in flight, received and orthogonalized, returning; optim/sharded/pipeline.py)
  runtime       CUDA context, NCCL and allocator reserve (an assumption, 0 on cpu)
Peak = params + grads + optimizer + runtime + max(forward/backward peak, muon_step), where the
forward/backward peak is the largest moment of the backward timeline: the head's backward (every
block's activations, the logits and their gradient alive) or block l's backward (blocks 0..l still
saved, block l's recompute and FSDP buffers, its dispatch). `per_rank_gib`
shows the parts at that moment (`peak_at`), so they add up to the total (when the optimizer step is the
peak, the total is the sharded state, runtime and muon_step).
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch import precheck  # noqa: E402

if __name__ == "__main__":  # a config error exits here, before torch and the model code load
    precheck.tool_config(sys.argv[1:])

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from models import Transformer, TransformerBlock  # noqa: E402
from models.boxes import local_box  # noqa: E402
from models.experts import GroupedExperts  # noqa: E402
from models.moe import Router  # noqa: E402
from models.splits import muon_splits  # noqa: E402
from optim.planner.plan import make_plan  # noqa: E402
from optim.planner.specs import _expert_placements, model_specs  # noqa: E402
from optim.sharded.muon import plan_options  # noqa: E402
from parallel.activation_checkpoint import apply_activation_checkpoint, checkpoint_regions  # noqa: E402
from parallel.gradients import LOSS_CHUNK_BYTES  # noqa: E402
from parallel.layout import EXPERT_AXES  # noqa: E402
from parallel.meshes import rank_mesh  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.cli import fail  # noqa: E402
from runtime.paths import check_output_file, config_inputs  # noqa: E402

GIB = 2**30
DEVICES = {"h200": 139.8, "h100": 79.2, "cpu": None}  # GiB torch reports for H200 141 GB / H100 80 GB
RUNTIME_GIB = {"h200": 4.0, "h100": 4.0, "cpu": 0.0}  # CUDA context ~0.5, NCCL buffers, allocator reserve
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PROBE_SEQ = (32, 64)


@dataclasses.dataclass(frozen=True)
class Job:
    config: object
    layout: object
    rank: int
    device: str
    routing_skew: float = 1.0  # the busiest ep rank's routed rows over the mean (dispatch and kept buffers)

    @property
    def tokens(self) -> tuple[int, int]:
        """(sequences, tokens per sequence) of one micro-batch on one rank."""
        t, d = self.config.training, self.config.data
        return d.batch_size // (self.layout.dp * t.grad_accum), d.seq_len // self.layout.cp

    @property
    def c(self) -> int:
        return DTYPE_BYTES[self.config.training.param_dtype]


# ---- sharded state ------------------------------------------------------------------------------

def rank_boxes(model_config, layout, rank: int):
    """[(fqn, full shape, local shape, offset, is_expert)] of every parameter on `rank` (no process group)."""
    with torch.device("meta"):
        model = Transformer(model_config)
    experts = {f"{p}.{n}" for p, m in model.named_modules() if isinstance(m, GroupedExperts)
               for n, _ in m.named_parameters()}
    meshes = {False: (torch.arange(layout.world_size).view(layout.dp_replicate, layout.dp_shard * layout.cp),
                      (Replicate(), Shard(0))),
              True: (torch.from_numpy(rank_mesh(layout, EXPERT_AXES)),  # parallel.expert_inner's numbering
                     _expert_placements(model_config.n_routed_experts, layout))}
    out = []
    for fqn, p in model.named_parameters():
        ranks, placements = meshes[fqn in experts]
        coordinate = [int(c) for c in ranks.eq(rank).nonzero()[0]]
        box = local_box(tuple(p.shape), tuple(ranks.shape), placements, coordinate)
        out.append((fqn, tuple(p.shape), tuple(b - a for a, b in box), tuple(a for a, _ in box), fqn in experts))
    return out


def sharded_state(job: Job) -> dict:
    with torch.device("meta"):
        splits = muon_splits(Transformer(job.config.model))
    muon = job.config.optim.name == "muon"
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for fqn, _, shape, _, _ in rank_boxes(job.config.model, job.layout, job.rank):
        n = math.prod(shape)
        out["params"] += 4 * n
        out["grads"] += 4 * n
        is_muon = muon and fqn in splits
        out["optimizer"] += 4 * n * (1 if is_muon else 2)
    return out


# ---- FSDP buffers -------------------------------------------------------------------------------

def unit_sizes(model_config, layout) -> list[int]:
    """Unsharded elements of each FSDP unit in execution order: embedding, each block (its dense part
    plus its ep rank's experts, gathered over the expert mesh), final norm + head."""
    with torch.device("meta"):
        model = Transformer(model_config)
    sizes = [model.tok_embeddings.weight.numel()]
    for block in model.layers:
        n = 0
        for module in block.modules():
            for p in module.parameters(recurse=False):
                n += p.numel() // layout.ep if isinstance(module, GroupedExperts) else p.numel()
        sizes.append(n)
    sizes.append(model.norm.weight.numel() + model.output.weight.numel())
    return sizes


def fsdp_buffers(job: Job) -> list[int]:
    """Per unit u (execution order), FSDP bytes while u runs its backward: u and the prefetched units
    before it unsharded (param_dtype; training.fsdp_prefetch of them, 1 for FSDP2's implicit prefetch),
    u's unsharded gradient (param_dtype) and its reduce-scatter input (reduce_dtype). Its forward
    (u and the next units unsharded) needs less."""
    sizes, c = unit_sizes(job.config.model, job.layout), job.c
    r = DTYPE_BYTES[job.config.training.reduce_dtype]
    depth = max(1, job.config.training.fsdp_prefetch)
    return [(size + sum(sizes[max(0, u - depth):u])) * c + size * (c + r) for u, size in enumerate(sizes)]


# ---- activations (measured on the CPU at the real widths) ----------------------------------------

def _build_block(model_config, layer_id: int, n_experts: int, dtype: torch.dtype) -> nn.Module:
    """Block `layer_id` at the real widths with `n_experts` routed experts, on the CPU, weights in
    `dtype` (routers fp32, as under the mixed-precision policy). Values only need to be finite. The probe's
    few experts form one routing group (group-limited routing, DeepSeek-V3's 8 groups, needs >= 2 experts
    per group; its [T, groups] scores are not what the fit measures)."""
    c = dataclasses.replace(model_config, n_routed_experts=n_experts, n_expert_groups=1, n_limited_groups=1)
    with torch.device("meta"):
        block = TransformerBlock(c, layer_id)
    block.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():  # random where cheap (the router spreads tokens), constant where large
            p.uniform_(-0.02, 0.02, generator=g) if p.numel() < 2**24 else p.fill_(0.01)
        for b in block.buffers():
            b.zero_()
    for m in block.modules():
        if isinstance(m, Router):
            m.float()
    return block


def _kept(block: nn.Module, mode: str, seq: int, dtype: torch.dtype) -> int:
    """Bytes that stay alive after the block's forward on [1, seq] tokens (its output excluded)."""
    from torch.distributed._tools.mem_tracker import MemTracker  # private, checked on torch 2.13.0

    holder = nn.Module()
    holder.layers = nn.ModuleList([block])
    apply_activation_checkpoint(holder, mode)
    x = torch.randn(1, seq, block.attention_norm.weight.shape[0], requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        x_in = x.to(dtype) * 1.0  # a non-leaf input, freed unless the block keeps it
        out = block(x_in, torch.arange(seq))
        del x_in
        after = tracker.get_tracker_snapshot("current")
    if mode != "none":
        for module in checkpoint_regions(block, mode):
            module.region = module.region.inner  # the region's runner before checkpointing, for the next probe
    return _total(after) - _total(before) - out.numel() * out.element_size()


def _total(snapshot) -> int:
    return sum(v["Total"] for v in snapshot.values())


@functools.lru_cache(maxsize=None)  # the same probes for every layout of one model (benchmarks/step_projection.py)
def block_fits(model_config, layer_id: int, dtype, modes, moe: bool) -> dict:
    """{mode: (a, b, e)}: kept bytes per sequence of length S = a*S + b*S^2 (+ e*S*E for an MoE block)."""
    e1 = model_config.n_activated_experts if moe else model_config.n_routed_experts
    s1, s2 = PROBE_SEQ
    block = _build_block(model_config, layer_id, e1, dtype)
    kept = {mode: (_kept(block, mode, s1, dtype), _kept(block, mode, s2, dtype)) for mode in modes}
    wider = _build_block(model_config, layer_id, 2 * e1, dtype) if moe else None
    fits = {}
    for mode, (k1, k2) in kept.items():
        e = (_kept(wider, mode, s1, dtype) - k1) / (s1 * e1) if moe else 0.0
        k1e, k2e = k1 - e * s1 * e1, k2 - e * s2 * e1  # k(S) = a S + b S^2 (+ e S E1)
        b = (k2e / s2 - k1e / s1) / (s2 - s1)
        fits[mode] = (k1e / s1 - b * s1, b, e)
    return fits


def activations(job: Job) -> tuple[list, list, int, dict]:
    """(kept per layer, recomputed per layer during its backward, embedding + final norm, GiB per block kind)."""
    cfg, mode = job.config.model, job.config.training.activation_checkpoint
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
    kind_of = ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.n_layers)]
    edges = n_seq * s_local * cfg.dim * (job.c + 4 + job.c)  # embedding output; final norm's fp32 copy and output
    return ([per_kind[k] for k in kind_of], [recompute_kind[k] for k in kind_of], edges,
            {k: v / GIB for k, v in per_kind.items()})


def step_peak(job: Job, kept_L, recompute_L, edges) -> tuple[float, dict]:
    """(bytes, parts) at the peak of forward/backward: the head's backward (every block's activations
    and the logits alive) or a block's backward (the blocks before it still saved, its own recompute)."""
    buffers, lg, disp, ep_kept = fsdp_buffers(job), logits(job), dispatch(job), kept_rows(job)
    moe = [job.config.model.is_moe_layer(i) for i in range(len(kept_L))]
    moments = {"head": {"fsdp_buffers": buffers[-1], "activations": sum(kept_L) + edges, "recompute": 0,
                        "dispatch": 0, "ep_kept": ep_kept * sum(moe), "logits": lg}}
    for l in range(len(kept_L)):
        moments[f"block {l}"] = {"fsdp_buffers": buffers[l + 1], "activations": sum(kept_L[: l + 1]) + edges,
                                 "recompute": recompute_L[l], "dispatch": disp if moe[l] else 0,
                                 "ep_kept": ep_kept * sum(moe[: l + 1]), "logits": 0}
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

    cfg, layout = job.config.model, job.layout
    if layout.ep == 1 or not layout.ep_config.keep or job.config.training.activation_checkpoint == "none":
        return 0.0
    ep_axis = rank_mesh(layout, EXPERT_AXES).reshape(-1, layout.ep)  # ep is the last of EXPERT_AXES
    (group,) = [row for row in ep_axis if job.rank in row]
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
# tests/test_memory.py re-measures it. The update direction is never materialized whole.
STEP_BUCKETS = {True: 6.6, False: 4.8}


def muon_step(job: Job) -> int:
    """Peak transient bytes of the optimizer step on `job.rank`: STEP_BUCKETS x its largest bucket,
    planned as the runtime plans it (optim/sharded/muon.py)."""
    if job.config.optim.name != "muon":
        return 0
    o = job.config.optim
    specs = model_specs(job.config.model, job.layout)  # expert ranks follow parallel.expert_inner
    options = plan_options(o, "cpu" if job.device == "cpu" else "cuda", bucket_mb=o.bucket_mb,
                           replica_split=o.replica_split, ranks_per_node=job.layout.ep_config.ranks_per_node)
    return int(STEP_BUCKETS[o.overlap] * largest_bucket(make_plan(specs, job.layout.world_size, options), job.rank))


def largest_bucket(plan, rank: int) -> int:
    """NS-dtype bytes of the blocks `rank` owns in its largest bucket."""
    inst = plan.inst
    mine = inst["owner"] == rank
    nbytes = np.array([p.nbytes for p in plan.params], dtype=np.int64)[inst["param"][mine]]
    return int(np.bincount(inst["bucket"][mine], weights=nbytes, minlength=1).max())


def estimate(job: Job) -> dict:
    state = sharded_state(job)
    kept_L, recompute_L, edges, per_block = activations(job)
    at, step = step_peak(job, kept_L, recompute_L, edges)
    parts = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"], **step,
             "muon_step": muon_step(job), "runtime": RUNTIME_GIB[job.device] * GIB}
    total = (parts["params"] + parts["grads"] + parts["optimizer"] + parts["runtime"]
             + max(sum(step.values()), parts["muon_step"]))
    device_gib = DEVICES[job.device]
    fits = device_gib is None or total / GIB <= device_gib
    return {"per_rank_gib": {k: v / GIB for k, v in parts.items()}, "total_gib": total / GIB,
            "device_gib": device_gib, "fits": fits, "suggestions": [] if fits else suggestions(job, parts, total),
            "peak_at": at if sum(step.values()) >= parts["muon_step"] else "optimizer step",
            "activation_gib_per_block": per_block, "rank": job.rank, "world": job.layout.world_size,
            "routing_skew": job.routing_skew,
            "micro_batch": {"sequences": job.tokens[0], "tokens_per_sequence": job.tokens[1]}}


def suggestions(job: Job, parts: dict, total: int) -> list[str]:
    t, out = job.config.training, []
    over = total / GIB - DEVICES[job.device]
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


def main(argv=None) -> dict:
    """The estimate of the job the arguments describe (printed, and written to --json). A user error
    (config, --world, --rank, --json) prints one line and exits with status 2, as argparse does."""
    ap = precheck.ToolParser(description="Per-rank peak memory of a training job, before launch.", prefix="error",
                             epilog="Any other --section.key=value overrides the config (the keys of launch/pretrain.py --help).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--world", type=int, default=None, help="world size (default: the product of the config's dense degrees)")
    ap.add_argument("--device", choices=tuple(DEVICES), default="h200")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--routing-skew", type=float, default=1.0,
                    help="the busiest ep rank's routed rows over the mean: scales its dispatch and kept EP buffers "
                         "(1.0: uniform routing; the projection's low band uses 1.2)")
    ap.add_argument("--json", default=None)
    from launch import posttrain_memory  # post-training configs' terms (it builds on this module)

    posttrain_memory.add_arguments(ap)
    args, overrides = ap.parse_known_args(argv)
    try:
        job = job_from_args(args, overrides)
        rollouts = posttrain_memory.rollout_shape(args, job.config)  # None unless data.source = "rollouts"
    except ValueError as e:  # ConfigError is one: it names the dotted key
        fail(str(e))
    result = estimate(job) if rollouts is None else posttrain_memory.estimate(job, rollouts)
    print(format_table(result))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as e:
            fail(f"--json {args.json}: cannot write ({e.strerror or e})")
    return result


def job_from_args(args, overrides: list[str]) -> Job:
    """The Job of the parsed arguments; ValueError naming the flag or the dotted config key otherwise,
    before any estimating (which takes seconds at real widths)."""
    config = load_config(["--config", args.config, *overrides])
    p = config.parallel
    degrees = (p.dp_replicate, p.dp_shard, p.cp)
    if args.world is None and -1 in degrees:
        raise ValueError(f"--world: the config infers parallel.dp_replicate, dp_shard or cp (-1: "
                         f"{', '.join(map(str, degrees))}); give the world size")
    world = math.prod(degrees) if args.world is None else args.world
    if world < 1:
        raise ValueError(f"--world {world}: must be >= 1")
    if not 0 <= args.rank < world:
        raise ValueError(f"--rank {args.rank}: must be in 0..{world - 1} for a world of {world}")
    if not args.routing_skew >= 1.0:  # also refuses nan
        raise ValueError(f"--routing-skew {args.routing_skew}: must be >= 1.0 (the busiest rank over the mean)")
    if args.json:
        check_output_file("--json", args.json, "estimate.json", config_inputs(args.config, config))
    layout = config.layout(world)
    if layout.pp > 1:
        raise ValueError(f"parallel.pp={layout.pp}: the estimate models whole-model ranks; it does not model "
                         f"pipeline stages yet")
    return Job(config, layout, args.rank, args.device, args.routing_skew)


def format_table(r: dict) -> str:
    rows = [f"  {k:<13}{v:9.2f} GiB" for k, v in r["per_rank_gib"].items()]
    device = "cpu (no limit)" if r["device_gib"] is None else f"{r['device_gib']:.1f} GiB"
    verdict = "fits" if r["fits"] else "does NOT fit: " + "; ".join(r["suggestions"])
    skew = "" if r["routing_skew"] == 1.0 else f", routing skew {r['routing_skew']:g}"
    return "\n".join([f"rank {r['rank']} of {r['world']}, micro-batch {r['micro_batch']}{skew}", *rows,
                      f"  {'peak':<13}{r['total_gib']:9.2f} GiB  (device {device}): {verdict}"])


if __name__ == "__main__":
    main()
