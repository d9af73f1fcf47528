"""The whole-step projection's bytes against bytes counted on real 8-rank CPU runs.

Each case runs the runtime's forward/backward (runtime/train.py: FSDP2 on both meshes, EP
all-to-alls, CP all-gathers) under planning/recording.py's collective recorder, bucketed by
collective, and compares each rank's bytes with planning/dual_mesh.py's projection for the same job and
layout. FSDP and CP bytes depend only on shapes and should match to the byte; EP bytes depend on
where the router sends tokens (the projection assumes uniform routing), hence the 10% tolerance
(measured deviation on these cases: under 5% in total, under 7% per link: 69,696 counted against
65,536 projected intra-node bytes per rank on hsdp2x4_experts2x2x2).

The 8 ranks also stand for two nodes of NODE = 4 GPUs: every counted byte is split by whether its
peer's rank is on this rank's node (rank // NODE), and compared with the projection's intra- and
inter-node bytes for nodes of NODE GPUs. That split is what the expert mesh's numbering
(parallel.expert_inner) changes, so the cases cover both numberings.
"""

import collections

import pytest
import torch

from planning import dual_mesh, fsdp_traffic
from planning.devices import device_model
from planning.dual_mesh import Options, compute_rates, project_layout
from planning.fsdp_traffic import peers
from planning.recording import record_collectives
from multirank import run_ranks
from parallel.meshes import build_meshes
from runtime import train as T
from runtime.config_parser import load_config

ARGS = ["--data.seq_len=32", "--data.batch_size=8", "--checkpoint.interval=0"]
CASES = {  # dp_replicate, dp_shard, cp | edp_replicate, edp_shard, ep, and other overrides
    "hsdp2x4_experts2x2x2": ((2, 4, 1), (2, 2, 2), []),
    "cp2_ep8": ((1, 4, 2), (1, 1, 8), []),
    "cp4_gqa": ((1, 2, 4), (1, 1, 8), ["--model.preset=debug_gqa"]),  # CP gathers the kv heads
    "experts_on_a_matrix_dim": ((1, 8, 1), (1, 4, 2), ["--model.n_routed_experts=4"]),
    "hsdp_replicas_last_accum2": ((2, 4, 1), (2, 2, 2), ["--training.grad_accum=2", "--data.batch_size=16",
                                                         "--training.grad_sync=replicas_last"]),
    # expert FSDP pairs on consecutive ranks [0 1] [2 3] ..., ep [0 2 4 6] [1 3 5 7] across both nodes
    "experts_2x4_edp_shard_inner": ((1, 8, 1), (1, 2, 4), ["--parallel.expert_inner=edp_shard"]),
    "experts_2x4_ep_inner": ((1, 8, 1), (1, 2, 4), []),  # the same degrees, ep [0..3] [4..7] on one node each
    "hsdp_experts_edp_shard_inner": ((2, 4, 1), (2, 2, 2), ["--parallel.expert_inner=edp_shard"]),
}
NODE = 4  # GPUs per node the 8 CPU ranks stand for
EP_RTOL = 0.10


def _argv(name):
    (dr, ds, cp), (er, es, ep), extra = CASES[name]
    return ARGS + extra + [f"--parallel.dp_replicate={dr}", f"--parallel.dp_shard={ds}", f"--parallel.cp={cp}",
                           f"--parallel.edp_replicate={er}", f"--parallel.edp_shard={es}", f"--parallel.ep={ep}"]


def _count(job, world):
    layout = job.layout(world)
    meshes = build_meshes(layout, "cpu")
    model = T.build_model(job, meshes, layout, torch.device("cpu"))
    loader = T.build_loader(job, meshes, layout)
    with record_collectives() as calls:
        T.forward_backward(model, loader.next_step(), job.data.tokens_per_step(), torch.device("cpu"),
                           job.training.grad_sync)
    sent = collections.Counter()  # bytes sent per kind, and per (kind, "intra" | "inter") by the peer's node
    for call in calls:
        if call.to_peer is not None:
            sent[call.kind] += call.sent
            for link, n in zip(("intra", "inter"), call.links(NODE)):
                sent[call.kind, link] += n
    return dict(sent), [call.op for call in calls if call.to_peer is None]


def _run_all(rank, world):
    return {name: _count(load_config(_argv(name)), world) for name in CASES}


def _predicted(name, link=None) -> dict:
    """Projected bytes per kind: intra + inter node, or only `link` ("intra" | "inter")."""
    job = load_config(_argv(name))
    device = device_model("h200")
    row = project_layout(job, job.layout(8), device, compute_rates(device, None), Options(),
                         optimizer=False)
    links = ("intra", "inter") if link is None else (link,)
    gb = lambda d: sum(d[f"{k}_gb"] for k in links) * 1e9  # noqa: E731
    fsdp, cp = row["fsdp"], row["cp_parts"]
    # K/V: all-gathered forward, gradients reduce-scattered backward (equal bytes); positions: forward
    return {"all_gather": sum(gb(fsdp[m]["all_gather"]) for m in fsdp) + gb(cp["kv"]) / 2 + gb(cp["positions"]),
            "reduce_scatter": sum(gb(fsdp[m]["reduce_scatter"]) for m in fsdp) + gb(cp["kv"]) / 2,
            "all_reduce": sum(gb(fsdp[m]["all_reduce"]) for m in fsdp), "all_to_all": gb(row["ep"])}


@pytest.fixture(scope="module")
def counted():
    return run_ranks(_run_all, 8, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_projected_bytes_match_counted_bytes(counted, name):
    want = _predicted(name)
    for rank, by_case in enumerate(counted):
        got, uncounted = by_case[name]
        assert uncounted == []
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert got.get(kind, 0) == pytest.approx(want[kind], rel=1e-9, abs=64), (rank, kind)
    # EP: the mean over ranks (routing moves bytes between ranks, not the total); counts exchange included
    mean_a2a = sum(r[name][0].get("all_to_all", 0) for r in counted) / len(counted)
    assert mean_a2a == pytest.approx(want["all_to_all"], rel=EP_RTOL)
    if CASES[name][1][2] > 1:
        assert mean_a2a > 0


@pytest.mark.parametrize("name", list(CASES))
def test_projected_bytes_per_link_match_counted_bytes(counted, name, monkeypatch):
    """The same bytes split into intra- and inter-node for nodes of NODE ranks."""
    for module in (dual_mesh, fsdp_traffic):  # the EP placement and the FSDP network model
        monkeypatch.setattr(module, "GPUS_PER_NODE", NODE)
    for link in ("intra", "inter"):
        want = _predicted(name, link)
        for rank, by_case in enumerate(counted):
            got = by_case[name][0]
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                assert got.get((kind, link), 0) == pytest.approx(want[kind], rel=1e-9, abs=64), (rank, kind, link)
        mean_a2a = sum(r[name][0].get(("all_to_all", link), 0) for r in counted) / len(counted)
        assert mean_a2a == pytest.approx(want["all_to_all"], rel=EP_RTOL, abs=64), link


def test_the_expert_numbering_moves_expert_fsdp_bytes_onto_the_node(counted):
    """Counted, not projected: the same degrees (edp_shard=2 x ep=4) numbered the two ways. With ep
    innermost every ep group is one node and every expert FSDP pair spans both; with edp_shard innermost
    the pairs are on one node and half of each ep group's peers are elsewhere."""
    ep_inner, shard_inner = counted[0]["experts_2x4_ep_inner"][0], counted[0]["experts_2x4_edp_shard_inner"][0]
    assert ep_inner.get(("all_to_all", "inter"), 0) == 0 < shard_inner[("all_to_all", "inter")]
    for kind in ("all_gather", "reduce_scatter"):  # the dense dp_shard=8 part spans both nodes in both
        assert shard_inner[kind, "inter"] < ep_inner[kind, "inter"]
        assert shard_inner[kind] == ep_inner[kind]  # the totals do not depend on the numbering


def test_peers_against_an_explicit_rank_map():
    """Outside reference: enumerate the group's ranks and their nodes by hand."""
    for size, stride in [(8, 1), (4, 8), (32, 8), (16, 1), (2, 4), (1, 1)]:
        ranks = [i * stride for i in range(size)]
        same = sum(1 for r in ranks[1:] if r // 8 == 0)
        assert peers(size, stride) == (same, size - 1 - same)
    assert peers(32, 8) == (0, 31) and peers(16, 1) == (7, 8)


def test_command_line_on_the_debug_config(tmp_path):
    from benchmarks.step_projection import main

    out = main(["--config", "configs/debug.toml", "--world", "8", "--json", str(tmp_path / "p.json")])
    row, *variants = out["rows"]  # the config's own dispatch, then the other combinations (parallel/ep/plan.py)
    assert row["layout"] == "dense 1x4x2 | experts 1x1x8" and row["name"] == "config"
    assert row["host_syncs"] == 1 + 2  # the step's readback + 2 MoE layers x 1 micro-batch under ep=8
    assert row["time_s"]["step"] > 0 and 0 < row["mfu"] < 1 and row["fits"]
    syncs = {r["name"]: r["host_syncs"] for r in variants}
    assert syncs["config+dedup"] == 1 + 2 * 2 and syncs["config+capacity1.25"] == 1 and syncs["config+overlap2"] == 3
    assert sum(1 for r in out["rows"] if r.get("recommended")) == 1


def _debug_row(checkpointing="none", rates=None, **knobs):
    """The projection of debug_gqa on 8 ranks (dense 4 x cp 2, ep 8), `knobs` replacing layout fields."""
    import dataclasses

    job = load_config(ARGS + ["--model.preset=debug_gqa", f"--training.activation_checkpoint={checkpointing}"])
    device = device_model("h200")
    layout = dataclasses.replace(job.layout(8), **knobs)
    return job, project_layout(job, layout, device, rates or compute_rates(device, None),
                               Options(), optimizer=False)


def test_checkpointing_adds_the_recomputed_forward_to_the_compute():
    """Hardware FLOPs: "full" reruns every block's forward in backward (2 per active parameter, the SDPA's
    S (qk + v) per head: 1/3 of 6N and of the attention term), not the embedding or output head;
    "selective" the attention (projections + SDPA) and the routed experts. Counted here from debug_gqa's
    shapes, each kind at its own rate; MFU stays model FLOPs / (step x peak)."""
    rates = {"matmul_bf16": 3e14, "grouped_mm_bf16": 2e14, "attention_bf16": 1e14}
    job, none = _debug_row("none", rates)
    c, S = job.model, job.data.seq_len
    attention = 2 * c.dim * c.n_heads * c.head_dim + 2 * c.dim * c.n_kv_heads * c.head_dim  # wq wo, wk wv
    sdpa = c.n_heads * S * 2 * c.head_dim
    moe_layers = c.n_layers - c.n_dense_layers
    routed = moe_layers * 2 * c.n_activated_experts * 3 * c.dim * c.moe_inter_dim
    others = 2 * (c.n_dense_layers * 3 * c.dim * c.inter_dim + c.n_layers * 2 * c.dim  # dense FFN, norms
                  + moe_layers * (c.dim * c.n_routed_experts + c.n_shared_experts * 3 * c.dim * c.moe_inter_dim))
    per_rank = job.data.tokens_per_step() / 8
    want = {"selective": (c.n_layers * 2 * attention / rates["matmul_bf16"] + routed / rates["grouped_mm_bf16"]
                          + c.n_layers * sdpa / rates["attention_bf16"]) * per_rank}
    want["full"] = want["selective"] + others / rates["matmul_bf16"] * per_rank
    assert none["time_s"]["recompute"] == 0
    for mode in ("selective", "full"):
        _, row = _debug_row(mode, rates)
        assert row["time_s"]["compute"] - none["time_s"]["compute"] == pytest.approx(want[mode], rel=1e-12)
        assert row["time_s"]["recompute"] == pytest.approx(want[mode], rel=1e-12)
        assert row["model_tflop_per_gpu"] == none["model_tflop_per_gpu"] < row["hardware_tflop_per_gpu"]
        assert row["mfu"] == pytest.approx(row["model_tflop_per_gpu"] * 1e12 / (row["time_s"]["step"] * 989e12))


def test_blocks_forward_is_a_third_of_the_model_flops_without_the_head():
    from planning.flops import block_parts
    from models.presets import PRESETS
    from runtime.metrics import flops_per_token

    for name, seq in [("debug", 128), ("debug_gqa", 32), ("kimi_k2_1t", 4096)]:
        c = PRESETS[name]
        blocks = sum(sum(parts.values()) for parts in block_parts(c, seq))
        assert 3 * blocks + 6 * (c.vocab_size * c.dim + c.dim) == flops_per_token(c, seq)  # + output head, norm


def test_dispatch_variants_are_the_runtime_s_combinations():
    """Every row variant is a combination of the dispatch knobs the runtime implements: direct, FP8, pieces,
    node dedup and fixed capacity, FP8 ones also with an FP8 combine gradient, and under checkpointing each
    also with ep_recompute = "keep"; each variant sets exactly the knobs its name says."""
    import dataclasses

    from planning.ep_traffic import degrees_only, dispatch_knobs, dispatch_variants

    layout = dataclasses.replace(load_config(ARGS).layout(8), ep=8, edp_shard=1)
    base = ["direct", "fp8", "overlap2", "overlap2_fp8", "dedup", "dedup_overlap2", "dedup_fp8", "dedup_overlap2_fp8",
            "capacity1.25", "capacity1.25_fp8"]
    base += [f"{name}_fp8g" for name in base if "fp8" in name]
    assert list(dispatch_variants(layout, "none")) == base
    assert list(dispatch_variants(layout, "full")) == base + [f"{name}_keep" for name in base]
    default = dispatch_knobs(degrees_only(layout))
    for name, lay in dispatch_variants(layout, "selective").items():
        changed = {k for k, v in dispatch_knobs(lay).items() if v != default[k]}
        said = {"ep_dedup": "dedup" in name, "ep_overlap_chunks": "overlap2" in name,
                "ep_capacity_factor": "capacity" in name, "ep_dispatch_dtype": "_fp8" in f"_{name}",
                "ep_combine_grad_dtype": "fp8g" in name, "ep_recompute": "keep" in name}
        assert changed == {k for k, on in said.items() if on}, name
    assert dispatch_variants(dataclasses.replace(layout, ep=1, edp_shard=8), "full") == {}


def test_memory_estimate_recommends_the_fastest_row_that_fits_by_it(monkeypatch):
    """--memory-estimate walks the rows in order of step time through the memory estimate
    (planning/memory/pretrain.py) and stops at the first that fits: with the two fastest refused, the third is
    recommended and no fourth is estimated."""
    from benchmarks.step_projection import main
    from planning.memory import pretrain

    estimated = []

    def fake_estimate(job):
        estimated.append(job.layout)
        return {"total_gib": 150.0 - len(estimated), "fits": len(estimated) > 2}

    monkeypatch.setattr(pretrain, "estimate", fake_estimate)
    rows = main(["--config", "configs/debug.toml", "--world", "8", "--memory-estimate"])["rows"]
    by_time = sorted(rows, key=lambda r: r["time_s"]["step"])
    assert len(estimated) == 3 and [r.get("estimate_fits") for r in by_time[:4]] == [False, False, True, None]
    assert [r.get("recommended", False) for r in by_time[:3]] == [False, False, True]
    assert sum(1 for r in rows if r.get("recommended")) == 1


def test_no_row_is_recommended_when_none_fits(capsys):
    """When every row fails to fit (here the debug job against 1 KiB of memory), none is marked recommended and the
    line says so (a row that does not fit was recommended before)."""
    from benchmarks.step_projection import main

    rows = main(["--config", "configs/debug.toml", "--world", "8", "--memory-gib", str(2**-20)])["rows"]
    assert rows and not any(r["fits"] or r.get("recommended") for r in rows)
    assert "recommended at 8 GPUs: none: no row fits" in capsys.readouterr().out


# (arguments, the phrase of the one line): each named the wrong thing, raised, or was accepted before
FLAG_MISTAKES = {
    "world_zero": (["--config", "configs/debug.toml", "--world", "0"], "--world 0: must be >= 1"),
    "compare_on_an_inferred_layout": (["--config", "configs/debug.toml", "--compare", "16"],
                                      "--compare: the config infers a degree"),
    "compare_not_numbers": (["--config", "configs/debug.toml", "--world", "8", "--compare", "0,abc"],
                            "--compare 0,abc: expected comma-separated world sizes"),
    "compare_negative": (["--config", "configs/debug.toml", "--world", "8", "--compare", "-256"],
                         "--compare -256: world sizes must be >= 1 (got -256)"),
    "compare_beyond_any_layout": (["--config", "configs/kimi_k2_256gpu.toml", "--compare", "1048576"],
                                  "--compare 1048576: no candidate layout at 1048576 GPUs"),
    "compare_without_candidates": (["--config", "configs/debug.toml", "--world", "2", "--compare", "4"],
                                   "--compare 4: no candidate layout at 4 GPUs"),
    "memory_negative": (["--config", "configs/debug.toml", "--world", "8", "--memory-gib", "-5"],
                        "--memory-gib -5.0: must be a finite number of GiB > 0"),
    "memory_nan": (["--config", "configs/debug.toml", "--world", "8", "--memory-gib", "nan"],
                   "--memory-gib nan: must be a finite number of GiB > 0"),
    "calibration_not_json": (["--config", "configs/debug.toml", "--world", "8", "--calibration", "{tmp}/garbage.json"],
                             "not JSON"),
    "calibration_without_the_keys": (["--config", "configs/debug.toml", "--world", "8", "--calibration",
                                      "{tmp}/empty.json"], "the calibration benchmarks/gpu_check.py writes"),
}


@pytest.mark.parametrize("case", list(FLAG_MISTAKES))
def test_step_projection_mistakes_are_one_line_exit_2_naming_the_flag(case, tmp_path, capsys):
    from benchmarks.step_projection import main

    (tmp_path / "garbage.json").write_text("not json at all")
    (tmp_path / "empty.json").write_text("{}")
    argv, phrase = FLAG_MISTAKES[case]
    with pytest.raises(SystemExit) as stop:
        main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert phrase in err, err
