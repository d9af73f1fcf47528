"""Parallel layout: two independent data-parallel layouts over the same ranks.

Dense weights (attention, norms, embeddings, dense FFN, shared experts, router) use
    dp_replicate x dp_shard x cp = world size,
routed-expert weights use
    edp_replicate x edp_shard x ep = world size.
Because the MoE layer is token-wise, the two layouts are independent: ep may span the ranks that
split one sequence by cp (cp=2 and ep=8 fit on 8 ranks).

`ParallelConfig` is what the user writes (-1 = infer one degree per layout from the world size), with
the EP knobs it inherits from `EPConfig` (parallel/ep/config.py, declared there once);
`ParallelConfig.resolve(world_size, ...)` gives a `Layout`: plain ints, the EP knobs as one `EPConfig`
(`layout.ep_config`), and the run's activation checkpointing and compile settings, which is everything
parallel/parallelize.py reads. `Layout.validate(...)` checks it against the model and the batch and
then runs the EP refusal table (parallel/ep/refusals.py) once, every setting known. Both raise
ValueError with every number involved and touch no process group, so every rank fails the same way
before any collective can hang.

Rank numbering (parallel/meshes.py): the dense mesh numbers ranks with cp innermost; the expert mesh
numbers them with `expert_inner` innermost (consecutive ranks, inside a node) and edp_replicate
outermost. "ep" (the default) keeps the all-to-all inside a node (ep <= 8) and strides the expert
FSDP group across nodes; "edp_shard" keeps the expert all-gathers and reduce-scatters inside a node
(edp_shard <= 8) and sends the ep all-to-all across nodes. benchmarks/step_projection.py compares
both (docs/performance.md, "Whole-step projection").

Pipeline parallelism (parallel/pp/) is the outermost axis: the world is pp stages of world / pp
consecutive ranks each, and both layouts above multiply to the ranks of one stage. Its knobs are
inherited from `PipelineConfig` (parallel/pp/config.py) and ride along as one `layout.pp_config`;
`Layout.validate` checks them with the rest (parallel/pp/plan.py `check_pipeline`).

There is no tensor parallelism, so attention heads never constrain a layout: context parallelism
all-gathers K/V (every rank keeps all heads) and Muon's per-head split is the optimizer's business.
"""

from dataclasses import dataclass
from typing import Literal

from parallel.ep import refusals
from parallel.ep.config import EPConfig
from parallel.pp.config import PipelineConfig
from parallel.pp.plan import check_pipeline, compiles_auto

DENSE_AXES = ("dp_replicate", "dp_shard", "cp")
EXPERT_AXES = ("edp_replicate", "edp_shard", "ep")
EXPERT_INNER = ("ep", "edp_shard")  # the expert axis numbered innermost (consecutive ranks)
DEGREES = DENSE_AXES + EXPERT_AXES


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(EPConfig, PipelineConfig):
    """The `[parallel]` section: degrees of the dense and expert layouts (-1 = infer from the world size),
    the EP knobs (inherited from EPConfig, parallel/ep/config.py) and the pipeline knobs (inherited from
    PipelineConfig, parallel/pp/config.py)."""

    dp_replicate: int = 1  # dense: HSDP replicas (gradients all-reduced across them)
    dp_shard: int = -1  # dense: FSDP shard group size (dense weights are sharded over dp_shard x cp)
    cp: int = 1  # dense: context parallel degree (each sequence split into 2*cp balanced chunks)
    ep: int = 1  # expert: expert parallel degree (routed experts split on the expert dim)
    edp_replicate: int = 1  # expert: HSDP replicas of the routed-expert weights
    edp_shard: int = -1  # expert: FSDP shard group size of the routed-expert weights
    expert_inner: Literal["ep", "edp_shard"] = "ep"  # expert axis on consecutive ranks (inside a node): ep = all-to-all in a node, expert FSDP across nodes; edp_shard = expert FSDP in a node, ep across nodes

    def check_degrees(self) -> None:
        """ValueError unless every degree is positive or -1, expert_inner a known axis and each EP knob in range."""
        for name in DEGREES:
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise ValueError(f"parallel.{name}={value}: degrees must be positive or -1 (infer)")
        _check_expert_inner(self.expert_inner)
        self.check()
        PipelineConfig.check(self)

    def resolve(self, world_size: int, *, activation_checkpoint: str = "none", compile: str = "false",
                compile_backend: str = "inductor") -> "Layout":
        """Fill in the -1 degrees so that each layout multiplies to `world_size`; the run's settings ride
        along (`Layout`: training.activation_checkpoint, training.compile, training.compile_backend)."""
        if world_size < 1:
            raise ValueError(f"world size must be positive, got {world_size}")
        self.check_degrees()
        stage = _stage_size(world_size, self.pp)
        dense = _resolve_axes(self, DENSE_AXES, stage, "dense", self.pp)
        expert = _resolve_axes(self, EXPERT_AXES, stage, "expert", self.pp)
        return Layout(world_size=world_size, **dense, **expert, expert_inner=self.expert_inner,
                      ep_config=self.ep_only(), pp_config=self.pp_only(), activation_checkpoint=activation_checkpoint,
                      compile=compile, compile_backend=compile_backend)


def _stage_size(world_size: int, pp: int) -> int:
    """Ranks per pipeline stage; ValueError unless pp divides the world size."""
    if world_size % pp:
        raise ValueError(f"parallel.pp={pp} does not divide the world size {world_size}")
    return world_size // pp


def _ranks_phrase(ranks: int, pp: int) -> str:
    """How a layout's rank count is named in errors: the world, or one pipeline stage of it."""
    if pp == 1:
        return f"the world size is {ranks}"
    return f"a pipeline stage has {ranks} ranks (world size {ranks * pp} / parallel.pp={pp})"


def _check_expert_inner(value) -> None:
    if value not in EXPERT_INNER:
        raise ValueError(f"parallel.expert_inner={value!r}: must be one of {', '.join(map(repr, EXPERT_INNER))}")


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
    """Resolved degrees (all positive ints; each layout multiplies to `world_size`), the EP knobs, and the
    run's settings parallel/parallelize.py applies: everything the EP refusal table reads but the batch."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    edp_replicate: int
    edp_shard: int
    expert_inner: str = "ep"  # see ParallelConfig.expert_inner
    ep_config: EPConfig = EPConfig()  # the EP knobs (parallel/ep/config.py)
    pp_config: PipelineConfig = PipelineConfig()  # the pipeline knobs (parallel/pp/config.py)
    activation_checkpoint: str = "none"  # training.activation_checkpoint (parallel/activation_checkpoint.py)
    compile: str = "false"  # training.compile: "true", "auto" (on CUDA when it can) or "false"
    compile_backend: str = "inductor"  # training.compile_backend (parallel/compile.py)

    @property
    def pp(self) -> int:
        """Pipeline ranks (stages' rank groups), the outermost axis (parallel/pp/plan.py)."""
        return self.pp_config.pp

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

    def compile_backend_used(self, device_type: str) -> str | None:
        """The backend parallelize compiles the blocks with, or None (eager): compile = "true", or "auto" on
        CUDA when no EP dispatch knob is on (only the direct EP path compiles: parallel/ep/refusals.py) and no
        zero-bubble pipeline schedule runs (torch's refuse compiled stages: parallel/pp/plan.py)."""
        auto = (self.compile == "auto" and device_type == "cuda" and not self.ep_config.on()
                and compiles_auto(self.pp_config))
        on = self.compile == "true" or auto
        return self.compile_backend if on else None

    def validate(self, model_config, seq_len: int | None, global_batch: int | None, grad_accum: int = 1) -> None:
        """Check the layout against the model and the batch, then the EP refusal table once; ValueError
        naming fields and numbers. None skips the sequence or batch checks (post-training rollouts are
        packed by tokens)."""
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
        refusals.check(self, model_config, seq_len, global_batch, grad_accum)  # the one EP refusal check
        check_pipeline(self.pp_config, model_config.n_layers, grad_accum, self.activation_checkpoint,
                       self.compile == "true")


def _check_positive(layout: Layout) -> None:
    for name in ("world_size",) + DEGREES:
        if getattr(layout, name) < 1:
            raise ValueError(f"parallel.{name}={getattr(layout, name)}: degrees must be positive")
    _check_expert_inner(layout.expert_inner)
    layout.ep_config.check()
    layout.pp_config.check()
    stage = _stage_size(layout.world_size, layout.pp)
    dense = layout.dp_replicate * layout.dp_shard * layout.cp
    expert = layout.edp_replicate * layout.edp_shard * layout.ep
    for name, axes, product in (("dense", DENSE_AXES, dense), ("expert", EXPERT_AXES, expert)):
        if product != stage:
            formula = " x ".join(f"{a}={getattr(layout, a)}" for a in axes)
            raise ValueError(f"{name} layout {formula} = {product} ranks, but {_ranks_phrase(stage, layout.pp)}")
