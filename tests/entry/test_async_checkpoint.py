"""Async checkpoints through the real entry point: a resume from an async checkpoint continues bitwise
like the uninterrupted run (1 process and 8 ranks), the async checkpoint holds exactly the sync one's
tensors, a rank killed (SIGKILL) while its async write is in flight leaves the previous checkpoint the
newest loadable one, and retention (keep + keep_every)."""

import json
import os
import signal

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launch.pretrain import main
from multirank import run_ranks
from runtime.checkpoint.checkpoint import MARKER, CheckpointConfig, latest_checkpoint, prune

BASE = ["--training.steps=3", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=2", "--checkpoint.keep=0", "--eval.interval=0"]
EXACT = ("loss", "grad_norm", "lr")


def _main(rank, world_size, argv, kill_in_write_of=None):
    if kill_in_write_of is not None and rank == 1:
        _kill_after_writing(kill_in_write_of)
    return main(argv)


def _kill_after_writing(step_dir: str) -> None:
    """This rank SIGKILLs itself right after writing its shards of `step_dir` (before DCP's result gather),
    i.e. with the async write in flight: no metadata, no marker."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        future = original(self, plan, planner)
        if os.path.basename(str(self.path)) == step_dir + ".tmp":
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    filesystem.FileSystemWriter.write_data = write_data


def run(run_dir, world_size, *extra, **kwargs):
    argv = BASE + [f"--run.dir={run_dir}", *extra]
    codes = run_ranks(_main, world_size, argv, timeout=300, as_torchrun=True, **kwargs)
    return codes, records(run_dir)


def records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def exact(rows):
    return [[r[k] for k in EXACT] for r in rows]


def tensors(checkpoint_dir, out):
    dcp_to_torch_save(checkpoint_dir, out)
    return torch.load(out, weights_only=False)


def seeded(state):
    """The entries two runs of one seed share: weights, optimizer, schedule, data position, torch's RNG
    (Python's and NumPy's global RNGs are seeded by no run: each process starts from the OS's entropy;
    a resume restores them, runtime/checkpoint/checkpoint.py RNGState)."""
    return {"train": state["train"], "scheduler": state["scheduler"], "data": state["data"],
            "rng.torch": state["rng"]["torch"]}


def assert_equal_states(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal_states(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("world_size", [1, 8])
def test_resume_from_an_async_checkpoint_is_bitwise_and_equals_the_sync_one(tmp_path, world_size):
    """Async run (step_2 and step_3 written in the background); then step_3 is moved away and the run
    resumes from the async step_2 in sync mode: same losses, bitwise, and a sync step_3 holding exactly
    the async one's tensors (the background write stored the state at the save, not a later one)."""
    run_dir = tmp_path / "run"
    codes, full = run(run_dir, world_size, "--checkpoint.mode=async")
    assert codes == [0] * world_size and [r["step"] for r in full] == [0, 1, 2]
    os.rename(run_dir / "checkpoints" / "step_3", tmp_path / "async_step_3")
    os.remove(run_dir / "metrics.jsonl")
    codes, resumed = run(run_dir, world_size, "--checkpoint.mode=sync")
    assert codes == [0] * world_size
    assert [r["step"] for r in resumed] == [2] and exact(resumed) == exact(full[2:])
    assert_equal_states(seeded(tensors(str(tmp_path / "async_step_3"), tmp_path / "a.pt")),
                        seeded(tensors(str(run_dir / "checkpoints" / "step_3"), tmp_path / "s.pt")))


def test_kill_9_during_an_async_write_leaves_the_previous_checkpoint_newest(tmp_path, capfd):
    run_dir = tmp_path / "run"
    # rank 0 exits 4 (a peer died); if its own write is still waiting for rank 1 then, it leaves with
    # os._exit (runtime/checkpoint/checkpointer.py close) and reports nothing either
    with pytest.raises(AssertionError, match=r"rank 1 failed first \(also failed: \[0?\]\):\nrank 1 exited without"):
        run(run_dir, 2, "--training.steps=5", "--comm.train_timeout_s=30", kill_in_write_of="step_4")
    killed = records(run_dir)  # steps 0-3 logged; the kill came in step_4's write, during step 4
    err = capfd.readouterr().err
    assert "rank 0: a peer rank died" in err or "rank 0: collective timed out" in err, err[-2000:]
    checkpoints = run_dir / "checkpoints"
    assert latest_checkpoint(str(checkpoints)) == str(checkpoints / "step_2")
    assert not (checkpoints / "step_4").exists() and not (checkpoints / "step_4.tmp" / MARKER).exists()
    os.remove(run_dir / "metrics.jsonl")
    codes, resumed = run(run_dir, 2, "--training.steps=5")
    assert codes == [0, 0]
    assert [r["step"] for r in resumed] == [2, 3, 4] and exact(resumed[:2]) == exact(killed[2:4])
    assert sorted(os.listdir(checkpoints)) == ["step_2", "step_4", "step_5"]  # the .tmp leftover is gone


def test_retention_keeps_the_newest_and_every_keep_every(tmp_path):
    config = CheckpointConfig(interval=10, keep=2, keep_every=30)
    assert config.kept([10, 20, 30, 40, 50, 60, 70]) == {30, 60, 70}
    assert CheckpointConfig(interval=10, keep=0).kept([10, 20]) == {10, 20}
    for step in (10, 20, 30, 40, 50):
        os.makedirs(tmp_path / f"step_{step}")
        open(tmp_path / f"step_{step}" / MARKER, "w").close()
    os.makedirs(tmp_path / "step_60")  # not complete: never counted, never pruned
    prune(str(tmp_path), config)
    assert sorted(os.listdir(tmp_path)) == ["step_30", "step_40", "step_50", "step_60"]


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint.mode=later"], "checkpoint.mode: expected one of 'sync', 'async', got 'later'"),
    (["--checkpoint.keep_every=-5"], "checkpoint.keep_every=-5 must be >= 0"),
    (["--checkpoint.keep_every=30", "--checkpoint.keep=0"],
     "checkpoint.keep_every=30 has no effect with checkpoint.keep=0 (every checkpoint is kept)"),
    (["--checkpoint.keep_every=150", "--checkpoint.interval=100"],
     "checkpoint.keep_every=150 must be a multiple of checkpoint.interval=100, or those steps are never saved"),
])
def test_bad_checkpoint_keys_fail_in_one_line(tmp_path, capsys, argv, message):
    assert main([*argv, f"--run.dir={tmp_path}/run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"config error: {message}"]
    assert not os.path.exists(tmp_path / "run")
