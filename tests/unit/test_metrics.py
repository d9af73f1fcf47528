"""Metrics: rank 0 writes one flushed JSON line per step and prints it; FLOPs per token for MFU."""

import json

import pytest
import torch

from models import Transformer, preset
from runtime.metrics import FIELDS, MetricsLogger, flops_per_token, peak_flops


def _log(logger, step, loss=2.5):
    return logger.log(step, loss=torch.tensor(loss), grad_norm=1.25, lr=1e-3, tokens=4096, step_time_s=0.5,
                      optimizer_time_s=0.1)


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rank0_writes_flushed_lines_and_prints(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), rank=0, total_steps=10)
    _log(logger, 0)
    _log(logger, 1, loss=float("nan"))
    records = _records(tmp_path / "metrics.jsonl")  # read while still open: each line is flushed
    assert [r["step"] for r in records] == [0, 1] and set(FIELDS) <= set(records[0])
    assert records[0]["loss"] == 2.5 and records[0]["tokens_per_s"] == pytest.approx(8192)
    assert records[1]["loss"] is None  # JSON has no NaN
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 0/10 | loss 2.5000 | grad 1.250 | lr 1.00e-03 | 8,192 tok/s | step 0.500s")
    assert "optim 0.100s" in out[0] and "rss" in out[0] and "loss nan" in out[1]
    logger.close()


def test_log_interval_thins_printed_lines_not_records(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), rank=0, total_steps=10, log_interval=4)
    for step in range(10):
        _log(logger, step)
    logger.close()
    printed = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["step 0/10", "step 4/10", "step 8/10", "step 9/10"]
    assert len(_records(tmp_path / "metrics.jsonl")) == 10


def test_other_ranks_write_and_print_nothing(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), rank=1, total_steps=10)
    assert _log(logger, 0) is None
    logger.info("hello")
    assert not (tmp_path / "metrics.jsonl").exists() and capsys.readouterr().out == ""


def test_resume_drops_records_of_steps_redone(tmp_path):
    logger = MetricsLogger(str(tmp_path), rank=0, total_steps=10)
    for step in range(5):
        _log(logger, step)
    logger.close()
    resumed = MetricsLogger(str(tmp_path), rank=0, total_steps=10, start_step=3)  # checkpoint at 3, crash at 5
    _log(resumed, 3, loss=1.0)
    resumed.close()
    records = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[-1]["loss"] == 1.0


def test_mfu_uses_flops_per_token_and_peak(tmp_path):
    logger = MetricsLogger(str(tmp_path), rank=0, total_steps=1, flops_per_token=1e9, peak_flops=1e12, world_size=2)
    record = _log(logger, 0)
    assert record["mfu"] == pytest.approx(8192 * 1e9 / 2e12)
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("Some CPU") is None


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_flops_per_token_counts_matmul_weights_and_causal_attention(name):
    config = preset(name, n_dense_layers=3)  # dense only: every matmul weight is active
    with torch.device("meta"):
        model = Transformer(config)
    # Independent count: the weights of Linear layers (norm weights are counted by flops_per_token
    # but are < 0.5% here, hence the tolerance).
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim if config.attn == "mla" else config.head_dim
    v = config.v_head_dim if config.attn == "mla" else config.head_dim
    attention = 3 * config.n_layers * config.n_heads * 128 * (qk + v)
    assert flops_per_token(config, 128) == pytest.approx(6 * linear + attention, rel=5e-3)
