"""`posttrain.init_from` supplies the model's shape as well as its weights: a run directory of another shape
than the default preset post-trains with no [model] key, a contradicting key is one line (exit 2), and a
Hugging Face directory works the same way; the start-up log says which weights came from where."""

import os

import pytest

from entry_point import run_ok, run_pretrain
from launch import posttrain
from runtime.config_parser import load_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ROLLOUTS = ["--data.source=rollouts", f"--data.path={os.path.join(REPO, 'examples', 'rollouts.jsonl')}",
            "--training.steps=1", "--training.warmup_steps=1", "--eval.interval=0", "--data.batch_tokens=1024",
            "--optim.name=adamw"]


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory):
    """A 1-step pretraining run whose model (2 layers, dim 32) is not the default preset's (3 layers, dim 64)."""
    run_dir = tmp_path_factory.mktemp("pre")
    run_ok(run_dir, 1, ["--model.n_layers=2", "--model.dim=32", "--training.steps=1", "--data.seq_len=32",
                        "--data.batch_size=4", "--eval.interval=0"])
    assert (run_dir / "kind").read_text() == "pretraining\n"  # the kind of run it holds (runtime/paths.py)
    return run_dir


def test_the_checkpoint_supplies_the_shape(pretrained_run):
    """No [model] key: the run dir's newest checkpoint gives the shape (the 2-rank post-training run from a
    checkpoint, with its start-up line and console line, is tests/entry/test_new_user_path.py's last step)."""
    config = load_config([*ROLLOUTS, f"--posttrain.init_from={pretrained_run}"])
    assert (config.model.n_layers, config.model.dim) == (2, 32) and config.model_init_from == ""
    posttrain.check_environment(config)
    step_1 = os.path.join(str(pretrained_run), "checkpoints", "step_1")
    assert load_config([*ROLLOUTS, f"--posttrain.init_from={step_1}"]).model == config.model


@pytest.mark.parametrize("extra, message", [
    (["--model.n_layers=3"], "model.n_layers=3 (checkpoint: 2): contradicts posttrain.init_from="),
    (["--model.preset=debug"], "model.preset='debug' (dim=64, n_layers=3; checkpoint: dim=32, n_layers=2)"),
])
def test_a_contradicting_model_key_is_one_line_and_exit_2(pretrained_run, tmp_path, capfd, extra, message):
    codes, _ = run_pretrain(tmp_path / "post", 1, [*ROLLOUTS, f"--posttrain.init_from={pretrained_run}", *extra],
                            entry=posttrain.main)
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert codes == [2] and len(err) == 1 and message in err[0], err
    assert not os.path.exists(tmp_path / "post" / "metrics.jsonl")


def test_training_only_keys_may_differ(pretrained_run):
    config = load_config([*ROLLOUTS, f"--posttrain.init_from={pretrained_run}", "--model.bias_update_speed=0",
                          "--model.dim=32"])
    assert config.model.bias_update_speed == 0 and config.model.dim == 32


def test_a_hugging_face_directory_as_init_from(tmp_path, capfd):
    pytest.importorskip("transformers")
    from hf_reference import hf_config, random_hf_model

    random_hf_model(hf_config(vocab_size=256)).save_pretrained(tmp_path / "hf")
    argv = [*ROLLOUTS, f"--posttrain.init_from={tmp_path / 'hf'}"]
    assert load_config(argv).model.dim == 32 and load_config(argv).model_init_from == str(tmp_path / "hf")
    codes, records = run_pretrain(tmp_path / "post", 1, argv, entry=posttrain.main)
    out = capfd.readouterr().out
    assert codes == [0] and len(records) == 1 and (tmp_path / "post" / "kind").read_text() == "post-training\n"
    assert f"initialized from {tmp_path / 'hf'}" in out and "from the Hugging Face directory" in out
    with pytest.raises(ValueError, match="model.init_from=.* and posttrain.init_from=.*: give one"):
        load_config([*argv, f"--model.init_from={tmp_path / 'hf'}"])
