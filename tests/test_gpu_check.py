"""`benchmarks/gpu_check.py --device cpu --small` runs every section of the GPU check on the CPU,
so the one command a GPU user runs cannot rot; its calibration is what the projections read."""

import json
import math

from benchmarks.device_model import DEVICES, calibrate
from benchmarks.gpu_check import main
from multirank import run_ranks


def _run(rank, world_size, path):
    main(["--device", "cpu", "--small", "--json", path])


def test_every_section_runs_and_the_projection_reads_the_calibration(tmp_path):
    path = str(tmp_path / "gpu_check.json")
    run_ranks(_run, 1, path, timeout=300)  # its own process: the check creates and destroys a process group
    with open(path) as f:
        out = json.load(f)
    for name in ("env", "matmul", "ns", "grouped_mm", "attention", "train_step", "calibration"):
        assert "error" not in out[name] and "skipped" not in out[name], (name, out[name])
    step = out["train_step"]
    assert all(math.isfinite(x) for x in step["losses"]) and step["tokens_per_s"] > 0
    assert step["host_syncs"]["total"] == 1, step["host_syncs"]  # one process: the step's one readback
    from benchmarks.gpu_check import ns_variants
    assert set(out["ns"]["rates"]) == {f"{v} {d}" for v in ns_variants() for d in ("bfloat16", "float32")}
    assert len(ns_variants()) >= 2  # every coefficient set (x every method optim/newton_schulz.py offers)
    assert "v128 math forward_tflops" in out["attention"]
    device = calibrate(DEVICES["h200"], path)
    assert device.sustained_tflops == out["kimi_blocks_gflops"]["bfloat16"] / 1e3
    assert set(out["rates_tflops"]) >= {"matmul_bf16", "grouped_mm_bf16", "attention_bf16"}
