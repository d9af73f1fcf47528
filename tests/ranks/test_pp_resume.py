"""A pipeline-parallel checkpoint resumes under another pp, continuing the run (issue 53, item 6): the entry point
(launch/pretrain.py) on 8 ranks in two simulated nodes trains 2 steps at pp 2 and saves; the run then resumes
at pp 1 and, from a copy of the same checkpoint, at pp 4, each for steps 3 and 4; both equal an uninterrupted
pp 2 run of 4 steps (loss, gradient norm and eval_loss within 1e-5 relative: fp32, other summation orders).
Stages keep the whole model's names (parallel/pp/part.py), so DCP reshards the weights, the optimizer state,
the router buffers (each written by a rank of the stage that holds it) and the data position as for any other
layout change. The one-process tools compose with it: launch/evaluate.py reads the pp 2 run's newest checkpoint
(DCP reassembles the stages' shards) and its loss is the run's logged eval_loss of that step (1e-5: the run's
evaluation went through the schedule's forward, over 8 ranks). launch/generate.py loads models the same way
(launch/model_source.py).
"""

import json
import os
import shutil

import pytest

from launch.pretrain import main
from multirank import run_ranks

WORLD = 8
JOB = ["--model.n_layers=6", "--data.source=synthetic", "--data.seq_len=32", "--data.batch_size=16",
       "--training.warmup_steps=0", "--training.min_lr_ratio=1.0",  # a constant lr: 2 steps of 2 are 2 of 4
       "--training.grad_accum=4", "--optim.qk_clip_tau=0.05", "--eval.interval=2", "--eval.steps=1",
       "--checkpoint.interval=2", "--parallel.ranks_per_node=4"]
LAYOUTS = {  # 8 ranks each
    "pp1": ["--parallel.pp=1", "--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"],
    "pp2": ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.cp=2", "--parallel.ep=4", "--parallel.edp_shard=1"],
    "pp4": ["--parallel.pp=4", "--parallel.dp_shard=2", "--parallel.cp=1", "--parallel.ep=2", "--parallel.edp_shard=1",
            "--parallel.pp_schedule=interleaved_1f1b"],
}
TOLERANCE = 1e-5


def _main(rank, world_size, argv):
    return main(argv)


def _run(run_dir, layout: str, steps: int) -> list[dict]:
    argv = JOB + LAYOUTS[layout] + [f"--run.dir={run_dir}", f"--training.steps={steps}"]
    assert run_ranks(_main, WORLD, argv, as_torchrun=True, timeout=600) == [0] * WORLD
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_resume")
    whole = _run(root / "whole", "pp2", 4)
    _run(root / "to_pp1", "pp2", 2)
    shutil.copytree(root / "to_pp1", root / "to_pp4")
    return whole, {layout: _run(root / f"to_{layout}", layout, 4) for layout in ("pp1", "pp4")}, root


@pytest.mark.parametrize("layout", ["pp1", "pp4"])
def test_pp2_checkpoint_continues_under(runs, layout):
    whole, resumed, _ = runs
    got = resumed[layout]
    assert [r["step"] for r in got] == [0, 1, 2, 3]  # the metrics file continues: steps 2 and 3 were the resumed run's
    for before, after in zip(whole, got):
        for key in ("loss", "grad_norm", "max_logit"):
            assert after[key] == pytest.approx(before[key], rel=TOLERANCE), (layout, before["step"], key)
    evals = [(w["eval_loss"], g["eval_loss"]) for w, g in zip(whole, got) if "eval_loss" in w]
    assert len(evals) == 2 and all(g == pytest.approx(w, rel=TOLERANCE) for w, g in evals), evals


def test_pp2_checkpoint_evaluates_in_one_process(runs, capsys):
    from launch import evaluate

    whole, _, root = runs
    capsys.readouterr()
    assert evaluate.main(["--model", str(root / "whole"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "(step 4)" in result["model"], result["model"]
    assert result["loss"] == pytest.approx(whole[-1]["eval_loss"], rel=TOLERANCE), (result["loss"], whole[-1])
