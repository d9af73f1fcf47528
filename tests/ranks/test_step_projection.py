"""The whole-step projection's bytes against bytes counted on real 8-rank CPU runs.

Each case runs the runtime's forward/backward (runtime/train.py: FSDP2 on both meshes, EP
all-to-alls, CP all-gathers) under benchmarks/lib/counters.py's collective counter, bucketed by
collective, and compares each rank's bytes with benchmarks/step_projection.py for the same job and
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
import torch.distributed as dist
from torch.distributed import distributed_c10d

from benchmarks import step_projection
from benchmarks.lib import counters, fsdp_traffic
from benchmarks.lib.device_model import device_model
from benchmarks.step_projection import compute_rates, parse_args, peers, project_layout
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
KINDS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_": "reduce_scatter", "allreduce_": "all_reduce", "alltoall_base_": "all_to_all"}
EP_RTOL = 0.10


def _argv(name):
    (dr, ds, cp), (er, es, ep), extra = CASES[name]
    return ARGS + extra + [f"--parallel.dp_replicate={dr}", f"--parallel.dp_shard={ds}", f"--parallel.cp={cp}",
                           f"--parallel.edp_replicate={er}", f"--parallel.edp_shard={es}", f"--parallel.ep={ep}"]


class _ByKind(counters._CommCounter):
    """Bytes sent per kind of collective, and per (kind, "intra" | "inter") by the peer's node: an
    all-to-all's rows go to the peer they are split for; every other collective sends each peer an
    equal share (all-gather: the shard; reduce-scatter: the peer's chunk; all-reduce as reduce-scatter
    plus all-gather, the convention of counters.py and of the projection)."""

    def __init__(self):
        super().__init__(counters.StepCounts())
        self.sent = collections.Counter()
        self.group = None

    def _collective(self, func, args):
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
        if func.namespace == "c10d" and boxed:
            self.group = dist.ProcessGroup.unbox(boxed[0])
        elif func.namespace == "_c10d_functional":
            self.group = distributed_c10d._resolve_process_group(args[-1])
        self.args = args
        super()._collective(func, args)

    def _add(self, name, sent_received):
        super()._add(name, sent_received)
        if not sent_received:
            return
        kind, sent = KINDS.get(name, name), int(sent_received[0])
        self.sent[kind] += sent
        ranks, me = dist.get_process_group_ranks(self.group), dist.get_rank()
        share = _peer_shares(kind, self.args, ranks.index(me), len(ranks))
        for rank, fraction in zip(ranks, share):
            self.sent[kind, "intra" if rank // NODE == me // NODE else "inter"] += sent * fraction


def _peer_shares(kind, args, me, size):
    """Fraction of this rank's sent bytes that goes to each group member (0 to itself)."""
    if kind == "all_to_all":  # alltoall_base_(output, input, group, output_splits, input_splits)
        rows = list(args[4]) or [args[1].shape[0] // size] * size
        rows[me] = 0
        return [r / max(1, sum(rows)) for r in rows]
    return [0.0 if i == me else 1 / max(1, size - 1) for i in range(size)]


def _count(job, world):
    layout = job.layout(world)
    meshes = build_meshes(layout, "cpu")
    model = T.build_model(job, meshes, layout, torch.device("cpu"))
    loader = T.build_loader(job, meshes, layout)
    counter = _ByKind()
    with counter:
        T.forward_backward(model, loader.next_step(), job.data.tokens_per_step(), torch.device("cpu"),
                           job.training.grad_sync)
    return dict(counter.sent), counter.counts.uncounted


def _run_all(rank, world):
    return {name: _count(load_config(_argv(name)), world) for name in CASES}


def _predicted(name, link=None) -> dict:
    """Projected bytes per kind: intra + inter node, or only `link` ("intra" | "inter")."""
    job = load_config(_argv(name))
    device = device_model("h200")
    row = project_layout(job, job.layout(8), device, compute_rates(device, None), parse_args(["--config", "-"]),
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
    for module in (step_projection, fsdp_traffic):  # the EP placement and the FSDP network model
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
                               parse_args(["--config", "-"]), optimizer=False)


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
    from benchmarks.lib.block_flops import block_parts
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

    from benchmarks.lib.ep_projection import degrees_only, dispatch_knobs, dispatch_variants

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


def test_memory_estimate_recommends_the_fastest_row_that_fits_by_it(monkeypatch, capsys):
    """--memory-estimate walks the rows in order of step time through launch/estimate_memory.py and stops at
    the first that fits: with the two fastest refused, the third is recommended and no fourth is estimated."""
    import launch.estimate_memory as estimate_memory
    from benchmarks.step_projection import main

    estimated = []

    def fake_estimate(job):
        estimated.append(job.layout)
        return {"total_gib": 150.0 - len(estimated), "fits": len(estimated) > 2}

    monkeypatch.setattr(estimate_memory, "estimate", fake_estimate)
    rows = main(["--config", "configs/debug.toml", "--world", "8", "--memory-estimate"])["rows"]
    by_time = sorted(rows, key=lambda r: r["time_s"]["step"])
    assert len(estimated) == 3 and [r.get("estimate_fits") for r in by_time[:4]] == [False, False, True, None]
    assert [r.get("recommended", False) for r in by_time[:3]] == [False, False, True]
    assert sum(1 for r in rows if r.get("recommended")) == 1
    with pytest.raises(SystemExit) as stop:
        main(["--config", "configs/debug.toml", "--world", "8", "--memory-estimate", "--device", "b200"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith("launch/estimate_memory.py knows h100 and h200, not --device b200")
