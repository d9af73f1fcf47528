"""Faults and bad input through the real entry point (`launch/pretrain.py main`) on forked torchrun-style
ranks: corrupt checkpoints, torn metrics, SIGTERM, divergence, a second run on one run dir, a full
disk, resuming another model, a changed schedule, broken data files.

Each test compares with an uninterrupted run where the outcome is a training run (same losses, bitwise:
same weights, data and reduction order), and checks the single line and exit status otherwise.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launch.pretrain import main
from multirank import run_ranks
from runtime.checkpoint.run_lock import LOCK_NAME

BASE = ["--training.steps=4", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=2", "--checkpoint.keep=0"]
EXACT = ("loss", "grad_norm", "lr")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _main(rank, world_size, argv, sigterm_after_step=None, run_dir=None):
    if sigterm_after_step is not None and rank == 0:  # only rank 0 gets the signal: ranks must agree
        threading.Thread(target=_sigterm_when_logged, args=(run_dir, sigterm_after_step), daemon=True).start()
    return main(argv)


def _sigterm_when_logged(run_dir, step):
    path = os.path.join(run_dir, "metrics.jsonl")
    while not (os.path.exists(path) and any(json.loads(line)["step"] >= step for line in open(path) if line.strip())):
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGTERM)


def run(run_dir, world_size=2, *extra, **kwargs):
    """(exit codes, metrics records) of the entry point on `world_size` forked ranks."""
    argv = BASE + [f"--run.dir={run_dir}", *extra]
    codes = run_ranks(_main, world_size, argv, timeout=300, as_torchrun=True, run_dir=str(run_dir), **kwargs)
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return codes, records


def exact(records):
    return [[r[k] for k in EXACT] for r in records]


def stop_lines(capfd):
    """The non-empty stderr lines that are not torch's warnings."""
    return [line for line in capfd.readouterr().err.splitlines() if line.strip() and "Warning" not in line]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A complete 4-step run on 2 ranks with checkpoints step_2 and step_4, and its metrics."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    codes, records = run(run_dir)
    assert codes == [0, 0] and [r["step"] for r in records] == [0, 1, 2, 3]
    return run_dir, records


def copy_run(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], run_dir)
    return run_dir


def _truncate_a_shard(path):
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, shard)) // 2)


def _delete_a_shard(path):
    os.remove(os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]))


def _garble_metadata(path):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"\x00garbage" * 10)


@pytest.mark.parametrize("corrupt", [_truncate_a_shard, _delete_a_shard, _garble_metadata])
def test_corrupt_newest_checkpoint_falls_back_to_the_older_one(uninterrupted, tmp_path, capfd, corrupt):
    run_dir = copy_run(uninterrupted, tmp_path)
    corrupt(str(run_dir / "checkpoints" / "step_4"))
    os.remove(run_dir / "metrics.jsonl")  # only what this relaunch redoes: steps 2 and 3 from step_2
    codes, records = run(run_dir, 2, "--training.steps=5")
    assert codes == [0, 0]
    out = capfd.readouterr().out.splitlines()
    bad = [line for line in out if line.startswith(f"checkpoint {run_dir}/checkpoints/step_4 does not load (")]
    assert len(bad) == 1 and "\n" not in bad[0], out
    assert f"resumed from {run_dir}/checkpoints/step_2" in out
    assert [r["step"] for r in records] == [2, 3, 4]
    # same weights, optimizer state and data as the uninterrupted run at step 2; the lr schedule is that of
    # 5 steps now, so compare the losses of step 2 (before any update under the new schedule)
    assert records[0]["loss"] == uninterrupted[1][2]["loss"]


def test_no_checkpoint_loads_is_an_error_not_a_fresh_start(uninterrupted, tmp_path, capfd):
    run_dir = copy_run(uninterrupted, tmp_path)
    for step in (2, 4):
        _garble_metadata(str(run_dir / "checkpoints" / f"step_{step}"))
    codes, records = run(run_dir)
    assert codes == [2, 2]
    lines = stop_lines(capfd)
    assert lines[-1].startswith(f"no checkpoint under {run_dir}/checkpoints loads (tried step_2, step_4)"), lines
    assert exact(records) == exact(uninterrupted[1])  # metrics untouched: nothing started over


def test_torn_last_metrics_line_is_dropped_on_resume(uninterrupted, tmp_path):
    run_dir = copy_run(uninterrupted, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 3.1')  # a crash in the middle of a write
    codes, records = run(run_dir)
    assert codes == [0, 0]
    assert exact(records) == exact(uninterrupted[1])
    assert not os.path.exists(run_dir / "metrics.jsonl.tmp")


def test_sigterm_saves_a_checkpoint_and_the_relaunch_continues_identically(tmp_path, capfd):
    reference = tmp_path / "reference"
    assert run(reference, 2, "--training.steps=12", "--checkpoint.interval=0")[0] == [0, 0]
    run_dir = tmp_path / "run"
    codes, first = run(run_dir, 2, "--training.steps=12", "--checkpoint.interval=0", sigterm_after_step=1)
    assert codes == [143, 143]
    stopped = first[-1]["step"] + 1
    assert stopped < 12 and os.listdir(run_dir / "checkpoints") == [f"step_{stopped}"]
    line = stop_lines(capfd)[-1]
    assert line == (f"preempted (SIGTERM) after step {stopped - 1}: checkpoint step_{stopped} saved; relaunch the "
                    f"same command to continue")
    codes, records = run(run_dir, 2, "--training.steps=12", "--checkpoint.interval=0")
    assert codes == [0, 0]
    assert exact(records) == exact(json.loads(line) for line in open(reference / "metrics.jsonl"))


def _params_finite(checkpoint_dir, tmp_path):
    out = tmp_path / f"{os.path.basename(checkpoint_dir)}.pt"
    dcp_to_torch_save(checkpoint_dir, out)
    state = torch.load(out, weights_only=False)["train"]
    # the optimizer's state per parameter name (ModelOptimState's flat format: "state.<name>.<key>" entries)
    tensors = list(state["model"].values()) + [v for v in state["optim"].values() if isinstance(v, torch.Tensor)]
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def test_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path, capfd):
    run_dir = tmp_path / "run"
    codes, records = run(run_dir, 2, "--optim.lr=1e6", "--optim.name=adamw", "--training.steps=40",
                         "--checkpoint.interval=1", "--checkpoint.keep=1", "--training.max_nonfinite_steps=3")
    assert codes == [3, 3]
    assert stop_lines(capfd)[-1].startswith("diverged: steps ")
    nonfinite = [r["loss"] is None or r["grad_norm"] is None for r in records]
    assert nonfinite[-3:] == [True] * 3 and len(records) < 40
    kept = os.listdir(run_dir / "checkpoints")
    assert len(kept) == 1 and _params_finite(str(run_dir / "checkpoints" / kept[0]), tmp_path)


def test_a_second_run_on_a_run_dir_exits_naming_the_holder_and_a_dead_holder_is_no_lock(tmp_path, capfd):
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / LOCK_NAME, "w") as lock:  # a live run holds the lock
        lock.write("pid 4242 on node7 since 2026-01-01 00:00:00")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)
        codes, records = run(run_dir)
    assert codes == [2, 2] and records == []
    assert stop_lines(capfd)[-1] == (f"run.dir {run_dir} is in use by another run (pid 4242 on node7 since "
                                     f"2026-01-01 00:00:00); wait for it to end or choose another run.dir")
    codes, records = run(run_dir)  # the holder is gone (its flock with it); its description stays in the file
    assert codes == [0, 0] and len(records) == 4



def test_a_lock_rank0_cannot_open_stops_every_rank_in_one_line(tmp_path, capfd):
    run_dir = tmp_path / "run"
    (run_dir / LOCK_NAME).mkdir(parents=True)  # rank 0 alone opens the lock: the other rank must not wait for it
    codes, records = run(run_dir)
    assert codes == [2, 2] and records == []
    assert stop_lines(capfd)[-1] == f"run.dir={run_dir}: cannot create or lock it (Is a directory)"

def test_resuming_another_model_names_the_differing_keys(uninterrupted, tmp_path, capfd):
    run_dir = copy_run(uninterrupted, tmp_path)
    codes, _ = run(run_dir, 2, "--model.n_layers=2")
    assert codes == [2, 2]
    line = stop_lines(capfd)[-1]
    assert line.startswith(f"run.dir {run_dir} holds checkpoint {run_dir}/checkpoints/step_4 of another run "
                           f"(model.n_layers: 3 -> 2)"), line
    codes, _ = run(run_dir, 2, "--model.preset=debug_gqa")
    assert codes == [2, 2]
    line = stop_lines(capfd)[-1]
    assert "model.attn: 'mla' -> 'gqa'" in line and line.count("\n") == 0, line


def test_raising_steps_on_resume_says_how_the_lr_changes(uninterrupted, tmp_path, capfd):
    run_dir = copy_run(uninterrupted, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    codes, records = run(run_dir, 2, "--training.steps=8")
    assert codes == [0, 0]
    out = capfd.readouterr().out
    old_lr = uninterrupted[1][2]["lr"]
    assert (f"the lr schedule changed since the checkpoint (training.steps: 4 -> 8): it is recomputed, so the lr "
            f"at step 2 is {records[2]['lr']:.3e} instead of {old_lr:.3e}") in out


@pytest.mark.parametrize("write, message", [
    (lambda p: open(p, "wb").close(), "is empty (0 tokens)"),
    (lambda p: (np.arange(4096, dtype=np.uint16) % 200).tofile(p) or open(f"{p}.json", "w").write("{not json"),
     ".json is not valid JSON"),
    (lambda p: np.concatenate([np.full(1 << 17, 7), [300], np.full(100, 7)]).astype(np.uint16).tofile(p),
     "holds token id 300 >= model.vocab_size=256 at token 131,072 of 131,173"),
])
def test_bad_token_files_are_named_at_start_up(tmp_path, capfd, write, message):
    path = tmp_path / "ids.bin"
    write(str(path))
    codes, _ = run(tmp_path / "run", 2, "--data.source=bin", f"--data.path={path}", "--data.dtype=uint16")
    assert codes == [2, 2]
    lines = stop_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("config error: data.path: ") and message in lines[0], lines


@pytest.fixture
def small_filesystem(tmp_path):
    """A 3.5 MiB tmpfs: room for one checkpoint of the run below (3.0 MB, 2 ranks) and the metrics, not for two."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3584k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_disk_full_during_a_checkpoint_names_it_and_keeps_the_previous(small_filesystem, tmp_path, capfd):
    run_dir = small_filesystem / "run"
    codes, records = run(run_dir, 2, "--checkpoint.interval=1")
    assert codes == [2, 2]
    line = stop_lines(capfd)[-1]
    assert line.startswith("no space left on device while writing checkpoint step_"), line
    kept = os.listdir(run_dir / "checkpoints")
    assert len(kept) >= 1 and all(name.startswith("step_") and not name.endswith(".tmp") for name in kept), kept
    newest = max(int(name.split("_")[1]) for name in kept)
    assert f"(newest: {run_dir}/checkpoints/step_{newest})" in line
    assert _params_finite(str(run_dir / "checkpoints" / f"step_{newest}"), tmp_path)


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_torchrun_restarts_a_killed_worker_and_finishes_with_the_same_losses(tmp_path):
    """`torchrun --max-restarts 1`, `kill -9` of one worker after the first checkpoint: the restarted
    workers rendezvous again (per-attempt store keys), resume from the checkpoint and end with the
    losses of an uninterrupted run."""
    argv = BASE[:1] + ["--training.steps=6"] + BASE[1:]
    _, reference = run(tmp_path / "reference", 2, "--training.steps=6")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "launch/pretrain.py", *argv, f"--run.dir={run_dir}"]
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "step_2").exists() and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.05)
    os.kill(_children(agent.pid)[-1], signal.SIGKILL)
    output = agent.communicate(timeout=300)[0]
    assert agent.returncode == 0, output[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_" in output  # the restarted workers, not the first ones
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(6))
    assert exact(records) == exact(reference)


def test_under_torchrun_a_config_error_prints_rank0s_line_exactly_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/pretrain.py",
           "--training.steps=abc", f"--run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "config error" in line]
    assert lines == ["config error: training.steps: expected int, got 'abc'"], out.stderr[-2000:]
