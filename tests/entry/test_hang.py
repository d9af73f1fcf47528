"""Hangs that explain themselves (runtime/comm.py), through the real entry point on forked ranks: one
rank skips the step's loss all-reduce and stalls; the other exits within comm.train_timeout_s plus a
few seconds with one line naming the collective, its mesh axes and the step, a flight-recorder trace
on disk and a non-zero status; the heartbeat shows the last step each rank finished."""

import json
import os
import pickle
import time

import pytest

from launch.pretrain import main
from multirank import run_ranks

TIMEOUT_S = 4
ARGV = ["--training.steps=4", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=0", "--eval.interval=0", f"--comm.train_timeout_s={TIMEOUT_S}"]


def _main(rank, world_size, argv, run_dir):
    if rank == 1:
        _skip_the_loss_all_reduce_of_step(1, run_dir)
    code = main(argv)
    return code, time.time()


def _skip_the_loss_all_reduce_of_step(step, run_dir):
    """Rank 1 leaves out the loss all-reduce of `step` and stalls (as a rank stuck outside any
    collective), then goes on: its next collective finds its peer gone."""
    from runtime import train

    calls = []

    def global_loss(local_loss, group=None):
        calls.append(None)
        if len(calls) == step + 1:
            with open(os.path.join(run_dir, "skipped_at"), "w") as f:
                f.write(str(time.time()))
            time.sleep(TIMEOUT_S + 3)
            return local_loss.detach().clone()
        return original(local_loss, group)

    original, train.global_loss = train.global_loss, global_loss


def test_a_rank_that_skips_a_collective_is_named_and_every_rank_exits(tmp_path, capfd):
    run_dir = tmp_path / "run"
    results = run_ranks(_main, 2, [*ARGV, f"--run.dir={run_dir}"], str(run_dir), timeout=120, as_torchrun=True)
    (code0, end0), (code1, _) = results
    assert code0 == 4 and code1 == 4  # non-zero: torchrun restarts the job
    skipped_at = float(open(run_dir / "skipped_at").read())
    assert TIMEOUT_S - 0.5 < end0 - skipped_at < TIMEOUT_S + 5, end0 - skipped_at
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("rank ")]
    line0 = next(line for line in lines if line.startswith("rank 0: "))
    assert line0.startswith(f"rank 0: collective timed out after {TIMEOUT_S} s in step 1 (training step); last "
                            f"collective issued: gloo:all_reduce on dense.dp_shard = expert.ep"), line0
    assert f"flight-recorder trace: {run_dir}/comm_traces/rank_0" in line0
    line1 = next(line for line in lines if line.startswith("rank 1: "))
    assert line1.startswith("rank 1: a peer rank died in step 1 (training step)"), line1
    trace = pickle.load(open(run_dir / "comm_traces" / "rank_0", "rb"))  # torch's flight-recorder format
    assert trace["entries"][-1]["profiling_name"] == "gloo:all_reduce"
    assert trace["entries"][-1]["input_sizes"] == [[2]]  # the loss and the SIGTERM count
    assert json.load(open(run_dir / "heartbeat" / "rank_0"))["step"] == 0  # the last step rank 0 finished


@pytest.mark.parametrize("key, value, message", [
    ("comm.train_timeout_s", "0", "comm.train_timeout_s=0.0 must be > 0 seconds"),
    ("comm.init_timeout_s", "-1", "comm.init_timeout_s=-1.0 must be > 0 seconds"),
    ("comm.checkpoint_timeout_s", "nan", "comm.checkpoint_timeout_s: expected a finite float, got 'nan'"),
    ("comm.trace_entries", "-2", "comm.trace_entries=-2 must be >= 0"),
    ("comm.heartbeat", "maybe", "comm.heartbeat: expected bool, got 'maybe'"),
])
def test_bad_comm_keys_fail_in_one_line(tmp_path, capsys, key, value, message):
    assert main([f"--{key}={value}", f"--run.dir={tmp_path}/run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"config error: {message}"]
    assert not os.path.exists(tmp_path / "run")


def _timeouts(rank, world_size, run_dir):
    import torch
    from torch.distributed import distributed_c10d as c10d

    from parallel.meshes import build_meshes
    from runtime.comm import CommWatch, checkpoint_group
    from runtime.comm_config import CommConfig
    from runtime.config_parser import load_config

    meshes = build_meshes(load_config([]).layout(world_size), "cpu")
    config = CommConfig(init_timeout_s=700, train_timeout_s=7, checkpoint_timeout_s=77)
    group = checkpoint_group(config)
    watch = CommWatch(config, run_dir, rank, meshes, exempt=[group])

    def timeouts():
        return {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g, name in c10d._world.pg_names.items()}

    watch.begin()
    before = timeouts()
    watch.step_done(0, 0.1)
    return before, timeouts(), group.group_name, json.load(open(os.path.join(run_dir, "heartbeat", f"rank_{rank}")))


def test_after_the_first_step_training_groups_get_the_short_timeout_and_checkpoints_keep_theirs(tmp_path):
    for before, after, checkpoint, beat in run_ranks(_timeouts, 2, str(tmp_path), timeout=120):
        assert before[checkpoint] == after[checkpoint] == 77  # a gloo group of its own (issue 36 item 5)
        assert all(t == 700 for name, t in before.items() if name != checkpoint), before
        assert len(after) >= 4 and all(t == 7 for name, t in after.items() if name != checkpoint), after
        assert beat["step"] == 0 and beat["step_time_s"] == 0.1
