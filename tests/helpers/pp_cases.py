"""Shared fixtures of the pipeline-parallel tests (tests/ranks/test_pp_schedules.py): the job,
the runtime's own step on this rank (runtime/train.py `build_pipeline`, `build_optimizer`, `train_step`: seeded
init, the schedule, clipping, the optimizer, QK-clip, the expert-bias update), what each step leaves to compare,
and the single-process run of the same job.

The job: the debug preset at 6 blocks (one dense, five MoE: 4 to 8 stages of 0 to 3 blocks), synthetic tokens,
16 sequences of 32 per step, QK-clip at tau 0.05 (heads clip every step: the debug model's logits are ~0.08),
one step (a job may ask for more), clipping at norm 1 (active: the norm is ~5.5), AdamW's eps 1e-3 (its first
steps are sign-like with eps 1e-8, which turns fp32 noise of tiny gradients into whole lr-sized moves; as
tests/ranks/test_parallel_parity.py). What a step leaves: its loss, gradient norm, max logit and clipped heads, its host
syncs; the first step's gradients after clipping (an optimizer pre-step hook: the clip factor and the gradients
in one) and its router counts; after the last step every parameter, every router's expert bias (moved by the
stage's token counts), a held-out eval_loss through the schedule's forward.

Tolerances as the dual-mesh parity tests (tests/ranks/test_parallel_parity.py): fp32, the same math in another
summation order (batch split over ranks and micro-batches, gradients summed by reduce-scatter), 2e-5 relative on
gradients and 1e-5 on loss and norm. Parameters after the optimizer step: 1e-5 relative to each parameter's
largest entry (Muon's orthogonalized update has magnitude lr x its scale whatever the gradient's, so a gradient
error of ~1e-6 relative moves it by about as much; AdamW's, with eps 1e-3, by at most lr x the error / eps).
Observed on this CPU: loss <= 8e-8, norm <= 8e-7, max logit <= 7e-7, gradients <= 1e-6, parameters <= 3e-6.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel.meshes import build_meshes
from runtime import train as T
from runtime.config_parser import load_config
from runtime.evaluate import evaluate
from runtime.syncs import count_syncs, mark_optimizer_host_state

WORLD, RPN = 8, 4
GRAD_RTOL, NORM_RTOL, PARAM_RTOL = 2e-5, 1e-5, 1e-5
JOB = ["--model.n_layers=6", "--data.source=synthetic", "--data.seq_len=32", "--data.batch_size=16",
       "--training.steps=1", "--training.warmup_steps=0", "--training.grad_clip=1.0",
       "--checkpoint.interval=0", "--eval.steps=2", "--optim.adam_eps=1e-3", "--optim.qk_clip_tau=0.05",
       f"--parallel.ranks_per_node={RPN}"]
# pp 2 x (dense dp_shard 2 x cp 2 = experts ep 4), and pp 4 x (dense dp_shard 2 = experts ep 2)
PP2 = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "edp_replicate": 1, "edp_shard": 1, "ep": 4}
PP4 = {"pp": 4, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "edp_replicate": 1, "edp_shard": 1, "ep": 2}
SINGLE = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "edp_replicate": 1, "edp_shard": 1, "ep": 1}


def job(parallel: dict, grad_accum: int, *extra: str) -> list[str]:
    """The job's arguments with `parallel` degrees and knobs and `grad_accum` micro-batches."""
    return JOB + [f"--parallel.{k}={v}" for k, v in parallel.items()] + [f"--training.grad_accum={grad_accum}",
                                                                          *extra]


_MESHES = {}  # this rank process's meshes, per layout (a layout's groups serve all its cases)


def _meshes(layout):
    key = tuple(getattr(layout, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "edp_replicate", "edp_shard",
                                             "ep"))
    if key not in _MESHES:
        _MESHES[key] = build_meshes(layout, "cpu")
    return _MESHES[key]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (the single-process run: a DTensor on one rank is its own local shard)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _like(whole: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole` under `t`'s placements (no communication)."""
    if not isinstance(t, DTensor):
        return whole
    return distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()


def _worst(reference: dict, named) -> float:
    """The largest error of the local pieces `named` ((name, tensor)) against the whole `reference` tensors,
    relative to each reference's largest entry."""
    worst = 0.0
    for name, t in named:
        piece, scale = _like(reference[name], t), reference[name].abs().max().item()
        error = (_local(t) - piece).abs().max().item() if piece.numel() else 0.0
        worst = max(worst, error / (scale or 1.0))
    return worst


def run_job(argv: list[str], reference: dict | None = None, nan_on_rank: int | None = None,
            reshard_after_forward: str | None = None) -> dict:
    """The job's steps on this rank (any world size; pp = 1 or more), through the runtime, then one held-out
    evaluation (eval.steps batches). Without `reference`: what it leaves, whole (the single-process run);
    with it: `errors` against it, computed here on the local shards. `nan_on_rank`: that rank's logits turn NaN
    in the first step's forward; `reshard_after_forward`: set on the checked layout (what the config refuses)."""
    config = load_config(argv)
    layout = config.layout(dist.get_world_size())
    if reshard_after_forward is not None:
        layout = dataclasses.replace(layout, pp_config=dataclasses.replace(
            layout.pp_config, reshard_after_forward=reshard_after_forward))
    meshes = _meshes(layout)
    device = torch.device("cpu")
    torch.manual_seed(config.training.seed)
    pipeline, stage = None, None
    if layout.pp > 1:
        model, pipeline = T.build_pipeline(config, meshes, layout, device)
        stage = meshes.stage.get_group()
    else:
        model = T.build_model(config, meshes, layout, device)
    optimizer = T.build_optimizer(model, config, meshes)
    scheduler = T.build_scheduler(optimizer, config.training)
    loader = T.build_loader(config, meshes, layout)
    objective = T.NextToken(config, pipeline)
    first = {}

    def keep_first_step(opt, args, kwargs):  # after the step's backward and clipping, before the update
        if not first:
            first["grads"] = [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]
            first["counts"] = {n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")}

    hook = optimizer.register_step_pre_hook(keep_first_step)
    poison = None
    if nan_on_rank == dist.get_rank() and model.output is not None:
        poison = model.output.register_forward_hook(lambda m, i, out: out * float("nan"))
    steps = []
    mark_optimizer_host_state(optimizer)  # AdamW's step counters live on the host (runtime/profile.py does the same)
    for step in range(config.training.steps):
        with count_syncs() as syncs:
            steps.append(T.train_step(model, optimizer, scheduler, loader, config, device, objective,
                                      stage_group=stage))
        steps[-1]["syncs"] = {site: n for site, n in syncs.by_site.items() if " copy" not in site}
        if poison is not None:
            poison.remove()
            poison = None
    hook.remove()
    eval_loader = T.build_loader(config, meshes, layout, "eval")
    eval_loss = evaluate(model, eval_loader, config.eval.steps, config.data.tokens_per_step(),
                         T.eval_batch_loss(model, pipeline, device))
    run = {"steps": steps, "eval_loss": eval_loss, "counts": first.get("counts", {}),
           "bias": {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")},
           "moe_layers": len(model.routers())}
    if reference is None:
        return {**run, "grads": {n: full(g) for n, g in first["grads"]},
                "params": {n: full(p) for n, p in model.named_parameters()}}
    if nan_on_rank is not None:  # a skipped step has nothing to compare
        return run
    return {**run, "errors": errors(reference, run, first.get("grads", []), list(model.named_parameters()))}


def errors(reference: dict, run: dict, grads: list, params: list) -> dict:
    """Worst relative errors of one rank's run against the single process: per step loss, norm and max logit,
    clipped heads equal, first-step gradients (after clipping), final parameters, eval_loss; expert biases
    exactly equal; the parameters left without a gradient. (Router counts are this rank's tokens only: the
    test sums them over each stage's ranks, `stage_counts`.)"""
    rel = lambda key: max(abs(g[key] - r[key]) / abs(r[key]) for g, r in zip(run["steps"], reference["steps"]))  # noqa: E731
    return {"loss": rel("loss"), "norm": rel("grad_norm"), "max_logit": rel("max_logit"),
            "clipped": [g["clipped_heads"] for g in run["steps"]] == [r["clipped_heads"] for r in reference["steps"]],
            "grad": _worst(reference["grads"], grads), "param": _worst(reference["params"], params),
            "bias": all(torch.equal(b, reference["bias"][n]) for n, b in run["bias"].items()),
            "eval": abs(run["eval_loss"] - reference["eval_loss"]) / abs(reference["eval_loss"]),
            "no_grad": sorted({n for n, _ in params} - {n for n, _ in grads})}


def stage_counts(per_rank: list[dict], name: str, stage_size: int) -> list[dict]:
    """Each stage's first-step router counts: its ranks' (each counted its own tokens) summed."""
    stages = [per_rank[r:r + stage_size] for r in range(0, len(per_rank), stage_size)]
    return [{n: sum(by_case[name]["counts"][n] for by_case in ranks) for n in ranks[0][name]["counts"]}
            for ranks in stages]
