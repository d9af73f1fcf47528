"""The training loop. `train(config, layout, meshes)` reads like the algorithm:

    build model (meta) -> parallelize -> materialize shards -> seeded init
    build optimizer (sharded Muon + AdamW) and schedule; resume from the newest checkpoint
    for each step: forward/backward over micro-batches -> clip over both meshes -> optimizer step -> QK-clip
                   -> expert-bias update -> held-out eval (when due) -> metrics -> stop checks -> checkpoint

Loss convention (parallel/gradients.py): each rank's loss is the sum of its tokens' cross-entropy
divided by the GLOBAL token count of the step, and FSDP reductions sum, so gradients, losses and
norms equal the single-process ones whatever the layout. A step whose loss or gradient norm is not
finite is skipped on every rank (both are global values, so all ranks agree).

Pipeline parallelism (parallel.pp > 1): `build_pipeline` gives this rank's stages (one module under the
whole model's names) and the schedule that runs the micro-batches (parallel/pp/schedule.py); the step is
the same, with its stage-wide parts over the rank's stage (`stage_group`: the grad norm's replicas, the
expert-bias counts, Muon's plan) and its world-wide sums over every stage (loss, norm, drops, QK-clip's
per-layer maxima).

Faults (runtime/guards.py, runtime/checkpoint/checkpoint.py): resume falls back from a checkpoint that does not
load to the newest older one that does; too many consecutive non-finite steps stop the run (exit 3);
SIGTERM saves a checkpoint after the current step and stops (exit 143); a checkpoint is never written
from a non-finite state.
"""

import collections
import dataclasses
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from models import Transformer
from models.document_attention import flex_path, prepared
from models.splits import muon_splits
from optim.qk_clip import clip_metrics, enable_recording, qk_clip_, reset_recording, step_max_logits
from optim.sharded.muon import ShardedMuon
from parallel.gradients import clip_grad_norm_, global_loss, loss_fn
from parallel.ep.dispatcher import read_drop_counts
from parallel.layout import Layout
from parallel.meshes import Meshes
from parallel.overlap import set_fsdp_prefetch, set_gradient_sync
from parallel.compile import compile_regions, eager_modules, region_boundaries
from parallel.parallelize import parallelize
from parallel.pp.part import split_stages
from parallel.pp.schedule import Pipeline
from runtime import comm
from runtime.checkpoint import checkpoint
from runtime.checkpoint.checkpointer import Checkpointer
from runtime.config import JobConfig
from runtime.data.loader import Loader, startup_line
from runtime.data.mixture import mixture_eval_loss
from runtime.errors import Preempted, RunError
from runtime.eval_config import recorded_settings, settings_change
from runtime.evaluate import evaluate
from runtime.guards import DivergenceGuard, Preemption
from runtime.metrics import MetricsLogger, flops_per_token, peak_flops
from runtime.paths import job_kind, record_run_kind
from runtime.checkpoint.pretrained import init_from_pretrained
from runtime.profile import maybe_profile
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.schedule import build_scheduler, lr_factor, resume_schedule
from runtime.staging import to_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(config: JobConfig, meshes: Meshes, layout: Layout, device: torch.device, init=None) -> nn.Module:
    """The parallelized model, each rank holding only its shards, initialized from the seed.

    Built on the meta device, so even the largest preset costs no memory before it is sharded; the
    seeded init gives the same global weights for every layout (models/seeded_init.py). `init(model)`,
    if given, fills the shards instead of the seeded init and model.init_from (benchmarks/gpu_check.py:
    random weights drawn on the device)."""
    with torch.device("meta"):
        model = Transformer(config.model)
    _parallelize(model, config, meshes, layout)
    return _materialize(model, config, layout, device, init)


def build_pipeline(config: JobConfig, meshes: Meshes, layout: Layout, device: torch.device,
                   init=None) -> tuple[nn.Module, Pipeline]:
    """Under pipeline parallelism (pp > 1): this rank's stages of the model, each parallelized on the
    stage's meshes (parallel/pp/part.py), as one module under the whole model's names (what the optimizer,
    checkpoints and QK-clip read), and the schedule over them (parallel/pp/schedule.py). Initialized as
    `build_model`: the seeded init gives each stage exactly the whole model's values."""
    with torch.device("meta"):
        model, stages = split_stages(Transformer(config.model), layout, meshes.pp_rank())
    for stage in stages:
        _parallelize(stage, config, meshes, layout)
    _materialize(model, config, layout, device, init)
    t, d = config.training, config.data
    micro_shape = (d.batch_size // (layout.dp * t.grad_accum), d.seq_len // layout.cp)
    return model, Pipeline(stages, layout, meshes.pp, micro_shape, DTYPES[t.param_dtype], device, t.grad_accum)


def _parallelize(model: nn.Module, config: JobConfig, meshes: Meshes, layout: Layout) -> None:
    """parallelize(model) with the job's settings, then its FSDP prefetch (model: the whole model or a stage)."""
    t = config.training  # the layout carries checkpointing and compile (JobConfig.layout)
    parallelize(model, meshes, layout, param_dtype=DTYPES[t.param_dtype], reduce_dtype=DTYPES[t.reduce_dtype],
                document_mask=config.data.document_mask)
    set_fsdp_prefetch(model, t.fsdp_prefetch)


def _materialize(model: nn.Module, config: JobConfig, layout: Layout, device: torch.device, init) -> nn.Module:
    """Storage for the shards, then their values (`build_model`), router weights and QK-clip recording."""
    model.to_empty(device=device)
    if init is not None:
        init(model)
    elif not init_from_pretrained(config, model, dist.get_rank() if dist.is_initialized() else 0):
        model.init_weights(seed=config.training.seed)
    for router in model.routers():  # each forward's sequences are this share of the step's (cp == 1)
        router.aux_loss_weight = 1.0 / (layout.dp * config.training.grad_accum)
    if config.optim.qk_clip_tau > 0 or config.metrics.max_logit:
        enable_recording(model)  # attention keeps each head's max logit for QK-clip / the max_logit metric
    return model


def compile_backend(config: JobConfig, layout: Layout) -> str | None:
    """The backend the blocks are compiled with, or None (eager): `Layout.compile_backend_used` on this
    run's device (post-training's layout runs eager unless training.compile=true, which it refuses)."""
    return layout.compile_backend_used(config.training.device_type())


def describe_compile(config: JobConfig, layout: Layout) -> str:
    """The start-up line saying whether blocks compile, with which backend, and into which regions."""
    t, backend = config.training, compile_backend(config, layout)
    if backend is None:
        why = ("post-training runs eager" if config.data.source == "rollouts" else
               "training.compile=false" if t.compile == "false" else
               "training.compile=auto: only the direct EP path compiles, and an EP dispatch knob is on"
               if layout.ep_config.on() else
               f"training.compile=auto compiles on cuda only, this is {t.device_type()}")
        return f"compile: off ({why})"
    with torch.device("meta"):
        model = Transformer(config.model)
    boundaries = region_boundaries(model, DTYPES[t.param_dtype], t.activation_checkpoint)
    block_path = config.data.document_mask and not flex_path(t.device_type())
    eager = eager_modules(model, layout.ep, block_path)
    kinds = collections.Counter(
        " + ".join("whole" if r is block else name for name, r in block.named_modules() if r in regions) or "eager"
        for block in model.layers for regions in [set(compile_regions(block, boundaries, eager))])
    shapes = "; ".join(f"{n} block{'s' * (n > 1)}: {kind}" for kind, n in kinds.items())
    return f"compile: on ({backend}, fullgraph; {shapes})"


def build_optimizer(model: nn.Module, config: JobConfig, meshes: Meshes | None = None) -> ShardedMuon:
    """One optimizer for every parameter on both meshes: Muon for declared matrices, AdamW for the rest.
    Under pipeline parallelism Muon plans over this rank's stage only (`meshes.stage`)."""
    o = config.optim
    stage = meshes.stage.get_group() if meshes is not None and meshes.pp is not None else None
    return ShardedMuon(list(model.named_parameters()), muon_splits(model), o, bucket_mb=o.bucket_mb,
                       replica_split=o.replica_split, overlap=o.overlap,
                       ranks_per_node=config.parallel.ranks_per_node, group=stage,
                       pp_group=meshes.pp.get_group() if stage is not None else None)


def build_loader(config: JobConfig, meshes: Meshes, layout: Layout, split: str = "train", say=None,
                 data=None, group=None) -> Loader:
    """This rank's rows (dense data-parallel rank) and CP chunks of every global batch of `split`
    ("train", or "eval" / "eval/<source>": the held-out batches of runtime/evaluate.py); post-training
    rollouts train only: `data` the rollouts opened at launch (runtime/posttrain/rollout_file.py; None opens
    data.path), `group` where the ranks agree each step that the file is unchanged. `say(line)`: where a
    mixture notes a source that wraps around."""
    if config.data.source == "rollouts" and split == "train":
        return RolloutLoader(config.data, config.training.seed, vocab_size=config.model.vocab_size,
                             max_seq_len=config.model.max_seq_len, dp_rank=meshes.dp_rank(), dp_degree=layout.dp,
                             cp_rank=meshes.cp_rank(), cp_degree=layout.cp, grad_accum=config.training.grad_accum,
                             rollouts=data, group=group)
    data, holdout, key = config.token_splits()[split]
    return Loader(data, config.training.seed, dp_rank=meshes.dp_rank(), dp_degree=layout.dp,
                  cp_rank=meshes.cp_rank(), cp_degree=layout.cp, grad_accum=config.training.grad_accum,
                  vocab_size=config.model.vocab_size, holdout=holdout, split=split, path_key=key, say=say)


def micro_batch_loss(model: nn.Module, micro_batch, global_tokens: int, device) -> torch.Tensor:
    """Forward one micro-batch; this rank's share of the global mean loss (parallel/gradients.py).
    The compute dtype is FSDP's (training.param_dtype): logits come in it, the loss is fp32."""
    inputs_BS, labels_BS, positions_S = (to_device(t, device) for t in micro_batch[:3])
    documents = getattr(micro_batch, "documents", None)  # data.document_mask (runtime/data/documents.py)
    if documents is None:
        logits_BSV = model(inputs_BS, positions_S)
    else:
        documents = prepared(documents.to(device), positions_S)  # the flex path's BlockMask: once, not per layer
        logits_BSV = model(inputs_BS, positions_S, documents=documents)
    return loss_fn(logits_BSV, labels_BS, global_tokens)


def forward_backward(model: nn.Module, micro_batches, global_tokens: int, device,
                     grad_sync: str = "every") -> torch.Tensor:
    """Accumulate gradients over the micro-batches; returns this rank's share of the global mean loss.
    `grad_sync`: when FSDP reduces the gradients (parallel/overlap.py)."""
    micro_batches = list(micro_batches)
    local_loss = torch.zeros((), device=device)
    for i, micro_batch in enumerate(micro_batches):
        if grad_sync != "every":
            set_gradient_sync(model, grad_sync, last_micro_batch=i == len(micro_batches) - 1)
        loss = micro_batch_loss(model, micro_batch, global_tokens, device)
        loss.backward()
        local_loss += loss.detach()
    return local_loss


def eval_batch_loss(model: nn.Module, pipeline: Pipeline | None, device):
    """fn(micro_batches, global_tokens): one held-out batch's loss share on this rank, as training runs the
    model (runtime/evaluate.py): under pipeline parallelism the schedule's forward."""
    if pipeline is not None:
        return lambda micro_batches, tokens: pipeline.forward_loss(micro_batches, tokens, device)
    return lambda micro_batches, tokens: sum(micro_batch_loss(model, m, tokens, device) for m in micro_batches)


class NextToken:
    """The pretraining objective: mean next-token cross-entropy over the step's tokens. An objective is
    `forward_backward(model, step data, device) -> (this rank's loss share, global tokens, metrics)`,
    `after_step(model)` (after each applied optimizer step) and `state()` (extra checkpoint entries);
    post-training's is runtime/posttrain/objective.py. `pipeline`: under pipeline parallelism, the schedule
    that runs the micro-batches (parallel/pp/schedule.py)."""

    def __init__(self, config: JobConfig, pipeline: Pipeline | None = None):
        self.global_tokens = config.data.tokens_per_step()
        self.grad_sync = config.training.grad_sync
        self.pipeline = pipeline

    def forward_backward(self, model, micro_batches, device) -> tuple[torch.Tensor, int, dict]:
        tokens = getattr(micro_batches[0], "global_labels", self.global_tokens)  # document masking: trained labels
        if self.pipeline is not None:
            return self.pipeline.forward_backward(micro_batches, tokens, device), tokens, {}
        return forward_backward(model, micro_batches, tokens, device, self.grad_sync), tokens, {}

    def after_step(self, model) -> None:
        pass

    def state(self) -> dict:
        return {}



@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """Aux-loss-free balancing: every router nudges its bias by the GLOBAL per-expert token counts.
    Communication: one all-reduce of all routers' counts ([MoE layers, E] floats) over `group` (default:
    the world; under pipeline parallelism this rank's stage, whose ranks hold the same layers); each token
    is routed on exactly one of them, so the sum is the global count."""
    routers = model.routers()
    if not routers:
        return
    counts_LE = torch.stack([router.tokens_per_expert for router in routers])
    if dist.is_initialized():
        dist.all_reduce(counts_LE, group=group)
    for router, counts_E in zip(routers, counts_LE):
        router.update_expert_bias(counts_E)


def reset_expert_counts(model: nn.Module) -> None:
    for router in model.routers():
        router.tokens_per_expert.zero_()


def train_step(model, optimizer, scheduler, loader, config: JobConfig, device, objective=None,
               preemption: Preemption | None = None, stage_group=None) -> dict:
    """One optimizer step; returns the step's metrics (global values, identical on every rank), and
    "preempted": whether any rank got SIGTERM (summed with the loss: no extra collective).
    `stage_group`: under pipeline parallelism, this rank's stage (the ranks that hold its parameters):
    the grad norm counts replicas in it and the expert bias sums its counts over it; the loss, the norm,
    the drops and QK-clip's maxima are all-reduced over the world."""
    start = time.perf_counter()
    objective = objective or NextToken(config)
    local_loss, global_tokens, extra = objective.forward_backward(model, loader.next_step(), device)
    # torch.full, not torch.tensor: a tensor from host data is a pageable copy, which on CUDA waits for the stream
    signalled = torch.full((), float(preemption is not None and preemption.signalled), device=local_loss.device)
    drops = read_drop_counts(model)  # EP capacity: this rank's [dropped, routed] copies, or None
    counts = [drops[0].float(), drops[1].float()] if drops is not None else []
    local = torch.stack([local_loss.float(), signalled, *counts])  # summed with the loss: no extra collective
    loss, sigterms, *dropped = global_loss(local) if dist.is_initialized() else local
    clip = config.training.grad_clip if config.training.grad_clip > 0 else math.inf
    grad_norm = clip_grad_norm_(model.parameters(), clip, stage_group=stage_group)
    lr = optimizer.param_groups[0]["lr"]
    optimizer_start = time.perf_counter()
    tau = config.optim.qk_clip_tau
    values = [loss, grad_norm.float(), sigterms, *dropped[:1], *(d.clamp(min=1) for d in dropped[1:])]
    if tau > 0 or config.metrics.max_logit:
        max_LH = step_max_logits(model)  # MAX all-reduce; QK-clip's metrics join the readback below
        reset_recording(model)
        values += list(clip_metrics(max_LH, tau))[: 2 if tau > 0 else 1]  # without QK-clip: max_logit alone
    loss_value, norm_value, sigterm_count, *rest = torch.stack(values).tolist()  # one host sync
    ep = {"ep_dropped_fraction": rest.pop(0) / rest.pop(0)} if dropped else {}  # dropped / routed, all ranks
    qk_values = rest
    skipped = not (math.isfinite(loss_value) and math.isfinite(norm_value))
    qk = {} if skipped else dict(zip(("max_logit", "clipped_heads"), qk_values))
    if "clipped_heads" in qk:
        qk["clipped_heads"] = int(qk["clipped_heads"])
    if skipped:
        reset_expert_counts(model)  # the step's routing statistics are discarded with its gradients
    else:
        optimizer.step()
        if qk.get("clipped_heads", 0) > 0:
            qk_clip_(model, max_LH, tau, config.optim.qk_clip_alpha)  # on device, no host sync
        update_expert_bias(model, stage_group)
        objective.after_step(model)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels run asynchronously: time them, not their launch
    end = time.perf_counter()
    return {"loss": loss_value, "grad_norm": norm_value, "lr": lr, "tokens": global_tokens,
            "step_time_s": end - start, "optimizer_time_s": end - optimizer_start, "skipped": skipped,
            "preempted": sigterm_count > 0, **qk, **ep, **extra}


def run_meta(config: JobConfig) -> dict:
    """What a checkpoint records about its run: what must match to resume, and the lr schedule."""
    t = config.training
    schedule = {"optim.lr": config.optim.lr, "training.steps": t.steps, "training.warmup_steps": t.warmup_steps,
                "training.schedule": t.schedule, "training.min_lr_ratio": t.min_lr_ratio,
                "training.decay_fraction": t.decay_fraction}
    return {"model": dataclasses.asdict(config.model), "optim.name": config.optim.name, "schedule": schedule,
            "checkpoint.optim_format": checkpoint.OPTIM_FORMAT, **recorded_settings(config)}


def _check_resumable(path: str, config: JobConfig) -> dict:
    """The checkpoint's marker; RunError naming every differing key if it belongs to another model."""
    saved, current = checkpoint.read_meta(path), run_meta(config)
    diffs = checkpoint.differences(saved.get("model", {}), current["model"], "model.")
    diffs += checkpoint.differences(saved, {"optim.name": current["optim.name"]})
    if diffs:
        raise RunError(f"run.dir {config.run.dir} holds checkpoint {path} of another run ({'; '.join(diffs)}); "
                       f"resume with the same settings or choose another run.dir")
    return saved


def _schedule_change(saved: dict, config: JobConfig, step: int) -> str | None:
    """A line saying how the lr at `step` changes if the schedule's settings changed since the checkpoint."""
    old, new = saved.get("schedule"), run_meta(config)["schedule"]
    diffs = checkpoint.differences(old or {}, new)
    if not diffs:
        return None

    def lr(s):
        return s["optim.lr"] * lr_factor(step, steps=s["training.steps"], warmup_steps=s["training.warmup_steps"],
                                         schedule=s["training.schedule"], min_lr_ratio=s["training.min_lr_ratio"],
                                         decay_fraction=s["training.decay_fraction"])

    return (f"the lr schedule changed since the checkpoint ({'; '.join(diffs)}): it is recomputed, so the lr "
            f"at step {step} is {lr(new):.3e} instead of {lr({**new, **old}):.3e}")


def resume(config: JobConfig, app_state: dict, say, group=None) -> int:
    """Load the newest checkpoint under the run dir that loads; returns the step to start at.

    A checkpoint that fails to load (truncated, missing or garbled files) is reported in one line and
    the next older one is tried; if checkpoints exist but none loads, RunError: a run dir with
    checkpoints never silently starts from scratch. Collective (DCP, on `group`), identical decisions on every rank."""
    directory = checkpoint.checkpoint_dir(config.run.dir)
    found = checkpoint.complete_checkpoints(directory)
    for path in reversed(found):
        try:
            saved = _check_resumable(path, config)
            flat = saved.get("checkpoint.optim_format") == checkpoint.OPTIM_FORMAT  # older: DCP's default format
            checkpoint.load(path, {**app_state, "train": app_state["train"].in_format(flat)}, group)
        except checkpoint.Unloadable as e:
            say(f"checkpoint {path} does not load ({e}); trying an older one")
            continue
        step = checkpoint.checkpoint_step(path)
        resume_schedule(app_state["scheduler"], step, config.optim.lr)
        say(f"resumed from {path}")
        for change in (_schedule_change(saved, config, step), settings_change(saved, config),
                       app_state["data"].changes(saved)):
            if change:
                say(change)
        return step
    if found:
        raise RunError(f"no checkpoint under {directory} loads (tried {', '.join(map(os.path.basename, found))}); "
                       f"move them away to start the run over")
    return 0


def save_checkpoint(step: int, config: JobConfig, app_state: dict, log: MetricsLogger,
                    checkpointer: Checkpointer) -> None:
    """Save `step_<step>` unless the model or optimizer state is not finite (then older checkpoints stay);
    async mode returns once the state is staged (runtime/checkpoint/checkpointer.py)."""
    train_state = app_state["train"]
    if not checkpoint.all_finite(train_state.model, train_state.optimizers):
        log.info(f"step {step}: the model or optimizer state is not finite; checkpoint step_{step} not written")
        return
    checkpointer.save(step, app_state, {**run_meta(config), **app_state["data"].record()})


def checkpoint_or_stop(done: int, skipped: bool, preempted: bool, config: JobConfig, app_state: dict,
                       log: MetricsLogger, checkpointer: Checkpointer) -> None:
    """After `done` steps: save when due (not right after a skipped step, which would rotate out a good
    checkpoint during a divergence), after the last step, and on preemption, which then waits for the
    write and stops the run."""
    if preempted or done == config.training.steps or (config.checkpoint.due(done) and not skipped):
        save_checkpoint(done, config, app_state, log, checkpointer)
    if preempted:
        checkpointer.wait()
        raise Preempted(f"preempted (SIGTERM) after step {done - 1}: checkpoint step_{done} saved; relaunch the "
                        f"same command to continue")


def describe_optimizer(optimizer: ShardedMuon, config: JobConfig) -> str:
    """Muon's plan (who orthogonalizes what, and what it costs), or one line when no parameter uses Muon.
    Under pipeline parallelism: stage 0's plan, and the busiest stage's when another one is (collective
    over the pp group, on every rank: optim/sharded/muon.py `stage_plans`)."""
    if config.optim.name != "muon":
        return _adamw_line(optimizer, config)
    plans = optimizer.stage_plans()
    if plans is None:
        return optimizer.plan.describe() if optimizer.plan.params else _adamw_line(optimizer, config)
    busiest = max(range(len(plans)), key=lambda p: (plans[p][0], -p))
    return "\n".join(f"pipeline stage {p}: {plans[p][1]}" for p in ([0] if busiest == 0 else [0, busiest]))


def _adamw_line(optimizer: ShardedMuon, config: JobConfig) -> str:
    n = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    return f"optimizer: {config.optim.name}, AdamW for all {n:,} parameters (no Muon plan)"


def train(config: JobConfig, layout: Layout, meshes: Meshes, device: torch.device, build_objective=None,
          data=None) -> None:
    """Train until `training.steps`; raises RunError (Diverged, Preempted, CommFailure, ...) to stop early.
    `build_objective(config, model, meshes, layout, device)`: the objective (default: NextToken); `data`:
    what the entry point opened for the loader (`build_loader`).
    A failed collective becomes a one-line CommFailure per rank (runtime/comm.py); every other stop waits
    for the in-flight checkpoint write."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = comm.checkpoint_group(config.comm)
    watch = comm.CommWatch(config.comm, config.run.dir, rank, meshes, exempt=[group])
    checkpointer = Checkpointer(config.checkpoint, checkpoint.checkpoint_dir(config.run.dir), group=group,
                                pin_memory=device.type == "cuda")
    try:
        _train(config, layout, meshes, device, build_objective, checkpointer, watch, data)
    except (RunError, KeyboardInterrupt) as e:
        cause = e.__cause__ if isinstance(e, RunError) else None  # a checkpoint write a dead peer failed
        failure = watch.failure(cause) if cause is not None else None
        if failure is None:
            checkpointer.close(wait=True)
            raise
        failure.abandoned_write = checkpointer.close(wait=False)
        raise failure from None
    except Exception as e:
        abandoned = checkpointer.close(wait=False)
        failure = watch.failure(e)
        if failure is not None:
            failure.abandoned_write = abandoned  # the entry point must then exit without joining its thread
            raise failure from None
        raise
    checkpointer.close(wait=True)  # the last step's save


def _train(config: JobConfig, layout: Layout, meshes: Meshes, device: torch.device, build_objective,
           checkpointer: Checkpointer, watch: comm.CommWatch, data=None) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(config.training.seed)
    pipeline, stage_group = None, (meshes.stage.get_group() if layout.pp > 1 else None)
    if layout.pp > 1:
        model, pipeline = build_pipeline(config, meshes, layout, device)
    else:
        model = build_model(config, meshes, layout, device)
    objective = (build_objective(config, model, meshes, layout, device) if build_objective
                 else NextToken(config, pipeline))
    optimizer = build_optimizer(model, config, meshes)
    if rank == 0 or layout.pp > 1:  # a collective under pipeline parallelism
        plan = describe_optimizer(optimizer, config)
        if rank == 0:
            print(plan, flush=True)
    scheduler = build_scheduler(optimizer, config.training)
    agreement = comm.host_group() if config.data.source == "rollouts" else None  # the rollout file unchanged
    loader = build_loader(config, meshes, layout, say=lambda line: rank == 0 and print(line, flush=True), data=data,
                          group=agreement)
    app_state = {"train": checkpoint.ModelOptimState(model, [optimizer]), "scheduler": scheduler,
                 "data": loader, "rng": checkpoint.RNGState(), **objective.state()}
    watch.begin()  # every group exists now: comm.init_timeout_s until the first step is done
    watch.at(None, "resume")
    start = resume(config, app_state, say=lambda line: rank == 0 and print(line, flush=True), group=checkpointer.group)
    if start >= config.training.steps:  # a finished run relaunched: no step, no new checkpoint, metrics kept
        if rank == 0:
            print(f"nothing to do: step {start} of {config.training.steps} done ({config.run.dir}); raise "
                  f"training.steps to continue", flush=True)
        return
    if rank == 0:
        record_run_kind(config.run.dir, job_kind(config))  # the run dir now holds a run of this kind
    log = MetricsLogger(config.run.dir, rank, config.training.steps, start_step=start, device=device,
                        flops_per_token=flops_per_token(config.model, config.data.seq_len),
                        peak_flops=peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None,
                        world_size=layout.world_size, log_interval=config.training.log_interval,
                        tensorboard=config.metrics.tensorboard)
    divergence = DivergenceGuard(config.training.max_nonfinite_steps, config.training.max_nonfinite_fraction)
    eval_loaders = {split: build_loader(config, meshes, layout, split) for split in config.token_splits()
                    if split.startswith("eval")}
    if rank == 0:
        held_out = "; ".join(f"{s[5:]}: {e.describe()}" if "/" in s else e.describe() for s, e in eval_loaders.items())
        print(startup_line(loader.describe(), held_out or None, config.data, config.eval), flush=True)

    def eval_losses() -> dict[str, float]:
        """eval_loss, and for a mixture eval_loss/<name> per source with eval_loss their weighted mean."""
        losses = {"eval_loss" + split[4:]: evaluate(model, e, config.eval.steps, config.data.tokens_per_step(),
                                                    eval_batch_loss(model, pipeline, device))
                  for split, e in eval_loaders.items()}
        if "eval_loss" not in losses:  # a mixture's sources: the overall loss is their weighted mean
            losses = {"eval_loss": mixture_eval_loss(config.data.sources, losses), **losses}
        return losses

    with maybe_profile(config.profile, config.run.dir, rank, optimizer, device.type, start) as profiler, \
            Preemption() as preemption:
        try:
            for step in range(start, config.training.steps):
                watch.at(step, "training step")
                with profiler.count_syncs():
                    stats = train_step(model, optimizer, scheduler, loader, config, device, objective, preemption,
                                       stage_group)
                preempted = stats.pop("preempted")
                if config.data.sources:
                    stats["tokens_by_source"] = loader.tokens_by_source(step)
                if eval_loaders and config.eval.due(step + 1, config.training.steps):
                    watch.at(step, "held-out eval")
                    stats.update(eval_losses())
                log.log(step, **stats)
                profiler.step()
                divergence.record(step, finite=not stats["skipped"], last=step + 1 == config.training.steps)
                watch.at(step, "checkpoint")
                checkpoint_or_stop(step + 1, stats["skipped"], preempted, config, app_state, log, checkpointer)
                watch.step_done(step, stats["step_time_s"])
        finally:
            log.close()
