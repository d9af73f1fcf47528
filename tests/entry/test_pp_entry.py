"""Pipeline parallelism at the entry points that do not run a pipeline (issue 53, item 6): post-training
(launch/posttrain.py, `data.source = "rollouts"`) refuses `parallel.pp > 1` in one line naming the key and its
value, exit 2, before torch loads when run as a script (`python -X importtime` lists what it imported) and, from
its `main`, before any process group or run dir exists. launch/evaluate.py and launch/generate.py take no layout:
they run a pipelined run's checkpoint in one process (tests/ranks/test_pp_resume.py evaluates one)."""

import os
import subprocess
import sys

import torch.distributed as dist

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REFUSAL = ("config error: parallel.pp=2 with post-training (data.source='rollouts'): not composed yet; post-train "
           "with parallel.pp=1 (a pipelined run's checkpoints load under any layout)")


def _argv(tmp_path) -> list[str]:
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text('{"tokens": [1, 2, 3], "mask": [0, 1, 1]}\n')
    return [f"--data.path={rollouts}", "--parallel.pp=2", "--training.grad_accum=2", f"--run.dir={tmp_path / 'run'}"]


def test_posttrain_script_refuses_pp_before_torch_loads(tmp_path):
    done = subprocess.run([sys.executable, "-X", "importtime", "launch/posttrain.py", *_argv(tmp_path)], cwd=REPO,
                          env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"}, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert done.returncode == 2 and lines == [REFUSAL], (done.returncode, lines)
    assert "torch" not in imported
    assert not (tmp_path / "run").exists()


def test_posttrain_main_refuses_pp_before_any_process_group(tmp_path, capsys, monkeypatch):
    from launch.posttrain import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(_argv(tmp_path)) == 2
    assert capsys.readouterr().err.splitlines() == [REFUSAL]
    assert not dist.is_initialized() and not (tmp_path / "run").exists()
