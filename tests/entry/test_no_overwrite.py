"""No tool writes over one of its inputs (runtime/paths.py): every tool with an output flag, each
pointed at one of the files it reads, directly or through a symlink or hard link, exits with status 2
and one line, and the input is unchanged. Each case ran the tool to the end before (or failed in
another way) and destroyed the input."""

import dataclasses
import json
import os
import shutil

import pytest

from models import preset
from models.hf.config import hf_config_dict

CONFIG = "[training]\nsteps = 1\n"
ORIGINAL = "keep me\n"


def _config(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(CONFIG)
    return str(path)


def _link(tmp_path, target, how):
    """`target` itself, or a symlink / hard link to it."""
    if how == "direct":
        return str(target)
    link = tmp_path / f"{how}.json"
    (os.symlink if how == "symlink" else os.link)(target, link)
    return str(link)


def _expect_refused(capsys, call, victim, content, phrase="writing it would destroy the input"):
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and phrase in err[0], err
    assert open(victim).read() == content


@pytest.mark.parametrize("how", ["direct", "symlink", "hardlink"])
def test_estimate_memory_json_is_the_config(tmp_path, capsys, how):
    from launch.estimate_memory import main

    config = _config(tmp_path)
    out = _link(tmp_path, config, how)
    _expect_refused(capsys, lambda: main(["--config", config, "--world", "2", "--json", out]), config, CONFIG)


def test_estimate_memory_json_is_the_init_from_config_json(tmp_path, capsys):
    from launch.estimate_memory import main

    hf = tmp_path / "hf"
    hf.mkdir()
    text = json.dumps(hf_config_dict(preset("debug")))
    (hf / "config.json").write_text(text)
    _expect_refused(capsys, lambda: main(["--config", _config(tmp_path), "--world", "2", f"--model.init_from={hf}",
                                          "--json", str(hf / "config.json")]), hf / "config.json", text)


def test_plot_metrics_out_is_a_metrics_file(tmp_path, capsys):
    from launch.plot_metrics import main

    run = tmp_path / "run"
    run.mkdir()
    metrics = '{"step": 1, "loss": 2.0}\n'
    (run / "metrics.jsonl").write_text(metrics)
    os.symlink(run / "metrics.jsonl", tmp_path / "curves.png")
    assert main([str(run), "--out", str(tmp_path / "curves.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is also the metrics file of" in err[0], err
    assert (run / "metrics.jsonl").read_text() == metrics


def test_step_projection_json_is_the_config(tmp_path, capsys):
    from benchmarks.step_projection import main

    config = tmp_path / "job.toml"
    shutil.copy("configs/debug.toml", config)
    content = config.read_text()
    _expect_refused(capsys, lambda: main(["--config", str(config), "--world", "2", "--json", str(config)]),
                    config, content)


def test_projection_json_is_the_calibration(tmp_path, capsys):
    from benchmarks.projection import main

    calibration = tmp_path / "calibration.json"
    calibration.write_text(ORIGINAL)
    _expect_refused(capsys, lambda: main(["--calibration", str(calibration), "--json", _link(tmp_path, calibration,
                                                                                             "symlink")]),
                    calibration, ORIGINAL)


def test_ns_kernels_json_is_a_file_of_the_checkpoint(tmp_path, capsys):
    from benchmarks.ns_kernels import main

    checkpoint = tmp_path / "step_1"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_text(ORIGINAL)
    _expect_refused(capsys, lambda: main(["--momentum-checkpoint", str(checkpoint), "--sets", "debug",
                                          "--json", str(checkpoint / ".metadata")]), checkpoint / ".metadata", ORIGINAL)


def test_hf_load_out_is_a_shard_of_the_checkpoint(tmp_path, capsys):
    from benchmarks.hf_load import main

    (tmp_path / "model.safetensors").write_text(ORIGINAL)
    _expect_refused(capsys, lambda: main(["--dir", str(tmp_path), "--out", str(tmp_path / "model.safetensors")]),
                    tmp_path / "model.safetensors", ORIGINAL)


@pytest.mark.parametrize("tool", ["benchmarks.optimizer_step", "benchmarks.qk_clip_effect",
                                  "experiments.feedback_experiment"], ids=lambda tool: tool.split(".")[1])
def test_json_and_plot_are_the_same_file(tmp_path, capsys, tool):
    import importlib

    main = importlib.import_module(tool).main
    out = tmp_path / "result.png"
    out.write_text(ORIGINAL)
    argv = ["--json", str(out), "--plot", _link(tmp_path, out, "symlink")]
    if tool == "experiments.feedback_experiment":
        argv += ["--quick", "--work", str(tmp_path / "work")]
    _expect_refused(capsys, lambda: main(argv), out, ORIGINAL, phrase="are the same file")


def test_new_file_in_an_input_directory_is_allowed(tmp_path):
    from runtime.paths import check_output_file

    (tmp_path / "config.json").write_text("{}")
    check_output_file("--json", str(tmp_path / "estimate.json"), "x.json", [("a file of model.init_from", str(tmp_path))])
    with pytest.raises(ValueError, match="is also a file of model.init_from"):
        check_output_file("--json", str(tmp_path / "config.json"), "x.json", [("a file of model.init_from", str(tmp_path))])


def test_posttrain_run_dir_holding_init_from_is_refused(tmp_path, capsys):
    """posttrain.init_from inside run.dir's checkpoints: the run would resume from (and rotate out) that
    run's checkpoints instead of starting post-training from the one named."""
    from launch.posttrain import main

    step = tmp_path / "run" / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"model": dataclasses.asdict(preset("debug"))}))  # the model it holds
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"tokens": [1, 2, 3], "turns": [{"role": "assistant", "start": 0, "end": 3}]}\n')
    assert main(["--data.source=rollouts", f"--data.path={rollouts}", "--model.aux_loss_alpha=0",
                 f"--run.dir={tmp_path / 'run'}", f"--posttrain.init_from={step}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"posttrain.init_from={step} is inside run.dir=" in err[0], err
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoints"]


def _pretraining_run(run):
    """A run dir as launch/pretrain.py leaves it: a complete checkpoint, metrics, its kind file."""
    step = run / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"model": dataclasses.asdict(preset("debug"))}))
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 6.5}\n')
    (run / "kind").write_text("pretraining\n")
    return sorted(p.name for p in run.rglob("*"))


def _posttrain(tmp_path, *flags):
    from launch.posttrain import main

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"tokens": [1, 2, 3], "turns": [{"role": "assistant", "start": 0, "end": 3}]}\n')
    return main(["--data.source=rollouts", f"--data.path={rollouts}", "--model.aux_loss_alpha=0", *flags])


def test_posttrain_init_from_the_run_dir_itself_is_refused(tmp_path, capsys):
    """run.dir = posttrain.init_from = a pretraining run: post-training would resume the pretraining
    checkpoint as its own and rotate out an older one."""
    run = tmp_path / "run"
    before = _pretraining_run(run)
    (run / "kind").unlink()  # a run dir from before the kind file: its metrics say pretraining
    assert _posttrain(tmp_path, f"--run.dir={run}", f"--posttrain.init_from={run}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: run.dir=") and "holds a pretraining run" in err[0], err
    assert sorted(p.name for p in run.rglob("*")) == [n for n in before if n != "kind"]


def test_posttrain_into_a_pretraining_run_dir_is_refused(tmp_path, capsys):
    """A run dir holds one kind of run, whatever posttrain.init_from names."""
    run, other = tmp_path / "run", tmp_path / "other"
    before = _pretraining_run(run)
    _pretraining_run(other)
    assert _posttrain(tmp_path, f"--run.dir={run}", f"--posttrain.init_from={other}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run.dir={run} holds a pretraining run" in err[0] and "post-training" in err[0], err
    assert sorted(p.name for p in run.rglob("*")) == before


def test_pretrain_into_a_post_training_run_dir_is_refused(tmp_path, capsys):
    from launch.pretrain import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "rl_loss": 0.1}\n')
    assert main([f"--run.dir={run}", "--training.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run.dir={run} holds a post-training run" in err[0], err


def test_init_from_holding_the_run_dir_is_refused(tmp_path):
    """The shared guard, for a directory output: inside an input, or holding one, is refused both ways."""
    from runtime.paths import check_run_dir_apart

    run = tmp_path / "hf" / "run"
    with pytest.raises(ValueError, match=r"its checkpoints/\) is inside model.init_from="):
        check_run_dir_apart(str(run), [(f"model.init_from={tmp_path / 'hf'}", str(tmp_path / "hf"))])
    data = str(tmp_path / "run" / "a.bin")  # a token file in the run dir, outside checkpoints/: no overlap
    check_run_dir_apart(str(tmp_path / "run"), [(f"data.path={data}", data)])


def test_prepare_rollouts_out_in_the_tokenizer_directory_is_refused(tmp_path, capsys):
    """--out naming a file of --tokenizer would replace the chat template the rollouts are made with."""
    from launch.prepare_rollouts import main

    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text(ORIGINAL)
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "assistant", "content": "hi"}], "reward": 1.0}\n')
    victim = tokenizer / "tokenizer_config.json"
    _expect_refused(capsys, lambda: _exit(main(["--tokenizer", str(tokenizer), "--in", str(chats), "--out",
                                                 str(victim)])), victim, ORIGINAL)


def _exit(status):
    raise SystemExit(status)


def test_posttrain_with_every_loss_coefficient_zero_is_refused(tmp_path, capsys):
    """A loss of 0 trains nothing, yet would exit 0 and write a checkpoint (optim.lr=0 is refused alike)."""
    run = tmp_path / "run"
    assert _posttrain(tmp_path, f"--run.dir={run}", "--posttrain.rl_coef=0", "--posttrain.feedback_coef=0") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "posttrain.sft_coef=0, posttrain.rl_coef=0 and posttrain.feedback_coef=0" in err[0], err
    assert not run.exists()
