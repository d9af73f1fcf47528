"""benchmarks/step_projection.py takes dtypes, activation checkpointing and micro-batches from the config
(a flag overrides one) and says in one line why its memory differs from launch/estimate_memory.py's."""

import pytest

from benchmarks.step_projection import MEMORY_NOTE, main

BF16_JOB = """
[model]
preset = "debug"
[data]
seq_len = 128
batch_size = 16
[training]
param_dtype = "bfloat16"
reduce_dtype = "float32"
activation_checkpoint = "full"
grad_accum = 2
"""


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(BF16_JOB)
    return str(path)


def _row(job, capsys, *flags):
    out = main(["--config", job, "--world", "8", *flags])
    return out, out["rows"][0], capsys.readouterr().out


def test_dtypes_and_checkpointing_come_from_the_config(job, capsys):
    out, row, printed = _row(job, capsys)
    assert (out["param_dtype"], out["act_dtype"], out["reduce_dtype"], out["activation_checkpoint"]) == \
        ("bfloat16", "bfloat16", "float32", "full")
    assert row["micro_batches"] == 2 and row["host_syncs"] == 1 + 2 * 2 * 2  # full checkpointing reruns the routing
    assert "param_dtype bfloat16 (config)" in printed and MEMORY_NOTE in printed
    _, fp32, printed = _row(job, capsys, "--param-dtype", "float32", "--act-dtype", "float32")
    assert "param_dtype float32 (flag)" in printed
    for mesh in row["fsdp"]:  # weights gathered in bf16: half the bytes of fp32; gradients stay fp32
        gathered = lambda r: r["fsdp"][mesh]["all_gather"]["intra_gb"] + r["fsdp"][mesh]["all_gather"]["inter_gb"]  # noqa: E731
        if mesh == "expert":
            assert gathered(row) == pytest.approx(gathered(fp32) / 2, rel=1e-9)
        else:  # but the routers, FSDP units of their own gathered in fp32 (parallel/fsdp.py; to the byte in
            # tests/entry/test_dry_run.py): a small excess over half
            assert gathered(fp32) / 2 < gathered(row) < gathered(fp32) / 2 * 1.02
        assert row["fsdp"][mesh]["reduce_scatter"] == fp32["fsdp"][mesh]["reduce_scatter"]
    # tokens dispatched in bf16: half the bytes, plus the per-expert int64 counts, which do not shrink with
    # the dtype (planning/ep_traffic.py INTEGER_STAGES; 224 bytes of 682 kB here)
    assert fp32["ep"]["intra_gb"] / 2 < row["ep"]["intra_gb"] < fp32["ep"]["intra_gb"] / 2 * 1.01
    assert row["memory_gib"]["activations"] == pytest.approx(fp32["memory_gib"]["activations"] / 2, rel=1e-9)
    _, none, _ = _row(job, capsys, "--activation-checkpoint", "none")
    assert none["memory_gib"]["activations"] > 1.5 * row["memory_gib"]["activations"]
    assert none["host_syncs"] == 1 + 2 * 2
