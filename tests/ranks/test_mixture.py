"""Weighted mixtures of token sources (runtime/data/mixture.py, `[[data.sources]]`): shares follow the weights,
the global batches are the same under every layout (hashes per step), sources wrap around into new
shuffled epochs, resume is bitwise, 1 process and 8 ranks give the same losses, bad input is one line."""

import hashlib
import os
import shutil

import numpy as np
import pytest
import torch

from entry_point import run_ok, run_pretrain
from launch.pretrain import check_environment
from runtime.config import ConfigError
from runtime.config_parser import load_config
from runtime.data.indexed import IndexedWriter
from runtime.data.loader import Loader
from runtime.data.mixture import Allocation, Mixture

HEADLINE = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"]


def _indexed(prefix, n_tokens, low, seed):
    """An indexed dataset of random documents (5..80 tokens) with ids in [low, low + 50)."""
    rng, writer, left = np.random.default_rng(seed), IndexedWriter(prefix, np.uint16), n_tokens
    while left > 0:
        k = min(left, int(rng.integers(5, 80)))
        writer.add_document(rng.integers(low, low + 50, size=k))
        left -= k
    writer.finalize()
    return prefix


def _mixture_toml(tmp_path, weights=(0.6, 0.3, 0.1), sizes=(30000, 8000, 2000), extra=""):
    names = ["code", "math", "web"]
    tables = "".join(f'[[data.sources]]\npath = "{_indexed(str(tmp_path / n), size, 60 * i, i)}"\n'
                     f'weight = {w}\nname = "{n}"\n' for i, (n, w, size) in enumerate(zip(names, weights, sizes)))
    path = tmp_path / "mix.toml"
    path.write_text(f"[data]\nseq_len = 32\nbatch_size = 8\n{extra}\n{tables}")
    return str(path)


@pytest.mark.parametrize("weights, batch_size", [((0.6, 0.2, 0.2), 16), ((1, 1, 1, 1, 1, 1, 1, 93), 4),
                                                 ((3.0, 0.02), 8)])
def test_rows_follow_the_weights_within_one_row_at_every_step(weights, batch_size):
    """The issue asks for 2% over 200 steps; the largest-remainder allocation holds every source within
    one row of its exact share at every step, also when a source gets less than one row a step."""
    allocation, w = Allocation(list(weights), batch_size), np.asarray(weights) / sum(weights)
    for t in range(201):
        counts = allocation.cumulative(t)
        assert counts.sum() == t * batch_size and np.abs(counts - t * batch_size * w).max() < 1, (t, counts)
        assert t == 0 or (allocation.counts(t - 1) >= 0).all()
    shares = allocation.cumulative(200) / (200 * batch_size)
    assert np.abs(shares - w).max() < 0.02 * w.min() + 1 / (200 * batch_size)


def test_a_source_that_runs_out_wraps_around_in_new_shuffled_epochs_and_says_so_once():
    said = []
    mixture = Mixture(["big", "small"], [10_000, 5 * 16 + 1], [1, 1], batch_size=4, seq_len=16, seed=3,
                      say=said.append)  # "small": 5 windows of 17 tokens, 2 rows a step
    starts = [mixture.draws(t) for t in range(10)]
    small = np.concatenate([start[src == 1] for src, start in starts]) // 16  # window indices, in draw order
    epochs = small.reshape(4, 5)
    assert all(sorted(e) == list(range(5)) for e in epochs)  # every window once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # each epoch its own order
    assert len(said) == 1 and "source 'small' ran out of its 5 windows of 17 tokens at step 2" in said[0], said


def _global_batches(config_path, steps, dp, cp, grad_accum):
    """Per step, the sha256 of the global [batch_size, seq_len] inputs and labels reassembled from every rank."""
    config = load_config(["--config", config_path, f"--training.grad_accum={grad_accum}"])
    d, hashes = config.data, []
    loaders = {(r, c): Loader(d, 0, dp_rank=r, dp_degree=dp, cp_rank=c, cp_degree=cp, grad_accum=grad_accum,
                              vocab_size=256, holdout=0.05) for r in range(dp) for c in range(cp)}
    per_micro, rows = d.batch_size // grad_accum, d.batch_size // (grad_accum * dp)
    for step in range(steps):
        inputs = torch.full((2, d.batch_size, d.seq_len), -1, dtype=torch.int64)
        for (r, c), loader in loaders.items():
            for m, (x_BS, y_BS, pos_S) in enumerate(loader.batch(step)):
                first = m * per_micro + r * rows
                inputs[0, first:first + rows, pos_S], inputs[1, first:first + rows, pos_S] = x_BS, y_BS
        assert (inputs >= 0).all()
        hashes.append(hashlib.sha256(inputs.numpy().tobytes()).hexdigest())
    return hashes


def test_global_batches_are_the_same_under_every_layout(tmp_path):
    path = _mixture_toml(tmp_path)
    single = _global_batches(path, 30, 1, 1, 1)
    assert len(set(single)) == 30
    for dp, cp, grad_accum in [(4, 2, 1), (2, 1, 2), (8, 1, 1)]:
        assert _global_batches(path, 30, dp, cp, grad_accum) == single, (dp, cp, grad_accum)


def test_one_process_and_eight_ranks_same_losses_and_resume_is_bitwise(tmp_path):
    path = _mixture_toml(tmp_path)
    argv = ["--config", path, "--training.steps=4", "--training.warmup_steps=1", "--checkpoint.interval=2",
            "--checkpoint.keep=0", "--eval.interval=2", "--eval.steps=1"]
    single = run_ok(tmp_path / "single", 1, argv)
    headline = run_ok(tmp_path / "headline", 8, argv + HEADLINE)
    for a, b in zip(single, headline, strict=True):
        assert a["tokens_by_source"] == b["tokens_by_source"]
        for key in ("loss", "eval_loss", "eval_loss/code", "eval_loss/math", "eval_loss/web"):
            if key in a:  # fp32; reduction order only (see test_pretrain's headline test)
                assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)
    assert set(single[1]) >= {"eval_loss", "eval_loss/code", "eval_loss/math", "eval_loss/web"}
    assert single[-1]["tokens_by_source"] == {"code": 19 * 32, "math": 10 * 32, "web": 3 * 32}  # 32 rows
    weights = {"code": 0.6, "math": 0.3, "web": 0.1}
    assert single[1]["eval_loss"] == pytest.approx(sum(w * single[1][f"eval_loss/{n}"] for n, w in weights.items()))
    shutil.rmtree(tmp_path / "single" / "checkpoints" / "step_4")
    resumed = run_ok(tmp_path / "single", 1, argv)  # steps 2 and 3 again, from step_2
    keys = ("loss", "grad_norm", "tokens_by_source", "eval_loss", "eval_loss/web")
    assert [[r.get(k) for k in keys] for r in resumed] == [[r.get(k) for k in keys] for r in single]


@pytest.mark.parametrize("table, message", [
    ('[[data.sources]]\npath = "{d}/code"\nweight = 0\n', "data.sources[0].weight=0.0 must be positive and finite"),
    ('[[data.sources]]\npath = "{d}/code"\nweight = -1\n', "data.sources[0].weight=-1.0 must be positive"),
    ('[[data.sources]]\npath = "{d}/code"\nweight = inf\n', "data.sources[0].weight: expected a finite float"),
    ('[[data.sources]]\npath = "{d}/code"\n[[data.sources]]\npath = "{d}/other/code"\n',
     "data.sources[1].name='code' repeats data.sources[0]'s"),
    ('[[data.sources]]\npath = "{d}/code"\nwieght = 1\n', "data.sources[0].wieght: unknown key"),
    ('path = "{d}/code"\n[[data.sources]]\npath = "{d}/code"\n', "data.path='{d}/code' and [[data.sources]] are both"),
    ('source = "corpus"\n[[data.sources]]\npath = "{d}/code"\n', "[[data.sources]] are token files, but data.source"),
])
def test_bad_mixture_configs_are_one_line_naming_the_key(tmp_path, table, message):
    path = tmp_path / "bad.toml"
    path.write_text("[data]\n" + table.format(d=tmp_path))
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(path)])
    assert message.format(d=tmp_path) in str(error.value) and "\n" not in str(error.value), str(error.value)
    with pytest.raises(ConfigError, match=r"^data.sources\[0\]: give it as \[\[data.sources\]\] tables"):
        load_config(["--data.sources=a"])


@pytest.mark.parametrize("damage, message", [
    (lambda d: os.remove(f"{d}/math.idx"), "data.sources[1].path: no such file '{d}/math'"),
    (lambda d: os.remove(f"{d}/web.bin"), "data.sources[2].path: indexed dataset {d}/web: no such file {d}/web.bin"),
    (lambda d: open(f"{d}/web.bin", "ab").write(b"\0\0"), "data.sources[2].path: {d}/web.bin: 4002 bytes, but"),
    (lambda d: _indexed(f"{d}/math", 8000, 250, 1), "data.sources[1].path: {d}/math holds token id 2"),
])
def test_bad_source_files_exit_2_before_any_process_group(tmp_path, capfd, damage, message):
    path = _mixture_toml(tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError) as error:
        check_environment(load_config(["--config", path, f"--run.dir={tmp_path}/run"]))
    assert str(error.value).startswith(message.format(d=tmp_path)) and "\n" not in str(error.value), str(error.value)
    if "math.idx" in message or "no such file '{d}/math'" in message:  # the entry point, once: 2 ranks exit 2
        codes, _ = run_pretrain(tmp_path / "run", 2, ["--config", path], timeout=60)
        assert codes == [2, 2] and not os.path.exists(tmp_path / "run")


def test_example_mixture_config_loads():
    config = load_config(["--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                                   "mixture_example.toml")])
    assert config.data.source == "bin" and config.data.document_mask
    assert [(s.name, s.weight) for s in config.data.sources] == [("code", 0.6), ("math", 0.2), ("web", 0.2)]
    assert set(config.token_splits()) == {"train", "eval/code", "eval/math", "eval/web"}
    with_file = load_config(["--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                                      "mixture_example.toml"), "--eval.path=held_out.bin"])
    assert set(with_file.token_splits()) == {"train", "eval"} and with_file.token_splits()["eval"][0].sources == ()


def test_data_benchmarks_small_run(tmp_path):
    """benchmarks/data_pipeline.py and benchmarks/document_attention.py, tiny: the docs' figures' code paths."""
    from benchmarks import data_pipeline, document_attention

    rows = data_pipeline.main(["--small", "--dir", str(tmp_path)])["rows"]
    assert [r["setup"] for r in rows] == ["flat", "mixture8", "small_docs"]
    assert all(0 < r["fetch_fraction"] < 1 and r["rank0_of_8_tokens_per_s"] > 0 for r in rows)
    rows = document_attention.main(["--seqs", "256", "--repeats", "1", "--doc-len", "64"])["rows"]
    assert [r["variant"] for r in rows] == ["causal", "documents", "one_document", "dense_mask"]
