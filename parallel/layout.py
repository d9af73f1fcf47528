"""Parallel layout: two independent data-parallel layouts over the same ranks.

Dense weights (attention, norms, embeddings, dense FFN, shared experts, router) use
    dp_replicate x dp_shard x cp = world size,
routed-expert weights use
    edp_replicate x edp_shard x ep = world size.
Because the MoE layer is token-wise, the two layouts are independent: ep may span the ranks that
split one sequence by cp (cp=2 and ep=8 fit on 8 ranks).

`ParallelConfig` is what the user writes (-1 = infer one degree per layout from the world size);
`ParallelConfig.resolve(world_size)` gives a `Layout` of plain ints and `Layout.validate(...)` checks
it against the model and the batch. Both raise ValueError with every number involved and touch no
process group, so every rank fails the same way before any collective can hang.

Rank numbering (parallel/meshes.py): the dense mesh numbers ranks with cp innermost; the expert mesh
numbers them with `expert_inner` innermost (consecutive ranks, inside a node) and edp_replicate
outermost. "ep" (the default) keeps the all-to-all inside a node (ep <= 8) and strides the expert
FSDP group across nodes; "edp_shard" keeps the expert all-gathers and reduce-scatters inside a node
(edp_shard <= 8) and sends the ep all-to-all across nodes. benchmarks/step_projection.py compares
both (docs/performance.md, "Whole-step projection").

Pipeline parallelism (`pp`, parallel/pp/plan.py) is the outermost axis: the world is pp stages of
world / pp consecutive ranks each, and both layouts above multiply to the ranks of one stage.

`ranks_per_node` and the `ep_*` dispatch knobs ride along unchanged (docs/expert_parallel.md); each
dispatch knob needs ep > 1 and is refused in combinations the runtime does not implement (the one table:
parallel/ep/refusals.py).

There is no tensor parallelism, so attention heads never constrain a layout: context parallelism
all-gathers K/V (every rank keeps all heads) and Muon's per-head split is the optimizer's business.
"""

from dataclasses import dataclass
from typing import Literal

from parallel.ep import refusals
from parallel.pp import plan as pp_plan

DENSE_AXES = ("dp_replicate", "dp_shard", "cp")
EXPERT_AXES = ("edp_replicate", "edp_shard", "ep")
EXPERT_INNER = ("ep", "edp_shard")  # the expert axis numbered innermost (consecutive ranks)
DEGREES = DENSE_AXES + EXPERT_AXES


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of the dense and expert layouts; -1 means "infer from the world size"."""

    dp_replicate: int = 1  # dense: HSDP replicas (gradients all-reduced across them)
    dp_shard: int = -1  # dense: FSDP shard group size (dense weights are sharded over dp_shard x cp)
    cp: int = 1  # dense: context parallel degree (each sequence split into 2*cp balanced chunks)
    ep: int = 1  # expert: expert parallel degree (routed experts split on the expert dim)
    edp_replicate: int = 1  # expert: HSDP replicas of the routed-expert weights
    edp_shard: int = -1  # expert: FSDP shard group size of the routed-expert weights
    expert_inner: Literal["ep", "edp_shard"] = "ep"  # expert axis on consecutive ranks (inside a node): ep = all-to-all in a node, expert FSDP across nodes; edp_shard = expert FSDP in a node, ep across nodes
    ranks_per_node: int = 8  # ranks per node (consecutive ranks): the optimizer plan's and the EP dispatch's intra/inter-node split
    ep_dedup: bool = False  # EP: send a token once per destination node, fan out inside it, sum inside it on the way back (parallel/ep/dedup.py)
    ep_capacity_factor: float = 0.0  # EP: > 0 = fixed per-peer buffers of ceil(factor*T*K/ep) rows, no host sync, copies over it dropped (parallel/ep/capacity.py)
    ep_overlap_chunks: int = 1  # EP: > 1 = cut each layer's copies into this many pieces, one's all-to-alls in flight while another computes (parallel/ep/pieces.py)
    ep_dispatch_dtype: Literal["compute", "float8_e4m3"] = "compute"  # EP: dtype the dispatched activations cross in (float8_e4m3: per-token scale; the combine stays in the compute dtype)
    ep_recompute: Literal["resend", "keep"] = "resend"  # EP under training.activation_checkpoint: resend = the recompute reruns the all-to-alls; keep = the forward keeps what they received and the recompute reuses it (more memory, parallel/ep/keep.py)
    ep_combine_grad_dtype: Literal["compute", "float8_e4m3"] = "compute"  # EP: dtype the combine's gradient crosses in, back to the experts (float8_e4m3: per-token scale, as DeepSeek-V3; parallel/ep/direct.py)
    # pipeline parallelism (parallel/pp/plan.py; docs/pretraining.md "Pipeline parallelism")
    pp: int = 1  # pipeline stages' rank groups, the outermost axis: each holds world/pp consecutive ranks, both layouts above inside it
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "zbv", "dualpipev", "gpipe"] = "1f1b"  # torch.distributed.pipelining schedule; its micro-batches are training.grad_accum
    pp_stages_per_rank: int = -1  # stages each rank runs: -1 = the schedule's (1 for 1f1b and gpipe, 2 for the others)
    pp_layers: tuple[int, ...] = ()  # blocks per stage, pp x stages per rank numbers; empty = spread evenly, the embedding and the head each weighing a block
    reshard_after_forward: Literal["auto", "true", "false"] = "auto"  # FSDP frees gathered weights after each forward; auto = true without pp, false with it (zero-bubble schedules refuse true)

    def check_degrees(self) -> None:
        """ValueError unless every degree is positive or -1 and expert_inner is a known axis."""
        for name in DEGREES:
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise ValueError(f"parallel.{name}={value}: degrees must be positive or -1 (infer)")
        _check_expert_inner(self.expert_inner)
        check_ep_knobs(self)
        pp_plan.check_pp_knobs(self)

    def resolve(self, world_size: int) -> "Layout":
        """Fill in the -1 degrees so that each layout multiplies to `world_size`."""
        if world_size < 1:
            raise ValueError(f"world size must be positive, got {world_size}")
        self.check_degrees()
        stage = _stage_size(world_size, self.pp)
        dense = _resolve_axes(self, DENSE_AXES, stage, "dense", self.pp)
        expert = _resolve_axes(self, EXPERT_AXES, stage, "expert", self.pp)
        knobs = {k: getattr(self, k) for k in EP_KNOBS + PP_KNOBS}
        return Layout(world_size=world_size, **dense, **expert, expert_inner=self.expert_inner, **knobs)


def _stage_size(world_size: int, pp: int) -> int:
    """Ranks per pipeline stage; ValueError unless pp divides the world size."""
    if world_size % pp:
        raise ValueError(f"parallel.pp={pp} does not divide the world size {world_size}")
    return world_size // pp


def _ranks_phrase(ranks: int, pp: int) -> str:
    """How a layout's rank count is named in errors: the world, or one pipeline stage of it."""
    return f"the world size is {ranks}" if pp == 1 else f"a pipeline stage has {ranks} ranks (world size {ranks * pp} / parallel.pp={pp})"


def _check_expert_inner(value) -> None:
    if value not in EXPERT_INNER:
        raise ValueError(f"parallel.expert_inner={value!r}: must be one of {', '.join(map(repr, EXPERT_INNER))}")


PP_KNOBS = ("pp", "pp_schedule", "pp_stages_per_rank", "pp_layers", "reshard_after_forward")
EP_KNOBS = ("ranks_per_node", "ep_dedup", "ep_capacity_factor", "ep_overlap_chunks", "ep_dispatch_dtype", "ep_recompute",
            "ep_combine_grad_dtype")
# EP knobs that were removed (the calibrated projection put them in no recommended row, docs/performance.md):
# a config that still sets one fails naming it (runtime/config.py), with what to use instead
REMOVED_EP_KNOBS = {
    "ep_interleave": "removed (two halves per MoE block); to overlap the all-to-alls with the experts use "
                     "parallel.ep_overlap_chunks = 2",
    "ep_pair_micro_batches": "removed (paired micro-batches); delete the line: micro-batches run one after another",
    "ep_recompute_ahead": "removed (the recompute ahead); delete the line: with parallel.ep_recompute = \"keep\" "
                          "the recompute still sends nothing",
}
DISPATCH_DTYPES = ("compute", "float8_e4m3")
RECOMPUTE_MODES = ("resend", "keep")


def check_ep_knobs(c) -> None:
    """ValueError (one line, the key and its value) for an out-of-range node size or EP dispatch knob."""
    if c.ranks_per_node < 1:
        raise ValueError(f"parallel.ranks_per_node={c.ranks_per_node}: must be >= 1")
    if not (c.ep_capacity_factor >= 0 and c.ep_capacity_factor != float("inf")):
        raise ValueError(f"parallel.ep_capacity_factor={c.ep_capacity_factor}: must be finite and >= 0 (0 = off)")
    if c.ep_overlap_chunks < 1:
        raise ValueError(f"parallel.ep_overlap_chunks={c.ep_overlap_chunks}: must be >= 1 (1 = no overlap)")
    if c.ep_dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"parallel.ep_dispatch_dtype={c.ep_dispatch_dtype!r}: expected one of {DISPATCH_DTYPES}")
    if c.ep_recompute not in RECOMPUTE_MODES:
        raise ValueError(f"parallel.ep_recompute={c.ep_recompute!r}: expected one of {RECOMPUTE_MODES}")
    if c.ep_combine_grad_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"parallel.ep_combine_grad_dtype={c.ep_combine_grad_dtype!r}: expected one of {DISPATCH_DTYPES}")


def check_recompute(layout, activation_checkpoint: str) -> None:
    """ValueError (one line) for an EP knob that does not apply to `activation_checkpoint` (parallel/ep/refusals.py)."""
    refusals.check(layout, activation_checkpoint=activation_checkpoint)


def _resolve_axes(config: ParallelConfig, axes: tuple[str, ...], world_size: int, name: str, pp: int = 1) -> dict:
    """The degrees of `axes` multiplying to `world_size` (the ranks of one pipeline stage when pp > 1)."""
    values = {a: getattr(config, a) for a in axes}
    formula = " x ".join(f"parallel.{a}={v}" for a, v in values.items())
    inferred = [a for a, v in values.items() if v == -1]
    if len(inferred) > 1:
        raise ValueError(f"{name} layout {formula}: at most one degree may be -1 (infer), got {inferred}")
    known = 1
    for v in values.values():
        known *= v if v != -1 else 1
    if inferred:
        if world_size % known:
            where = "world size" if pp == 1 else f"pipeline stage size (world / parallel.pp={pp})"
            raise ValueError(
                f"{name} layout {formula}: {where} {world_size} is not divisible by {known}, "
                f"cannot infer {inferred[0]}"
            )
        values[inferred[0]] = world_size // known
    elif known != world_size:
        raise ValueError(f"{name} layout {formula} = {known} ranks, but {_ranks_phrase(world_size, pp)}")
    return values


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Resolved degrees (all positive ints); each layout multiplies to `world_size`."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    edp_replicate: int
    edp_shard: int
    expert_inner: str = "ep"  # see ParallelConfig.expert_inner
    ranks_per_node: int = 8  # see ParallelConfig (and the EP knobs below)
    ep_dedup: bool = False
    ep_capacity_factor: float = 0.0
    ep_overlap_chunks: int = 1
    ep_dispatch_dtype: str = "compute"
    ep_recompute: str = "resend"
    ep_combine_grad_dtype: str = "compute"
    # pipeline parallelism: see ParallelConfig and parallel/pp/plan.py
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = -1
    pp_layers: tuple[int, ...] = ()
    reshard_after_forward: str = "auto"

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (the whole world when pp == 1): both layouts multiply to it."""
        return self.world_size // self.pp

    @property
    def expert_numbering(self) -> tuple[str, ...]:
        """EXPERT_AXES in rank-numbering order, outermost first (the last one is on consecutive ranks)."""
        inner = self.expert_inner
        return ("edp_replicate", *(a for a in EXPERT_AXES[1:] if a != inner), inner)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks read different sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def dense_shard(self) -> int:
        """Size of the dense FSDP shard group (dp_shard and cp together)."""
        return self.dp_shard * self.cp

    def local_experts(self, n_routed_experts: int) -> int:
        """Experts each ep rank computes."""
        return n_routed_experts // self.ep

    def expert_shard_dim(self, n_routed_experts: int) -> int:
        """Tensor dim FSDP shards expert weights on: 0 (whole experts per rank) when the local experts
        split evenly over the edp_shard ranks, else 1 (a matrix dim). FSDP2 chunks unevenly: 48 local
        experts (Kimi K2, ep=8) over edp_shard=32 would give 24 ranks 2 experts and 8 ranks none."""
        return 0 if self.local_experts(n_routed_experts) % self.edp_shard == 0 else 1

    def validate(self, model_config, seq_len: int | None, global_batch: int | None) -> None:
        """Check the layout against the model and the batch; ValueError naming fields and numbers.
        None skips the sequence or batch checks (post-training rollouts are packed by tokens)."""
        _check_positive(self)
        n_experts = model_config.n_routed_experts
        has_moe = n_experts > 0 and model_config.n_layers > model_config.n_dense_layers
        if not has_moe and self.ep > 1:
            raise ValueError(
                f"parallel.ep={self.ep} but the model has no routed experts "
                f"(n_routed_experts={n_experts}, n_layers={model_config.n_layers}, "
                f"n_dense_layers={model_config.n_dense_layers})"
            )
        if has_moe and n_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} does not divide model.n_routed_experts={n_experts}")
        if has_moe and self.expert_shard_dim(n_experts) == 1:
            # FSDP shards expert matrices on dim 1 (moe_inter_dim for w1/w3, dim for w2): must be even.
            for name, size in (("moe_inter_dim", model_config.moe_inter_dim), ("dim", model_config.dim)):
                if size % self.edp_shard:
                    raise ValueError(
                        f"model.{name}={size} is not divisible by parallel.edp_shard={self.edp_shard} "
                        f"(local experts n_routed_experts/ep = {n_experts}/{self.ep} = "
                        f"{self.local_experts(n_experts)} do not split evenly over edp_shard, so experts are sharded on a matrix dim)"
                    )
        if seq_len is not None and seq_len % (2 * self.cp):
            raise ValueError(
                f"data.seq_len={seq_len} is not divisible by 2*cp={2 * self.cp} "
                f"(context parallelism cuts each sequence into 2*cp equal chunks)"
            )
        if has_moe and model_config.aux_loss_alpha > 0 and self.cp > 1:
            raise ValueError(
                f"model.aux_loss_alpha={model_config.aux_loss_alpha} with parallel.cp={self.cp}: the sequence-wise "
                f"aux loss needs whole sequences on one rank; use cp=1 or aux-loss-free balancing (alpha=0)"
            )
        if seq_len is not None and seq_len > model_config.max_seq_len:
            raise ValueError(f"data.seq_len={seq_len} exceeds model.max_seq_len={model_config.max_seq_len}")
        if global_batch is not None and global_batch % self.dp:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by dp_replicate={self.dp_replicate} x "
                f"dp_shard={self.dp_shard} = {self.dp} data-parallel ranks"
            )


def _check_positive(layout: Layout) -> None:
    for name in ("world_size",) + DEGREES:
        if getattr(layout, name) < 1:
            raise ValueError(f"parallel.{name}={getattr(layout, name)}: degrees must be positive")
    _check_expert_inner(layout.expert_inner)
    check_ep_knobs(layout)
    pp_plan.check_pp_knobs(layout)
    refusals.check(layout)  # refused EP knob combinations
    stage = _stage_size(layout.world_size, layout.pp)
    dense = layout.dp_replicate * layout.dp_shard * layout.cp
    expert = layout.edp_replicate * layout.edp_shard * layout.ep
    for name, axes, product in (("dense", DENSE_AXES, dense), ("expert", EXPERT_AXES, expert)):
        if product != stage:
            formula = " x ".join(f"{a}={getattr(layout, a)}" for a in axes)
            raise ValueError(f"{name} layout {formula} = {product} ranks, but {_ranks_phrase(stage, layout.pp)}")
