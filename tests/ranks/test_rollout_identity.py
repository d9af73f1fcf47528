"""Post-training reads the rollout file it validated (runtime/posttrain/rollout_file.py): a file rewritten while the
run reads it stops every rank with the same one line naming the file (before: a ValueError or an
IndexError traceback on one rank and "a peer rank died" on the other, or bytes that happened to parse
trained without validation); a file renamed over it changes nothing (the descriptor keeps the validated
one). The checkpoint records the file's identity and a resume names what changed. A launch refused for
its rollouts leaves no run dir behind (before: `.lock` and `kind`, which then refused a pretraining run)."""

import io
import json
import os
import shutil
import sys

import pytest
import torch.distributed as dist

from multirank import run_ranks
from runtime.errors import RunError
from runtime.posttrain.rollout_batch import RolloutLoader

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rollouts.jsonl")
VOCAB, MAX_LEN = 256, 256
BASE = ["--config", "configs/posttrain_example.toml", "--training.warmup_steps=1", "--data.batch_tokens=600",
        "--checkpoint.mode=sync"]


class Data:
    def __init__(self, path):
        self.path, self.batch_tokens = path, 600


def _copy(tmp_path) -> str:
    path = str(tmp_path / "r.jsonl")
    shutil.copy(EXAMPLE, path)
    return path


def _lines(path) -> list[bytes]:
    with open(path, "rb") as f:
        return f.readlines()


def _rewrite(path: str, how: str) -> None:
    """Rewrite the file in place (same inode): `appended` lines, `truncated` to 8 lines, or `same size`:
    every advantage's sign flipped in the digits' place (1.0 -> 2.0), size and mtime kept."""
    lines = _lines(path)
    stat = os.stat(path)
    if how == "appended":
        lines += lines[:4]
    elif how == "truncated":
        lines = lines[:8]
    else:
        lines = [line.replace(b'"advantage": 1.0', b'"advantage": 2.0').replace(b'"advantage": -1.0',
                                                                                 b'"advantage": -2.0')
                 for line in lines]
    with open(path, "r+b") as f:  # in place: the run's descriptor sees it
        f.truncate(0)
        f.write(b"".join(lines))
    if how == "same size":
        assert os.path.getsize(path) == stat.st_size
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _steps_around_a_rewrite(rank, world, path, how):
    """dp=2: step 0, then rank 0 rewrites the file (both ranks wait for it), then steps 1-3."""
    loader = RolloutLoader(Data(path), 0, vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_rank=rank, dp_degree=world,
                           group=dist.group.WORLD)
    loader.batch(0)
    dist.barrier()
    if rank == 0:
        _rewrite(path, how)
    dist.barrier()
    try:
        for step in range(1, 4):
            loader.batch(step)
    except RunError as e:
        return str(e)
    return None


@pytest.mark.parametrize("how", ["appended", "truncated", "same size"])
def test_a_file_rewritten_in_place_stops_every_rank_with_one_line(tmp_path, how):
    """`same size` keeps the mtime too: only the CRC of a line read tells, and each step reads the lines
    of one rank's slots, so the other rank learns it from the agreement."""
    path = _copy(tmp_path)
    errors = run_ranks(_steps_around_a_rewrite, 2, path, how, timeout=120)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith(f"data.path: {path} changed while post-training reads it (")
    assert "\n" not in errors[0]


def test_a_file_renamed_over_keeps_the_validated_trajectories(tmp_path):
    """The usual way to replace a file (write another, rename it over) leaves the run on the file it
    validated: its steps equal those of an untouched copy."""
    path, intact = _copy(tmp_path), str(tmp_path / "intact.jsonl")
    shutil.copy(path, intact)
    loader = RolloutLoader(Data(path), 0, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    reference = RolloutLoader(Data(intact), 0, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"".join(_lines(path)[:5]))
    os.replace(other, path)
    for step in range(4):
        a, b = loader.batch(step), reference.batch(step)
        assert a[1:] == b[1:]
        assert all((x.inputs_BS == y.inputs_BS).all() for x, y in zip(a.micro_batches, b.micro_batches))


def _posttrain_with_a_rewrite(rank, world, argv, path):
    """launch/posttrain.py on this rank; rank 0 rewrites the rollouts before step 2. (exit status, stderr)."""
    from launch.posttrain import main

    loader_step = RolloutLoader.next_step

    def next_step(self):
        if rank == 0 and self.step == 2:
            _rewrite(path, "appended")
        return loader_step(self)

    RolloutLoader.next_step = next_step
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        status = main(argv)
        return status, sys.stderr.getvalue()
    finally:
        sys.stderr = err


def test_posttrain_stops_in_one_line_when_its_rollouts_change(tmp_path):
    path, run = _copy(tmp_path), tmp_path / "run"
    argv = [*BASE, f"--data.path={path}", f"--run.dir={run}", "--training.steps=4"]
    results = run_ranks(_posttrain_with_a_rewrite, 2, argv, path, as_torchrun=True, timeout=300)
    assert [status for status, _ in results] == [2, 2], results
    err = results[0][1].strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"data.path: {path} changed while post-training reads it"), err
    assert results[1][1].strip() == ""  # one line in all, from rank 0
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize("how, change", [
    ("append 4 lines", "32 -> 36 trajectories, 3,119 -> 3,559 tokens, 40 -> 46 feedback items, 36,856 -> 42,100 bytes"),
    ("negate an advantage", "36,856 -> 36,855 bytes"),  # -1.0 -> 1.0: the same counts, one byte less
    ("double an advantage", "same counts, other content"),  # -1.0 -> -2.0: the same size
    ("cut to 8 lines", "32 -> 8 trajectories"),
])
def test_a_resume_names_what_changed_in_the_rollouts(tmp_path, capsys, how, change):
    from launch.posttrain import main

    path, run = _copy(tmp_path), tmp_path / "run"
    argv = [*BASE, f"--data.path={path}", f"--run.dir={run}"]
    assert main([*argv, "--training.steps=1"]) == 0
    assert main([*argv, "--training.steps=2"]) == 0
    assert "rollouts changed" not in capsys.readouterr().out  # the same file: nothing to say
    lines = _lines(path)
    if how == "append 4 lines":
        lines += lines[:4]
    elif how == "cut to 8 lines":
        lines = lines[:8]
    else:
        record = json.loads(lines[0])
        assert record["advantage"] == -1.0
        record["advantage"] = 1.0 if how == "negate an advantage" else -2.0
        lines[0] = (json.dumps(record) + "\n").encode()
    with open(path, "wb") as f:
        f.write(b"".join(lines))
    assert main([*argv, "--training.steps=3"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollouts changed")]
    assert len(said) == 1 and change in said[0], said


def test_a_launch_refused_for_its_rollouts_leaves_no_run_dir(tmp_path):
    """A bad line (found by the ranks' shared validation, after the process group exists): status 2 on
    both ranks and no run dir; a pretraining run then starts there."""
    from entry_point import run_pretrain
    from launch.posttrain import main

    path, run = _copy(tmp_path), tmp_path / "run"
    lines = _lines(path)
    lines[20] = b'{"tokens": [1, 2], "turns": []}\n'
    with open(path, "wb") as f:
        f.write(b"".join(lines))
    codes, _ = run_pretrain(run, 2, [*BASE, f"--data.path={path}", "--training.steps=1"], entry=main)
    assert codes == [2, 2] and not run.exists()
    codes, records = run_pretrain(run, 1, ["--training.steps=1", "--data.seq_len=32", "--data.batch_size=4",
                                           "--eval.interval=0"])
    assert codes == [0] and len(records) == 1
