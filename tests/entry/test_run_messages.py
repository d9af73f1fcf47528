"""What a run tells a new user: where outputs go (first line), no empty Muon plan under AdamW,
`checkpoint.interval = 0` saves the last step only (documented in --help), a finished run relaunched says
there is nothing to do, and posttrain's --help names posttrain.py."""

import json
import os

from entry_point import run_ok
from launch import posttrain
from launch.pretrain import main

ARGS = ["--training.steps=2", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=4",
        "--eval.interval=0", "--checkpoint.interval=0", "--optim.name=adamw"]


def test_a_run_says_where_outputs_go_and_a_finished_one_that_nothing_is_left(tmp_path, capfd):
    run_dir = tmp_path / "run"
    first = run_ok(run_dir, 1, ARGS)
    out = capfd.readouterr().out.splitlines()
    assert out[0] == f"outputs: {run_dir} (run.dir: metrics.jsonl, checkpoints/)"
    assert not any(line.startswith("Sharded Muon plan") for line in out)
    assert any(line.startswith("optimizer: adamw, AdamW for all ") for line in out)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_2"]  # interval 0: no periodic save, the last one
    again = run_ok(run_dir, 1, ARGS)
    out = capfd.readouterr().out
    assert f"nothing to do: step 2 of 2 done ({run_dir})" in out and "step 0/2" not in out
    assert again == first and sorted(os.listdir(run_dir / "checkpoints")) == ["step_2"]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1]


def test_help_documents_interval_0_and_posttrain_names_itself(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "launch/pretrain.py" in text.splitlines()[0]
    (line,) = [line for line in text.splitlines() if "--checkpoint.interval=" in line]
    assert "the last step and a SIGTERM always save (0 = only those)" in line
    assert posttrain.main(["--help"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("usage: torchrun --nproc_per_node N launch/posttrain.py")
