"""The benchmarks measure what they claim: the projection plans all of Kimi K2's Newton-Schulz work
(benchmarks/projection.py), the baselines compute the reference update, and the benchmark
(benchmarks/optimizer_step.py) runs end to end on 2 ranks."""

import json
import os

import pytest
import torch

from benchmarks import projection
from benchmarks.lib import harness
from benchmarks.lib.counters import count_step
from planning.devices import DEVICES
from benchmarks.lib.methods import Method, build_method
from benchmarks.lib.param_sets import build_param_set
from models import preset
from multirank import run_ranks
from optim.config import OptimConfig


def kimi_k2_ns_flops_by_hand() -> tuple[int, int, int]:
    """(total NS FLOPs of one step, of it in 2048 x 7168 expert matrices, number of those matrices),
    counted from the published Kimi K2 shapes without the planner or optim.newton_schulz.

    Muon blocks: per attention head for the per-head projections, per expert for stacked experts,
    the whole matrix otherwise. One quintic iteration on an m x n block with s = min(m, n),
    l = max(m, n) (Gram matrix on the short side): X X^T 2 s^2 l, A A 2 s^3, B X 2 s^2 l; 5 iterations.
    """

    def ns(m, n):
        s, l = min(m, n), max(m, n)
        return 5 * (2 * s * s * l + 2 * s**3 + 2 * s * s * l)

    dim, heads, q_rank, kv_rank, nope, rope, v = 7168, 64, 1536, 512, 128, 64, 128
    attention = (
        ns(q_rank, dim)  # wq_a [1536, 7168], whole
        + heads * ns(nope + rope, q_rank)  # wq_b: 64 heads of [192, 1536]
        + ns(kv_rank + rope, dim)  # wkv_a [576, 7168], whole
        + heads * ns(nope + v, kv_rank)  # wkv_b: 64 heads of [256, 512]
        + heads * ns(dim, v)  # wo: 64 heads of [7168, 128] (per-head columns)
    )
    dense_ffn = 3 * ns(18432, dim)  # layer 0: w1, w3 [18432, 7168], w2 [7168, 18432]
    experts_per_layer = 3 * (384 + 1)  # w1, w2, w3 of 384 routed + 1 shared expert, each 2048 x 7168
    moe = ns(384, dim) + experts_per_layer * ns(2048, dim)  # router gate [384, 7168] + experts
    layers, dense_layers = 61, 1
    total = layers * attention + dense_layers * dense_ffn + (layers - dense_layers) * moe
    expert_matrices = (layers - dense_layers) * experts_per_layer
    return total, expert_matrices * ns(2048, dim), expert_matrices


def test_projection_plans_all_kimi_k2_ns_flops_balanced():
    total, expert_flops, expert_matrices = kimi_k2_ns_flops_by_hand()
    assert expert_matrices == 69_300  # 60 MoE layers x 385 experts x 3 matrices of one shape family
    assert expert_flops / total > 0.98  # the experts hold ~98% of the NS work
    # the round figure the optimizer projection started from, "about 48.5 PFLOP" a step; the shapes give 47.7
    assert abs(total / 48.5e15 - 1) < 0.02, total
    assert preset("kimi_k2_1t").n_layers == 61  # the hand count uses the preset's published shapes

    # replica split on: every block is computed exactly once, so the per-rank FLOPs must add up to
    # the total (off, the dense blocks are repeated in each of the 8 replicas and the sum is larger)
    specs, plan = projection.plan_world(preset("kimi_k2_1t"), 64, DEVICES["h200"], replica_split="on")
    assert projection.total_ns_flops(specs) == total
    assert plan.stats.flops.sum() == pytest.approx(total, rel=1e-12)  # float64 sum of ~70k terms
    assert plan.stats.load_ratio <= 1.05
    assert len(plan.stats.flops) == 64 and plan.stats.flops.min() > 0


def _check_baselines(rank, world_size):
    param_set = build_param_set("debug", world_size)
    config = OptimConfig()
    names = ("gather_all", "owner_allgather", "torchtitan", "sharded")
    methods = {n: m for n in names if isinstance(m := build_method(n, param_set, config, 4.0), Method)}
    # negative control: the Moonlight baseline without the per-block lr adjustment is a wrong update
    wrong = OptimConfig(lr_adjust="none")
    methods["wrong"] = build_method("gather_all", param_set, wrong, 4.0)
    reference = build_method("single", param_set, config, 4.0)
    before = harness.full_values(param_set.params)
    bf16 = build_method("single", param_set, OptimConfig(ns_dtype="bfloat16"), 4.0)
    yardstick = harness.bf16_yardstick(build_method("single", param_set, config, 4.0), bf16, before, steps=2)
    return harness.check_against(methods, reference, before, steps=2, yardstick=yardstick), yardstick


def test_baselines_equal_single_process_reference_on_2_ranks():
    checks, yardstick = run_ranks(_check_baselines, 2, timeout=120)[0]
    assert {"gather_all", "owner_allgather", "torchtitan"} <= set(checks), checks
    for name, check in checks.items():
        if name == "wrong":
            assert not check["ok"] and check["max_rel_err"] > 0.3, check
        else:
            assert check["ok"], (name, check)
    # bf16 NS: 3 yardsticks (bf16 reference vs fp32 reference), measured here; a bf16 update is
    # measurably off the fp32 one and the bound stays far below a wrong update's error
    assert checks["gather_all"]["tol"] == 1e-5 and checks["torchtitan"]["tol"] == 3 * yardstick
    assert 1e-3 < yardstick < 0.05 and checks["torchtitan"]["max_rel_err"] > 1e-3, (yardstick, checks)


def _run_main(rank, world_size, argv):
    from benchmarks.optimizer_step import entry

    return entry(rank, world_size, argv)


def test_optimizer_step_main_writes_json_on_2_ranks(tmp_path):
    path = os.path.join(tmp_path, "bench.json")
    argv = ["--shapes", "debug", "--steps", "1", "--warmup", "0", "--check-steps", "1", "--json", path]
    run_ranks(_run_main, 2, argv, as_torchrun=True, timeout=180)
    with open(path) as f:
        result = json.load(f)
    assert result["world_size"] == 2 and result["main_shape_set"] == "debug"
    methods = result["methods"]
    for name in ("gather_all", "owner_allgather", "single"):
        row = methods[name]
        assert row["step_ms"] > 0 and row["check"]["ok"], (name, row)
    # measured FLOPs: gather_all orthogonalizes every block on every rank; owner_allgather splits them
    total = methods["gather_all"]["ns_gflop_per_rank_max"]
    assert methods["gather_all"]["ns_gflop_per_rank_mean"] == pytest.approx(total)
    assert methods["owner_allgather"]["ns_gflop_per_rank_mean"] == pytest.approx(total / 2)
    assert methods["single"]["ns_gflop_per_rank_max"] == pytest.approx(total)
    # measured bytes: gather_all all-gathers every fp32 Muon matrix; each rank sends its half to the
    # other and receives the other half (the debug shapes split evenly over 2 ranks)
    muon_bytes = 4 * sum(n * int(r) * int(c) for rc, n in result["shape_sets"]["debug"]["blocks"].items()
                         for r, c in [rc.split("x")])
    assert methods["gather_all"]["bytes_per_rank_max"] == muon_bytes
    assert methods["single"]["bytes_per_rank_max"] == 0
    for name, row in methods.items():
        assert "step_ms" in row or "skipped" in row, (name, row)
    assert set(result["speedup_vs"]) <= set(methods)
    # host-side proxies: the debug set fits one bucket, so the sharded step issues 2 all-to-alls
    # (there and back); the single-process reference none; every step allocates something
    assert methods["sharded"]["collectives_per_step"] == 2 and methods["single"]["collectives_per_step"] == 0
    assert all(methods[m]["ops_per_step"] > 0 and methods[m]["peak_extra_mb"] > 0 for m in ("sharded", "single"))


def test_counters_count_ops_and_peak_live_memory():
    x = torch.zeros(256, 1024)  # 1 MiB
    with count_step() as counts:
        y = x * 2  # +1 MiB
        z = y + 1  # +1 MiB: peak 2 MiB
        del y  # -1 MiB
        view = z[:10]  # a view: no new storage
        del z  # the view keeps z's storage alive
        w = view * 3  # a small new tensor (40 KiB) while z's storage is alive: peak still 2 MiB
        x.mul_(2)  # in place: nothing new
    assert counts.ops == 5 and counts.collectives == 0
    assert counts.peak_extra_bytes == 2 * 2**20
    assert w.shape == (10, 1024)


def test_counters_count_memory_bytes_of_each_op_by_hand():
    a, b, rows = torch.randn(1000), torch.randn(1000), torch.arange(0, 1000, 2)  # rows: 500 x 8 bytes
    out = torch.empty(1000, dtype=torch.bfloat16)
    cases = [  # (op, bytes read + written, counted by hand)
        (lambda: a.mul_(2), 4000 + 4000),
        (lambda: a + b, 8000 + 4000),
        (lambda: torch._foreach_add_([a, b], [b, a]), 2 * (8000 + 4000)),
        (lambda: torch.add(a, b, alpha=2, out=out), 8000 + 2000),  # out= is written, not read
        (lambda: a.to(torch.bfloat16), 4000 + 2000),
        (lambda: b.index_select(0, rows), 2000 + 4000 + 2000),  # the selected rows, the index, the output
        (lambda: a.index_add_(0, rows, b[:500]), 2000 + 4000 + 2000 + 2000),  # source, index, rows read + written
        (lambda: a.copy_(b), 4000 + 4000),
        (lambda: a.view(10, 100).mT, 0),
        (lambda: torch.empty(1000), 0),
    ]
    for i, (op, expected) in enumerate(cases):
        with count_step() as counts:
            op()
        assert counts.memory_bytes == expected, (i, counts.memory_bytes, expected)


def _elementwise_bytes(rank, world_size):
    """Memory bytes per local Muon element of one sharded-Muon step on kimi_slice, bf16 NS."""
    from optim.sharded.muon import ShardedMuon

    param_set = build_param_set("kimi_slice", world_size)
    params = {fqn: torch.nn.Parameter(p.to_local().clone()) for fqn, p in param_set.params.items()}
    for fqn, p in params.items():
        p.grad = param_set.grads[fqn].to_local().clone()
    opt = ShardedMuon(list(params.items()), param_set.splits, OptimConfig(ns_dtype="bfloat16"), bucket_mb=4.0)
    with count_step() as counts:
        opt.step()
    return counts.memory_bytes / sum(p.numel() for p in params.values()), counts.ns_memory_bytes


def test_projection_elementwise_bytes_are_the_steps_own():
    """The optimizer-step model's ELEMENTWISE_BYTES is what the sharded step moves per element (counted on
    one process; the busiest of 2 ranks measured the same 64.3): it must move with the code."""
    from planning.optimizer_step import ELEMENTWISE_BYTES

    [(per_element, ns_bytes)] = run_ranks(_elementwise_bytes, 1, timeout=180)
    assert abs(per_element - ELEMENTWISE_BYTES) < 0.5, per_element
    assert ns_bytes > 0  # the stack walk sees orthogonalize's own ops (kept out of per_element)


def test_ns_kernels_rows_side_by_side():
    from benchmarks import ns_kernels

    out = ns_kernels.main(["--sets", "debug", "--dtypes", "float32", "--repeats", "1"])
    rows = out["rows"]
    shapes = {tuple(r["shape"]) for r in rows}
    assert len(rows) == 3 * len(shapes) and {r["method"] for r in rows} == set(ns_kernels.METHODS)
    for shape in shapes:
        by = {r["method"]: r for r in rows if tuple(r["shape"]) == shape}
        assert by["standard"]["ms"] > 0 and by["gram"]["gflops"] > 0 and by["bmm"]["polar_err"] is None
        if max(shape) <= 2 * min(shape):  # the same standard code runs for both: identical output
            assert by["gram"]["polar_err"] == by["standard"]["polar_err"]
        assert 0 < by["gram"]["polar_err"] <= 1.1 * by["standard"]["polar_err"]
    assert [s["set"] for s in out["summary"]] == ["debug"]
