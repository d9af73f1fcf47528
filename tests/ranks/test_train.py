"""Training-loop behaviour beyond layout parity: non-finite steps are skipped, gradient accumulation
equals one big batch, the profiler writes a trace (of the run's steps, across a resume)."""

import json
import os

import pytest
import torch

from launch.pretrain import main
from multirank import run_ranks
from parallel.meshes import build_meshes
from runtime import train as T
from runtime.config_parser import load_config

ARGS = ["--training.steps=3", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=0"]


def _skip_non_finite(rank, world_size, run_dir):
    config = load_config(ARGS + [f"--run.dir={run_dir}"])
    layout = config.layout(world_size)
    meshes = build_meshes(layout, "cpu")
    model = T.build_model(config, meshes, layout, torch.device("cpu"))
    optimizer = T.build_optimizer(model, config)
    scheduler = T.build_scheduler(optimizer, config.training)
    loader = T.build_loader(config, meshes, layout)
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    bias_before = [r.expert_bias.clone() for r in model.routers()]
    # A real forward hook turns rank 0's logits into NaN: the global loss is NaN on every rank.
    hook = model.output.register_forward_hook(lambda m, i, out: out * float("nan") if rank == 0 else out)
    stats = T.train_step(model, optimizer, scheduler, loader, config, torch.device("cpu"))
    hook.remove()
    unchanged = all(torch.equal(before[n], p.detach().full_tensor()) for n, p in model.named_parameters())
    bias_unchanged = all(torch.equal(a, r.expert_bias) for a, r in zip(bias_before, model.routers()))
    counts_reset = all(not r.tokens_per_expert.any() for r in model.routers())
    state_zero = all(not s["momentum_buffer"].to_local().any() for s in optimizer.state.values()
                     if "momentum_buffer" in s)
    stats_next = T.train_step(model, optimizer, scheduler, loader, config, torch.device("cpu"))
    changed = any(not torch.equal(before[n], p.detach().full_tensor()) for n, p in model.named_parameters())
    return stats["skipped"], unchanged, bias_unchanged, counts_reset, state_zero, stats_next["skipped"], changed


def test_non_finite_loss_skips_the_step_on_every_rank(tmp_path):
    for skipped, unchanged, bias_unchanged, counts_reset, state_zero, next_skipped, changed in \
            run_ranks(_skip_non_finite, 2, str(tmp_path)):
        assert skipped and unchanged and bias_unchanged and counts_reset and state_zero
        assert not next_skipped and changed  # the next, finite step trains normally


def _main(rank, world_size, argv):
    return main(argv)


def _losses(run_dir, *extra):
    assert run_ranks(_main, 1, ARGS + [f"--run.dir={run_dir}", *extra], as_torchrun=True) == [0]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    whole = _losses(tmp_path / "whole")
    accumulated = _losses(tmp_path / "accum", "--training.grad_accum=4")
    # Same global batch; only the summation order of the per-token losses and gradients differs (fp32).
    assert accumulated == pytest.approx(whole, rel=1e-5)


def test_profiler_writes_a_trace(tmp_path):
    _losses(tmp_path, "--profile.enabled=true", "--profile.steps=1,2")
    with open(tmp_path / "profile" / "rank0.json") as f:
        assert json.load(f)["traceEvents"]


def test_profile_steps_are_the_runs_steps_across_a_resume(tmp_path, capfd):
    """A run resumed at step 3 traces profile.steps 4,5 of the run (not its own 5th and 6th step, past
    its end); resumed again at 6, steps 1,2 lie behind it: it says so and leaves the trace alone."""
    resumable = [a for a in ARGS if not a.startswith("--checkpoint")] + ["--checkpoint.interval=3"]
    _losses(tmp_path, *resumable)
    _losses(tmp_path, *resumable, "--training.steps=6", "--profile.enabled=true", "--profile.steps=4,5")
    with open(tmp_path / "profile" / "syncs_rank0.json") as f:
        assert set(json.load(f)) == {"4", "5"}
    trace = (tmp_path / "profile" / "rank0.json").read_bytes()
    assert json.loads(trace)["traceEvents"]
    capfd.readouterr()
    _losses(tmp_path, *resumable, "--training.steps=8", "--profile.enabled=true", "--profile.steps=1,2")
    assert "profile.steps=1,2 are before step 6, where this run resumed: nothing traced" in capfd.readouterr().out
    assert (tmp_path / "profile" / "rank0.json").read_bytes() == trace


def test_adamw_only_runs_every_parameter_through_adamw(tmp_path):
    losses = _losses(tmp_path, "--optim.name=adamw", "--optim.lr=0.003")
    assert losses[-1] < losses[0]
