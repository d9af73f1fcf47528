"""Held-out evaluation (the same eval loss on 1 process and the 8-rank headline layout, never trained on),
TensorBoard event files read back with tensorboard's reader, and the loss-curve plot script."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from entry_point import run_ok
from runtime.data.config import DataConfig
from runtime.data.loader import Loader, split_tokens

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# lr 1e-30 (0 is refused) and no expert-bias update: the weights stay the initial ones bitwise (every update,
# ~lr, is far below half an ulp of the smallest initial |weight|, 4.5e-8: ulp ~3.6e-15; 1 - lr wd rounds to 1),
# so the eval loss compares the layouts' forward passes alone
ARGS = ["--training.steps=2", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=0", "--optim.lr=1e-30", "--model.bias_update_speed=0", "--eval.interval=1",
        "--eval.steps=2"]
HEADLINE = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"]


def run(run_dir, world_size, *extra):
    return run_ok(run_dir, world_size, ARGS + list(extra))


def test_eval_loss_is_the_same_on_1_and_8_ranks_and_deterministic(tmp_path):
    single = run(tmp_path / "single", 1)
    again = run(tmp_path / "again", 1)
    headline = run(tmp_path / "headline", 8, *HEADLINE)
    assert [r["eval_loss"] for r in single] == [r["eval_loss"] for r in again]  # deterministic in the seed
    for a, b in zip(single, headline):
        # fp32 forward only, identical weights: the layouts differ in the order of reductions inside
        # attention under CP and in the loss sum (measured ~1e-7 relative)
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6), (a, b)
    assert single[0]["eval_loss"] == single[1]["eval_loss"]  # lr 1e-30: same weights, same fixed eval batches
    assert single[0]["eval_loss"] != single[0]["loss"]  # other tokens than the training batch


def test_training_never_sees_the_held_out_tokens():
    config = DataConfig(seq_len=32, batch_size=8)
    train = Loader(config, seed=0, holdout=0.05, split="train")
    evaluation = Loader(config, seed=0, holdout=0.05, split="eval")
    everything = Loader(config, seed=0).tokens
    boundary = len(everything) - int(len(everything) * 0.05)
    assert len(train.tokens) == boundary and len(evaluation.tokens) == len(everything) - boundary
    assert np.shares_memory(evaluation.tokens, everything[boundary:])
    assert split_tokens(everything, 0.0, "train") is everything


def test_eval_on_a_separate_bin(tmp_path):
    path = tmp_path / "valid.bin"
    (np.arange(5000) % 200).astype(np.uint16).tofile(path)
    records = run(tmp_path / "run", 1, f"--eval.path={path}", "--data.dtype=uint16")
    assert all(r["eval_loss"] is not None for r in records)


def test_tensorboard_event_files_hold_every_step_and_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = run(tmp_path / "run", 1, "--metrics.tensorboard=true", "--training.steps=3")
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "eval_loss"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [0, 1, 2], key
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in records], rel=1e-6), key


def test_plot_metrics_writes_a_png_of_several_runs(tmp_path):
    for name, loss in (("a", 3.0), ("b", 2.5)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(5):
                record = {"step": step, "loss": loss - 0.1 * step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0}
                if step % 2 == 0:
                    record["eval_loss"] = loss - 0.05 * step
                f.write(json.dumps(record) + "\n")
            f.write('{"step": 5, "lo')  # a torn last line
    out = tmp_path / "curves.png"
    cmd = [sys.executable, os.path.join(REPO, "launch", "plot_metrics.py"), str(tmp_path / "a"), str(tmp_path / "b"),
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    result = subprocess.run(cmd[:2] + [str(tmp_path / "missing"), "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "no metrics.jsonl" in result.stderr


# (run dirs, --out, relative to tmp_path; the message's key phrase). "run" holds a good metrics.jsonl.
PLOT_MISTAKES = {
    "run_dir_is_the_metrics_file": (["run/metrics.jsonl"], "o.png",
                                    "{tmp}/run/metrics.jsonl is a file; give the run directory that holds"),
    "metrics_not_utf8": (["binary"], "o.png", "{tmp}/binary/metrics.jsonl is not UTF-8 text"),
    "metrics_without_steps": (["no_steps"], "o.png", "{tmp}/no_steps/metrics.jsonl holds no records"),
    "metrics_not_objects": (["not_objects"], "o.png", "{tmp}/not_objects/metrics.jsonl holds no records"),
    "out_is_a_directory": (["run"], "run", "--out {tmp}/run is a directory; give a file such as {tmp}/run/curves.png"),
    "out_without_extension": (["run"], "curves", "--out {tmp}/curves: no image extension (use .png"),
    "out_not_an_image": (["run"], "curves.txt", "--out {tmp}/curves.txt: unsupported image extension .txt"),
    "out_in_a_missing_directory": (["run"], "nodir/o.png", "--out {tmp}/nodir/o.png: {tmp}/nodir does not exist"),
}


def _metrics_dirs(tmp_path):
    for name, text in (("run", '{"step": 0, "loss": 3.0, "grad_norm": 1.0, "lr": 0.001, "tokens_per_s": 100.0}\n'),
                       ("no_steps", '{"loss": 3.0}\n{"loss": 2.9}\n'), ("not_objects", "[1, 2]\n3\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(text)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\x80\x03}q\x00.")  # e.g. a pickle


@pytest.mark.parametrize("case", list(PLOT_MISTAKES))
def test_plot_mistakes_exit_2_in_one_line_and_write_nothing(tmp_path, capsys, case):
    pytest.importorskip("matplotlib")
    from launch.plot_metrics import main

    _metrics_dirs(tmp_path)
    runs, out, phrase = PLOT_MISTAKES[case]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main([*[str(tmp_path / r) for r in runs], "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert phrase.format(tmp=tmp_path) in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_plot_labels_runs_that_share_a_name_by_their_path():
    from launch.plot_metrics import labels

    assert labels(["runs/a", "runs/b/"]) == ["a", "b"]
    assert labels(["exp1/run", "exp2/run/", "other"]) == ["exp1/run", "exp2/run", "other"]  # one curve per run


def _documents(prefix: str, seed: int) -> str:
    """An indexed dataset of 150 documents of 1-40 tokens (launch/tokenize_text.py's layout)."""
    from runtime.data.indexed import IndexedWriter

    rng = np.random.default_rng(seed)
    writer = IndexedWriter(prefix, np.uint16)
    for _ in range(150):
        writer.add_document(rng.integers(0, 256, size=int(rng.integers(1, 40))))
    writer.finalize()
    return prefix


def test_evaluate_reads_the_runs_own_masked_mixture(tmp_path, capsys):
    """launch/evaluate.py given only the run: the run's sources, weights, document mask and held-out part
    (recorded in the checkpoint), so its loss is the logged eval_loss; the file alone without the mask,
    what it evaluated before, is another number."""
    from launch import evaluate

    a, b = _documents(str(tmp_path / "a"), 0), _documents(str(tmp_path / "b"), 1)
    config = tmp_path / "mix.toml"
    config.write_text(f'[data]\ndocument_mask = true\n[[data.sources]]\npath = "{a}"\nweight = 0.7\n'
                      f'[[data.sources]]\npath = "{b}"\nweight = 0.3\n')
    logged = run(tmp_path / "run", 1, "--config", str(config), "--optim.lr=1e-2", "--eval.holdout=0.2",
                 "--training.seed=3")[-1]

    def evaluated(*argv):
        assert evaluate.main(["--model", str(tmp_path / "run"), *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    result = evaluated()
    # one process against one process, the same weights and batches; 1e-6: the 2-rank test's yardstick
    assert result["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert result["losses"]["eval_loss/a"] == pytest.approx(logged["eval_loss/a"], rel=1e-6)
    assert result["document_mask"] is True and result["seed"] == 3
    same = ["--data", a, "--holdout", "0.2", "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--seed", "3"]
    assert evaluated(*same, "--document-mask")["loss"] == pytest.approx(logged["eval_loss/a"], rel=1e-6)
    assert abs(evaluated(*same)["loss"] / logged["eval_loss/a"] - 1) > 1e-4  # unmasked: not the run's number


def test_evaluate_refuses_what_records_no_evaluation(tmp_path, capsys):
    from launch import evaluate

    run_ok(tmp_path / "run", 1, [a for a in ARGS if not a.startswith("--eval.")] + ["--eval.interval=0"])
    assert evaluate.main(["--model", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the run evaluated nothing (eval.interval=0" in err[0] and "give --data" in err[0], err


def test_resume_with_other_data_says_what_changed_in_one_line(tmp_path, capfd):
    """The checkpoint records the data settings: a resume with other weights or no document mask says so."""
    a, b = _documents(str(tmp_path / "a"), 0), _documents(str(tmp_path / "b"), 1)

    def mixture(weight_a, mask):
        config = tmp_path / f"mix_{weight_a}_{mask}.toml"
        config.write_text(f'[data]\ndocument_mask = {str(mask).lower()}\n[[data.sources]]\npath = "{a}"\nweight = '
                          f'{weight_a}\n[[data.sources]]\npath = "{b}"\nweight = {1 - weight_a:.1f}\n')
        return str(config)

    run(tmp_path / "run", 1, "--config", mixture(0.7, True))
    capfd.readouterr()
    run(tmp_path / "run", 1, "--config", mixture(0.2, False), "--training.steps=3")
    lines = [line for line in capfd.readouterr().out.splitlines() if "other data settings" in line]
    assert lines == ["resuming with other data settings than the checkpoint's: data.document_mask: True -> False; "
                     "data.sources[0].weight: 0.7 -> 0.2; data.sources[1].weight: 0.3 -> 0.8"], lines
