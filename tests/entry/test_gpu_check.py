"""`benchmarks/gpu_check.py --device cpu --small` runs every section of the GPU check on the CPU,
so the one command a GPU user runs cannot rot; its calibration is what the projections read. Its sections'
modules: benchmarks/gpu_check_train.py (the step's settings and model), benchmarks/gpu_check_paths.py."""

import json
import math

import torch

from benchmarks.gpu_check import main, parse_args, run
from benchmarks.gpu_check_train import train_argv
from planning.devices import DEVICES, calibrate
from multirank import run_ranks


def _run(rank, world_size, path):
    main(["--device", "cpu", "--small", "--json", path])


def test_every_section_runs_and_the_projection_reads_the_calibration(tmp_path):
    path = str(tmp_path / "gpu_check.json")
    run_ranks(_run, 1, path, timeout=300)  # its own process: the check creates and destroys a process group
    with open(path) as f:
        out = json.load(f)
    for name in ("env", "matmul", "ns", "grouped_mm", "attention", "train_step", "compiled_block", "cp_attention",
                 "grouped_mm_empty", "train_variants", "calibration"):
        assert "error" not in out[name] and "skipped" not in out[name], (name, out[name])
    block = out["compiled_block"]
    assert block["dense_graphs"] >= 1 and block["moe_graphs"] >= 1, block
    assert block["dense_recompiles"] == block["moe_recompiles"] == 0, block
    for kind in ("dense", "moe"):  # document masking: flex in the compiled blocks, new layouts recompile nothing
        documents = block[f"{kind}_documents"]
        assert documents["graphs"] >= 1 and documents["recompiles"] == 0 and documents["output_error_ratio"] <= 2
    step = out["train_step"]
    assert all(math.isfinite(x) for x in step["losses"]) and step["tokens_per_s"] > 0
    assert step["host_syncs"]["total"] == 1, step["host_syncs"]  # one process: the step's one readback
    from benchmarks.gpu_check import ns_variants
    assert set(out["ns"]["rates"]) == {f"{v} {d}" for v in ns_variants() for d in ("bfloat16", "float32")}
    assert len(ns_variants()) >= 2  # every coefficient set (x every method optim/newton_schulz.py offers)
    assert "v128 math forward_tflops" in out["attention"]
    assert out["attention"]["training_pads_values"] is True  # CPU flash takes one width (math otherwise)
    assert out["env"]["fp32_matmul_precision"] in ("none", "ieee", "tf32") and out["ns"]["float32_uses_tf32"] is True
    for name in ("mla", "gqa"):  # context parallelism's flash pair ran, for cp = 2 and 4
        assert out["cp_attention"][name]["flash_pair"] and {"cp2", "cp4"} <= set(out["cp_attention"][name])
    assert out["grouped_mm_empty"]["all_empty"]["counts"] == [0] * 4
    assert out["train_variants"]["qk_clip"]["clipped_heads"][0] > 0
    device = calibrate(DEVICES["h200"], path)
    assert device.sustained_tflops == out["kimi_blocks_gflops"]["bfloat16"] / 1e3
    assert set(out["rates_tflops"]) >= {"matmul_bf16", "grouped_mm_bf16", "attention_bf16"}


def test_the_default_device_cuda_gets_an_index(monkeypatch, tmp_path):
    """`--device cuda` (the default) names no index, which torch.cuda.set_device rejects: the check
    takes the current device's. The stand-in validates as torch.cuda.set_device does (CPU build)."""
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(torch.cuda._utils._get_device_index(d)))
    out = run(parse_args(["--sections", "calibration", "--json", str(tmp_path / "x.json")]))
    assert seen == [0] and out["device"] == "cuda:0", (seen, out["device"])


def _logits_dtype(rank, world_size, argv):
    from benchmarks.gpu_check_train import build_model_quick
    from parallel.meshes import build_meshes
    from runtime.config_parser import load_config

    config = load_config(argv)
    layout = config.layout(1)
    model = build_model_quick(config, build_meshes(layout, "cpu"), layout, torch.device("cpu"))
    return str(model(torch.zeros(1, 8, dtype=torch.int64)).dtype)


def test_the_train_step_computes_in_the_configured_param_dtype():
    """The GPU step runs moonlight widths with --training.param_dtype=bfloat16: FSDP must all-gather
    and compute in bf16 (fp32 would time fp32 matmuls against the bf16 peak)."""
    argv = train_argv(True, torch.device("cpu"), 0) + ["--training.param_dtype=bfloat16"]
    assert run_ranks(_logits_dtype, 1, argv) == ["torch.bfloat16"]


def test_a_wrong_chunked_attention_fails_the_cp_section(monkeypatch):
    """The check can fail: a chunked attention that drops the causal diagonal's last key differs."""
    import benchmarks.gpu_check_paths as paths
    import parallel.context_parallel as cp_module
    from benchmarks.gpu_check import Context

    real = cp_module.balanced_chunk_attention
    monkeypatch.setattr(cp_module, "balanced_chunk_attention",
                        lambda q, k, v, r, cp, s: real(q, k, v, r, cp, s * 1.05))  # a wrong softmax scale
    ctx = Context(parse_args(["--device", "cpu", "--small"]))
    try:
        paths.section_cp_attention(ctx)
    except paths.PathMismatch as e:
        assert "cp=2" in str(e)
    else:
        raise AssertionError("a 5% wrong softmax scale passed the cp_attention check")
