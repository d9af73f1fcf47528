"""Settings that were accepted and then ignored, or exceeded without a word, now refused in one line
(status 2, naming the key) or said at start-up: `training.compile_backend` while nothing compiles (and a
"compile:" line saying what compiles), `posttrain.top_k` above the vocabulary (and the posttrain keys the
chosen mode or teacher never reads), `data.batch_tokens` below the costliest trajectory (a note naming it),
and a rollout file given to evaluate.py as its token `--data` (named as what it is, not a data.dtype
question)."""

import json
import os
import shutil

import pytest

from launch.posttrain import main as posttrain
from launch.pretrain import main as pretrain
from runtime.config import ConfigError
from runtime.config_parser import load_config

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rollouts.jsonl")
ONE_STEP = ["--training.steps=1", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=4",
            "--eval.interval=0"]
ROLLOUTS = ["--data.source=rollouts", f"--data.path={EXAMPLE}", "--model.aux_loss_alpha=0"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("job, flags", [
    ("pretraining", ["--training.compile=false"]),
    ("pretraining", []),  # auto: compiles on cuda only
    ("post-training", []),  # post-training runs eager
])
def test_a_compile_backend_that_nothing_reads_is_refused(tmp_path, capsys, job, flags):
    run = tmp_path / "run"
    main, extra = (pretrain, ONE_STEP) if job == "pretraining" else (posttrain, ROLLOUTS)
    assert main([*extra, *flags, f"--run.dir={run}", "--training.compile_backend=aot_eager"]) == 2
    line = _one_line(capsys)
    assert line.startswith("config error: training.compile_backend='aot_eager' has no effect: nothing compiles"), line
    assert not run.exists()


def test_the_start_up_says_whether_and_what_compiles(tmp_path, capsys):
    from parallel.compile import BACKENDS
    from runtime.train import describe_compile

    config = load_config(["--training.compile=true", "--training.compile_backend=aot_eager"])
    line = describe_compile(config, config.layout(1))
    assert line.startswith("compile: on (aot_eager, fullgraph; ") and "aot_eager" in BACKENDS, line
    assert "1 block: whole" in line and "MoE" not in line  # debug: one dense block, then MoE blocks in regions
    assert "block: attention_norm + attention + ffn_norm" in line.replace("blocks:", "block:"), line
    assert pretrain([*ONE_STEP, f"--run.dir={tmp_path / 'run'}"]) == 0
    said = [s for s in capsys.readouterr().out.splitlines() if s.startswith("compile:")]
    assert said == ["compile: off (training.compile=auto compiles on cuda only, this is cpu)"]


@pytest.mark.parametrize("flags, words", [
    (["--posttrain.mode=topk", "--posttrain.top_k=300"], "posttrain.top_k=300 is above model.vocab_size=256"),
    (["--posttrain.top_k=16"], "posttrain.top_k=16 is read only with posttrain.mode=topk"),
    (["--posttrain.mode=topk", "--posttrain.vocab_chunk=64"], "posttrain.vocab_chunk=64 is read only with "
                                                              "posttrain.mode=full"),
    (["--posttrain.ema_decay=0.5"], "posttrain.ema_decay=0.5 is read only with posttrain.teacher=ema"),
])
def test_posttrain_keys_the_run_would_not_read_are_refused(flags, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config([*ROLLOUTS, *flags])
    load_config([*ROLLOUTS, "--posttrain.mode=topk", "--posttrain.top_k=256", "--posttrain.teacher=ema",
                 "--posttrain.ema_decay=0.5"])  # read, within the vocabulary


def test_a_budget_below_the_costliest_trajectory_is_noted_at_start(tmp_path, capsys):
    from runtime.posttrain.rollouts import read_rollouts

    costs = [t.cost() for t in read_rollouts(EXAMPLE, 256, 256)]
    worst = max(costs)
    line = 1 + costs.index(worst)  # examples/rollouts.jsonl has no blank line
    argv = [*ROLLOUTS, "--training.steps=1", "--training.warmup_steps=1", "--optim.name=adamw"]
    assert posttrain([*argv, f"--run.dir={tmp_path / 'a'}", f"--data.batch_tokens={worst - 1}"]) == 0
    notes = [s for s in capsys.readouterr().out.splitlines() if s.startswith("note: data.batch_tokens")]
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"note: data.batch_tokens={worst - 1:,} is below the cost of "
                               f"{sum(c > worst - 1 for c in costs)} trajectories (the largest, line {line} of "
                               f"{EXAMPLE}: {worst:,} = "), notes
    assert f"raise data.batch_tokens to {worst:,}" in notes[0]
    assert posttrain([*argv, f"--run.dir={tmp_path / 'b'}", f"--data.batch_tokens={worst}"]) == 0
    assert not [s for s in capsys.readouterr().out.splitlines() if s.startswith("note:")]


def test_evaluate_names_a_rollout_file_given_as_token_data(tmp_path, capsys):
    from launch.evaluate import main as evaluate
    from runtime.data.loader import open_bin

    run = tmp_path / "run"
    assert pretrain([*ONE_STEP, f"--run.dir={run}"]) == 0
    rollouts = shutil.copy(EXAMPLE, tmp_path / "rollouts.jsonl")
    capsys.readouterr()
    assert evaluate(["--model", str(run), "--data", str(rollouts)]) == 2
    line = _one_line(capsys)
    assert line == (f"evaluate error: --data: {rollouts} is JSON text (a rollout file for launch/posttrain.py?), "
                    f"not a token file: give token ids (launch/tokenize_text.py writes them, with a sidecar naming "
                    f"the dtype)"), line
    tokens = tmp_path / "ids.bin"
    tokens.write_bytes(bytes(range(64)))  # a token file without its sidecar: the dtype flag of the tool, named
    with pytest.raises(ValueError, match=r"^--dtype: 'auto' needs the sidecar .* of --data=.*; set --dtype to"):
        open_bin(str(tokens), "auto", "--data")
    with pytest.raises(ValueError, match=r"^data.dtype: 'auto' needs the sidecar .* of eval.path="):
        open_bin(str(tokens), "auto", "eval.path")
    assert json.loads(open(EXAMPLE).readline())  # the example is a rollout file indeed
