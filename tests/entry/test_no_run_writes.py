"""No tool writes into a run directory or a checkpoint (runtime/paths.py `check_not_in_run`): every tool
with an output flag, pointed into a run dir (its `kind` file) or into a checkpoint (its COMPLETE marker),
exits with status 2 and one line, and nothing is written. Before, `prepare_rollouts.py --out
runs/R/checkpoints/step_4/rollouts.jsonl` was accepted and the file was deleted with the checkpoint when
the run rotated it out. And the rotation (`checkpoint.keep`) removes only what the checkpointer wrote:
a file put into a checkpoint by hand stays, and a line names it."""

import dataclasses
import importlib
import json
import os

import pytest

from models import preset

ONE_STEP = ["--training.steps=1", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=4",
            "--eval.interval=0", "--checkpoint.mode=sync"]


def _fake_run(root):
    """A run dir as launch/pretrain.py leaves it: its kind file, metrics and a complete checkpoint."""
    step = root / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"step": 4, "model": dataclasses.asdict(preset("debug"))}))
    (step / ".metadata").write_text("x")
    (root / "metrics.jsonl").write_text('{"step": 3, "loss": 5.0}\n')
    (root / "kind").write_text("pretraining\n")
    return root


@pytest.fixture
def run(tmp_path):
    return _fake_run(tmp_path / "run")


def _status(call):
    try:
        return call()
    except SystemExit as e:  # the benchmarks and estimate_memory exit through argparse / fail()
        return e.code


def _refused(capsys, status, written, where):
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is inside the {where}" in err[0], err
    assert not os.path.exists(written), written


def _main(module):
    return importlib.import_module(module).main


CASES = {  # tool: (argv builder given (run dir, tmp_path, output path), where the output goes)
    "prepare_rollouts --out": ("launch.prepare_rollouts",
                               lambda t, out: ["--tokenizer", str(t), "--in", str(t / "chats.jsonl"), "--out", out]),
    "tokenize_text --out": ("launch.tokenize_text", lambda t, out: ["--tokenizer", str(t / "tok.json"),
                                                                     str(t / "text.txt"), "--out", out]),
    "plot_metrics --out": ("launch.plot_metrics", lambda t, out: [str(t / "run"), "--out", out]),
    "estimate_memory --json": ("launch.estimate_memory",
                               lambda t, out: ["--config", "configs/debug.toml", "--world", "2", "--json", out]),
    "dry_run --json": ("launch.dry_run", lambda t, out: ["--config", "configs/debug.toml", "--world", "2",
                                                         "--json", out]),
    "step_projection --json": ("benchmarks.step_projection",
                               lambda t, out: ["--config", "configs/debug.toml", "--world", "2", "--json", out]),
    "optimizer_step --json": ("benchmarks.optimizer_step", lambda t, out: ["--json", out]),
}


@pytest.mark.parametrize("inside", ["run directory", "checkpoint"])
@pytest.mark.parametrize("tool", list(CASES))
def test_an_output_in_a_run_dir_or_a_checkpoint_is_refused(tmp_path, run, capsys, tool, inside):
    (tmp_path / "text.txt").write_text("some text\n")
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "assistant", "content": "hi"}], "reward": 1}\n')
    module, argv = CASES[tool]
    name = "out.png" if "plot" in tool else "out.bin" if "tokenize" in tool else "out.json"
    out = str((run if inside == "run directory" else run / "checkpoints" / "step_4") / name)
    _refused(capsys, _status(lambda: _main(module)(argv(tmp_path, out))), out, inside)


def test_a_new_file_beside_a_run_dir_is_allowed(tmp_path, run):
    from runtime.paths import check_output_file

    check_output_file("--json", str(tmp_path / "estimate.json"), "x.json")  # the run's parent is no run dir
    check_output_file("--json", str(tmp_path / "runs.json"), "x.json", [("the run", str(run))])


def test_scratch_and_run_dirs_inside_a_run_or_a_checkpoint_are_refused(tmp_path, run, capsys):
    """Directory outputs: a benchmark's scratch folder (benchmarks/data_pipeline.py --dir), a new run.dir, a run's
    profile.dir."""
    from benchmarks.data_pipeline import main as data_pipeline
    from launch.pretrain import main as pretrain

    _refused(capsys, _status(lambda: data_pipeline(["--dir", str(run / "scratch"), "--small"])), run / "scratch",
             "run directory")
    nested = run / "checkpoints" / "step_4" / "new_run"
    assert pretrain([f"--run.dir={nested}", *ONE_STEP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run.dir={nested} is inside the checkpoint" in err[0], err
    assert not nested.exists()
    fresh = tmp_path / "fresh"
    assert pretrain([f"--run.dir={fresh}", *ONE_STEP, "--profile.enabled=true", "--profile.steps=0",
                     "--profile.dir=checkpoints/traces"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profile.dir=checkpoints/traces is inside run.dir=" in err[0], err
    assert not fresh.exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run dir: one pretraining step of the debug model, checkpoint step_1."""
    from launch.pretrain import main

    run = tmp_path_factory.mktemp("trained") / "run"
    assert main([f"--run.dir={run}", *ONE_STEP]) == 0
    return run


@pytest.mark.parametrize("inside", ["run directory", "checkpoint"])
def test_an_export_into_another_run_dir_or_checkpoint_is_refused(tmp_path, trained, capsys, inside):
    """(Into the exported run's own directory it was refused before: an input.)"""
    from launch.export_hf import main

    other = _fake_run(tmp_path / "other")
    out = other / "hf" if inside == "run directory" else other / "checkpoints" / "step_4" / "hf"
    _refused(capsys, _status(lambda: main(["--run-dir", str(trained), "--out", str(out)])), out, inside)


def test_rotation_removes_only_what_the_checkpointer_wrote(tmp_path, capfd):
    """keep=1: step_1 is rotated out when step_2 is saved. A file put into step_1 by hand (as the tools
    refuse to) stays, a line names it, and every file of the save is gone; a checkpoint holding only
    the save's files is removed whole (step_2 -> step_3)."""
    from launch.pretrain import main

    run = tmp_path / "run"
    argv = [f"--run.dir={run}", *ONE_STEP, "--checkpoint.keep=1"]
    assert main(argv) == 0
    step_1 = run / "checkpoints" / "step_1"
    written = sorted(os.listdir(step_1))
    assert "COMPLETE" in written and ".metadata" in written
    assert json.loads((step_1 / "COMPLETE").read_text())["files"] == written
    (step_1 / "rollouts.jsonl").write_text("mine\n")
    capfd.readouterr()
    assert main([*argv, "--training.steps=2"]) == 0
    out = capfd.readouterr().out
    assert sorted(os.listdir(step_1)) == ["rollouts.jsonl"] and (step_1 / "rollouts.jsonl").read_text() == "mine\n"
    lines = [line for line in out.splitlines() if line.startswith("checkpoint.keep:")]
    assert len(lines) == 1 and f"removed checkpoint {step_1}" in lines[0] and "rollouts.jsonl" in lines[0], out
    assert main([*argv, "--training.steps=3"]) == 0
    assert sorted(os.listdir(run / "checkpoints")) == ["step_1", "step_3"]  # step_2 held only its save's files
