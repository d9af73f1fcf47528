"""launch/dry_run.py at W = 64 on the debug model (fake process group, one forked process): the groups of
the layout, this rank's state bytes equal to launch/estimate_memory.py's to the byte (the real
parallelized model and optimizer against the estimator's own placement model), the step's collectives
on the meshes they belong to, and a broken layout failing with the launch's own line."""

import json
import os

import pytest
import torch

from dry_run_cases import ARGS, CONFIG, STEP, _dry_run
from launch import pretrain  # imported once here, not in each forked process
from multirank import run_ranks


def _pretrain(rank, world_size, argv, world):
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world), "0"
    return pretrain.main(argv)


@pytest.fixture(scope="module")
def ranks_0_and_63(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry") / "dry.json"
    run_ranks(_dry_run, 1, [*ARGS, *STEP, "--ranks", "0,63", "--json", str(out)], timeout=300, as_torchrun=True)
    return json.load(open(out))


def test_groups_and_states_equal_the_estimate_to_the_byte(ranks_0_and_63):
    for r in ranks_0_and_63:
        assert r["world"] == 64
        sizes = {name.split(" = ")[0]: size for name, size in r["groups"].items()}
        assert sizes["dense.dp_shard"] == 64 and sizes["expert.ep"] == 8 and sizes["expert.edp_shard"] == 8
        mine, estimate = r["states_bytes"], r["estimate"]["states_bytes"]
        for key in ("params", "grads", "optimizer"):
            assert mine["dense"][key] + mine["expert"][key] == estimate[key], (r["rank"], key)
        assert r["states_total_bytes"] == r["estimate"]["states_total_bytes"] > 0
        assert mine["host_bytes"] > 0  # AdamW's step counters: host memory, outside the estimate
        assert r["planner_s"] >= 0 and r["peak_memory_bytes"] > 0
    first, last = ranks_0_and_63
    assert first["states_bytes"] != last["states_bytes"] or first["rank"] != last["rank"]


def test_the_step_counts_collectives_on_their_meshes(ranks_0_and_63):
    rows = {(c["kind"], c["mesh"].split(" = ")[0], c["source"]): c for c in ranks_0_and_63[0]["collectives"]}
    assert rows[("all_to_all", "expert.ep", "ep")]["bytes"] > 0  # EP dispatch/combine, symmetric counts
    assert rows[("all_gather", "dense.dp_shard", "fsdp")]["count"] > 0  # FSDP, dense mesh
    assert rows[("all_gather", "expert.edp_shard", "fsdp")]["count"] > 0  # FSDP, expert mesh
    assert rows[("reduce_scatter", "expert.edp_shard", "fsdp")]["bytes"] > 0
    assert rows[("all_to_all", "dense.dp_shard", "optimizer")]["count"] > 0  # sharded Muon's exchange
    assert ranks_0_and_63[0]["step_dispatch"].startswith("direct, unpipelined (parallel.ep_overlap_chunks")


def test_counted_bytes_on_the_wire_equal_the_projections_terms(ranks_0_and_63):
    """The FSDP terms (benchmarks/step_projection.py fsdp_traffic) and the per-layer EP term
    (planning/ep_traffic.py layer_link_bytes on the step's routing) equal the bytes the step's
    collectives put on the wire, in-node and across nodes, to the byte."""
    for r in ranks_0_and_63:
        terms = {(c["source"], c["kind"], c["mesh"].split(" = ")[0]): c for c in r["projection_comparison"]}
        for key in [("fsdp", "all_gather", "dense.dp_shard"), ("fsdp", "reduce_scatter", "dense.dp_shard"),
                    ("fsdp", "all_gather", "expert.edp_shard"), ("fsdp", "reduce_scatter", "expert.edp_shard"),
                    ("ep", "all_to_all", "expert.ep")]:
            term = terms[key]
            assert term["counted"] == term["projected"] and term["equal"], (r["rank"], key, term)
            assert sum(term["counted"]) > 0, key
        assert terms[("ep", "all_to_all", "expert.ep")]["counted"][1] > 0  # the ep group spans nodes
        assert terms[("fsdp", "all_gather", "expert.edp_shard")]["counted"][0] > 0  # edp_shard inside a node
        assert all(c["equal"] for c in r["projection_comparison"])


def test_wire_bytes_follow_the_counters_convention():
    """planning/wire.py on a 4-rank group split over two nodes of 2, rank 1 (its node: ranks 0 and 1), against
    the convention written out by hand (bytes sent, self excluded): an all-gather sends its 24-byte shard to each
    of 3 peers, a reduce-scatter each peer's quarter of 96 bytes, an all-reduce 2 x 96 / 4 to each, an
    all-to-all each peer's rows (splits 3, 0, 2, 5 of 24-byte rows; its own 0 stays)."""
    from planning.wire import wire_bytes

    splits = [3, 0, 2, 5]
    passed = {"all_gather": 24, "reduce_scatter": 96, "all_reduce": 96, "all_to_all": sum(splits) * 24}
    expected = {"all_gather": (24, 48), "reduce_scatter": (24, 48), "all_reduce": (48, 96), "all_to_all": (72, 168)}
    for kind, want in expected.items():
        split_bytes = [s * 24 for s in splits] if kind == "all_to_all" else None
        assert wire_bytes(kind, passed[kind], [0, 1, 2, 3], 1, 2, split_bytes) == want, kind


def test_a_broken_layout_fails_with_the_launchs_line(tmp_path, capfd):
    bad = ["--parallel.ep=3"]  # 3 does not divide 8 experts nor 64 ranks
    assert run_ranks(_dry_run, 1, [*ARGS, *bad], timeout=300, as_torchrun=True) == [2]
    dry = capfd.readouterr().err.strip().splitlines()
    argv = ["--config", CONFIG, "--data.batch_size=64", *bad, f"--run.dir={tmp_path}/run"]
    assert run_ranks(_pretrain, 1, argv, 64, timeout=300, as_torchrun=True) == [2]
    launch = capfd.readouterr().err.strip().splitlines()
    assert len(dry) == 1 and dry == launch and dry[0].startswith("config error: "), (dry, launch)


def test_bf16_matmuls_run_in_fp32_and_come_back_in_bf16():
    """The dry run's matmuls of bf16 CPU tensors (launch/dry_run_bytes.py `fp32_matmul`): fp32 products rounded
    once to bf16, against the bf16 kernel within one bf16 rounding of the output; grouped ones too."""
    from launch.dry_run_bytes import CollectiveLog

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g).bfloat16(), torch.randn(64, 32, generator=g).bfloat16()
    w = torch.randn(2, 64, 32, generator=g).bfloat16()
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with CollectiveLog({}, 8):
        got = {"mm": torch.mm(a, b), "grouped": torch._grouped_mm(a, w, offs=offs)}
    want = {"mm": torch.mm(a, b), "grouped": torch._grouped_mm(a, w, offs=offs)}  # the bf16 kernels
    exact = {"mm": a.float() @ b.float(),
             "grouped": torch.cat([a[:8].float() @ w[0].float(), a[8:].float() @ w[1].float()])}
    for k in got:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], exact[k].bfloat16()), k
        # one bf16 rounding (2^-7 relative at most) + fp32 sums of 64 products in another order (< 1e-3 here)
        assert torch.allclose(got[k].float(), want[k].float(), rtol=2 ** -7, atol=1e-3), k
