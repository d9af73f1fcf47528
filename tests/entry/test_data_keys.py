"""Which data is read, and no [data]/[eval] key without effect (issue 33 item 1): a data.path alone
selects the token file (rollouts under launch/posttrain.py) instead of being ignored, every key the
chosen mode never reads is refused in one line, and the start-up line names the data."""

import json
import os

import numpy as np
import pytest

from entry_point import run_ok
from launch import posttrain
from launch.pretrain import main
from runtime.config import ConfigError
from runtime.config_parser import load_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ROLLOUTS = os.path.join(REPO, "examples", "rollouts.jsonl")
SMALL = ["--training.steps=1", "--training.warmup_steps=0", "--data.seq_len=32", "--data.batch_size=2",
         "--eval.steps=1", "--checkpoint.interval=0"]


def _bin(tmp_path, n=3000):
    path = str(tmp_path / "t.bin")
    (np.arange(n) % 256).astype(np.uint16).tofile(path)
    with open(path + ".json", "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": 256}, f)
    return path


def test_a_path_alone_selects_the_token_file_or_rollouts():
    assert load_config(["--data.path=a.bin"]).data.source == "bin"
    assert load_config(["--data.path=r.jsonl"], path_source="rollouts").data.source == "rollouts"
    assert load_config([]).data.source == "corpus" and load_config(["--data.source=bin", "--data.path=a"]).data.path == "a"


def test_a_missing_file_given_alone_exits_2_instead_of_training_on_the_corpus(tmp_path, capsys):
    """The defect: `--data.path=missing.bin` trained on the bundled corpus and exited 0."""
    code = main([f"--data.path={tmp_path}/missing.bin", f"--run.dir={tmp_path}/run", *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"config error: data.path: no such file '{tmp_path}/missing.bin'"), err
    assert not os.path.exists(tmp_path / "run")


def test_posttrain_reads_a_path_alone_as_rollouts(tmp_path):
    config = load_config([f"--data.path={ROLLOUTS}", "--optim.name=adamw"], path_source="rollouts")
    posttrain.check_environment(config)  # refuses any source but rollouts


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/debug.toml", "--data.path=a.bin"],
     "data.path='a.bin' is read only by data.source 'bin' or 'rollouts', but data.source='corpus'"),
    (["--data.source=synthetic", "--data.path=a.bin"], "data.source='synthetic'"),
    (["--data.dtype=uint16"], "data.dtype=uint16 applies to token files only (data.source='bin' or eval.path), "
                              "but data.source='corpus'"),
    (["--data.batch_tokens=100"], "data.batch_tokens=100 is read only by data.source='rollouts'"),
    (["--data.source=rollouts", "--data.path=r.jsonl", "--data.seq_len=64"], "data.seq_len=64 has no effect"),
    (["--data.source=rollouts", "--data.path=r.jsonl", "--data.batch_size=3"], "data.batch_size=3 has no effect"),
    (["--eval.path=v.bin", "--eval.holdout=0.1"], "eval.holdout=0.1 has no effect: eval.path='v.bin'"),
    (["--data.source=synthetic", "--eval.holdout=0.1"], "eval.holdout=0.1 has no effect on data.source='synthetic'"),
    (["--data.source=rollouts", "--data.path=r.jsonl", "--eval.interval=5"],
     "eval.interval=5 has no effect: post-training evaluates only on an eval.path"),
])
def test_keys_without_effect_are_refused_in_one_line(argv, message):
    argv = [os.path.join(REPO, a) if a.startswith("configs/") else a for a in argv]
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_evaluation_switches_off_from_the_command_line(tmp_path):
    """eval.interval=0 is the off switch: the TOML's other [eval] keys stay, unread."""
    toml = tmp_path / "job.toml"
    toml.write_text('[eval]\nsteps = 2\npath = "v.bin"\n')
    config = load_config(["--config", str(toml), "--eval.interval=0"])
    assert not config.eval.enabled() and config.token_splits().keys() == {"train"}


def test_keys_with_effect_are_accepted():
    load_config(["--eval.path=v.bin", "--data.dtype=uint16"])  # the eval file's dtype
    load_config(["--data.source=rollouts", "--data.path=r.jsonl", "--eval.path=v.bin", "--data.seq_len=64"])
    load_config(["--config", os.path.join(REPO, "configs", "debug.toml"), "--eval.path=v.bin"])  # holdout = default


def test_startup_line_names_source_file_tokens_and_split(tmp_path, capfd):
    path = _bin(tmp_path)
    run_ok(tmp_path / "run", 1, [f"--data.path={path}", *SMALL])
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("data: ")]
    assert lines == [f"data: bin {path} (uint16): 3,000 tokens, documents not recorded; training reads the first "
                     f"2,850 | held-out: the last 150 tokens of the training source (eval.holdout=0.05); 1 batches "
                     f"of data.batch_size every 100 steps"], lines
