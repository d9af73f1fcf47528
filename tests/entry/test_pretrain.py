"""The real entry point (`launch/pretrain.py main`) on forked torchrun-style ranks: layout parity,
exact resume, resume into another layout, atomic saves, config errors, --help."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from launch import posttrain
from launch.pretrain import check_environment, main
from entry_point import run_ok, run_pretrain
from runtime.checkpoint.checkpoint import MARKER
from runtime.config_parser import load_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Small and fast: 4 steps of 8 sequences x 32 tokens on the debug model, Muon, the bundled corpus.
BASE = ["--training.steps=4", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=2", "--checkpoint.keep=0"]
HEADLINE = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"]


def _run(run_dir, world_size, *extra):
    return run_ok(run_dir, world_size, BASE + list(extra))


def test_headline_layout_matches_single_process_losses(tmp_path):
    single = _run(tmp_path / "single", 1)
    headline = _run(tmp_path / "headline", 8, *HEADLINE)
    assert [r["step"] for r in single] == [r["step"] for r in headline] == [0, 1, 2, 3]
    for a, b in zip(single, headline):
        # fp32; the layouts differ only in reduction order (FSDP sums, CP attention, EP all-to-all), about
        # 1e-6 relative per step; Newton-Schulz and 3 optimizer steps amplify it to ~1e-5 at most.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (a, b)
    assert single[-1]["loss"] < single[0]["loss"]


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_resume_is_exact_and_ignores_incomplete_checkpoints(tmp_path, optimizer):
    run_dir = tmp_path / "run"
    full = _run(run_dir, 2, f"--optim.name={optimizer}")
    checkpoints = run_dir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step_2", "step_4"]
    # Make step_4 look like a save that crashed before completing: no marker. Resume must use step_2.
    os.remove(checkpoints / "step_4" / MARKER)
    resumed = _run(run_dir, 2, f"--optim.name={optimizer}")  # redoes steps 2 and 3 from step_2
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    exact = ("loss", "grad_norm", "lr")  # bitwise: same weights, optimizer state, data and reduction order
    assert [[r[k] for k in exact] for r in resumed] == [[r[k] for k in exact] for r in full]


def test_checkpoint_saved_on_8_ranks_resumes_on_4_with_another_layout(tmp_path):
    run_dir = tmp_path / "run"
    full = _run(run_dir, 8, *HEADLINE)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    resumed = _run(run_dir, 4, "--parallel.dp_shard=4", "--parallel.cp=1", "--parallel.ep=4",
                   "--parallel.edp_shard=1")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(full[2:], resumed[2:]):
        # Same weights, optimizer state and data; only the reduction order differs (see above).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)


@pytest.mark.parametrize("argv, key", [
    (["--training.steps=abc"], "training.steps"),
    (["--training.stepz=3"], "training.stepz"),
    (["--model.preset=nope"], "model.preset"),
    (["--parallel.ep=3"], "parallel.ep"),
    (["--data.batch_size=3"], "batch"),
    (["--parallel.dp_shard=3"], "dp_shard"),
    (["--data.source=bin", "--data.path=/nonexistent.bin"], "data.path"),
    (["--data.source=bin", "--data.path={tmp}/ids.bin", "--data.dtype=uint16"], "model.vocab_size"),  # ids 300
    pytest.param(["--training.device=cuda"], "training.device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists here")),
])
def test_config_errors_exit_on_every_rank_with_rank0s_line(tmp_path, capfd, argv, key):
    np.full(4096, 300, dtype=np.uint16).tofile(tmp_path / "ids.bin")  # token ids beyond the debug vocab (256)
    argv = [a.format(tmp=tmp_path) for a in argv]
    codes, _ = run_pretrain(tmp_path, 2, argv, timeout=60)
    assert codes == [2, 2]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and key in lines[0], lines  # rank 0's alone: under torchrun it is always there


@pytest.mark.parametrize("argv, message", [
    (["--eval.path={tmp}/missing.bin"], "eval.path: no such file '{tmp}/missing.bin'"),
    (["--eval.path={tmp}/ids.bin", "--data.dtype=uint16"], "eval.path: {tmp}/ids.bin holds token id 300"),
    (["--eval.holdout=0.0001"], "data.seq_len=128 needs windows of 129 tokens but the eval part (eval.holdout=0.0001)"),
    (["--run.dir={tmp}/ids.bin"], "run.dir={tmp}/ids.bin: {tmp}/ids.bin exists and is not a directory"),
    (["--run.dir={tmp}/ids.bin/run"], "run.dir={tmp}/ids.bin/run: {tmp}/ids.bin exists and is not a directory"),
    (["--posttrain.init_from=x", "--posttrain.teacher=ema"], "posttrain.teacher, posttrain.init_from: read by "
                                                            "launch/posttrain.py only"),
])
def test_environment_errors_name_the_key_before_any_process_group(tmp_path, argv, message):
    """What the loaders, the run-dir lock or nothing at all would otherwise meet after init."""
    np.full(4096, 300, dtype=np.uint16).tofile(tmp_path / "ids.bin")  # token ids beyond the debug vocab (256)
    config = load_config([a.format(tmp=tmp_path) for a in argv])
    with pytest.raises(ValueError) as error:
        check_environment(config)
    assert str(error.value).startswith(message.format(tmp=tmp_path)) and "\n" not in str(error.value)


def test_posttrain_checks_its_run_dir_and_eval_file(tmp_path):
    (tmp_path / "file").write_text("")
    rollouts = ["--config", os.path.join(REPO, "configs", "posttrain_example.toml"),
                f"--data.path={os.path.join(REPO, 'examples', 'rollouts.jsonl')}"]
    posttrain.check_environment(load_config(rollouts + [f"--run.dir={tmp_path}/run"]))
    with pytest.raises(ValueError, match="^run.dir=.*exists and is not a directory"):
        posttrain.check_environment(load_config(rollouts + [f"--run.dir={tmp_path}/file"]))
    with pytest.raises(ValueError, match=f"^eval.path: no such file '{tmp_path}/missing.bin'"):
        posttrain.check_environment(load_config(rollouts + [f"--eval.path={tmp_path}/missing.bin"]))


def test_help_lists_every_key_with_default(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for key in ("--run.dir=", "--model.preset=debug", "--parallel.dp_shard=-1", "--parallel.edp_shard=-1",
                "--optim.name=muon", "--optim.lr=", "--data.batch_size=", "--training.steps=",
                "--training.grad_clip=", "--checkpoint.interval=", "--checkpoint.keep="):
        assert key in text, key


def test_torchrun_smoke(tmp_path):
    """The README's main command, for real: torchrun, 2 spawned processes, 2 steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/pretrain.py",
           "--training.steps=2", "--data.seq_len=32", "--data.batch_size=4", f"--run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1]
