"""The whole-step projection's bytes against bytes counted on real 8-rank CPU runs.

Each case runs the runtime's forward/backward (runtime/train.py: FSDP2 on both meshes, EP
all-to-alls, CP all-gathers) under benchmarks/counters.py's collective counter, bucketed by
collective, and compares each rank's bytes with benchmarks/step_projection.py for the same job and
layout. FSDP and CP bytes depend only on shapes and should match to the byte; EP bytes depend on
where the router sends tokens (the projection assumes uniform routing), hence the 10% tolerance
(measured deviation on these cases: under 5%).
"""

import collections

import pytest
import torch

from benchmarks import counters
from benchmarks.device_model import device_model
from benchmarks.step_projection import compute_rates, parse_args, peers, project_layout
from multirank import run_ranks
from parallel.meshes import build_meshes
from runtime import train as T
from runtime.config import load_config

ARGS = ["--data.seq_len=32", "--data.batch_size=8", "--checkpoint.interval=0"]
CASES = {  # dp_replicate, dp_shard, cp | edp_replicate, edp_shard, ep, and other overrides
    "hsdp2x4_experts2x2x2": ((2, 4, 1), (2, 2, 2), []),
    "cp2_ep8": ((1, 4, 2), (1, 1, 8), []),
    "cp4_gqa": ((1, 2, 4), (1, 1, 8), ["--model.preset=debug_gqa"]),  # CP gathers the kv heads
    "experts_on_a_matrix_dim": ((1, 8, 1), (1, 4, 2), ["--model.n_routed_experts=4"]),
    "hsdp_replicas_last_accum2": ((2, 4, 1), (2, 2, 2), ["--training.grad_accum=2", "--data.batch_size=16",
                                                         "--training.grad_sync=replicas_last"]),
}
KINDS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_": "reduce_scatter", "allreduce_": "all_reduce", "alltoall_base_": "all_to_all"}
EP_RTOL = 0.10


def _argv(name):
    (dr, ds, cp), (er, es, ep), extra = CASES[name]
    return ARGS + extra + [f"--parallel.dp_replicate={dr}", f"--parallel.dp_shard={ds}", f"--parallel.cp={cp}",
                           f"--parallel.edp_replicate={er}", f"--parallel.edp_shard={es}", f"--parallel.ep={ep}"]


class _ByKind(counters._CommCounter):
    def __init__(self):
        super().__init__(counters.StepCounts())
        self.sent = collections.Counter()

    def _add(self, name, sent_received):
        super()._add(name, sent_received)
        self.sent[KINDS.get(name, name)] += int(sent_received[0]) if sent_received else 0


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


def _predicted(name) -> dict:
    job = load_config(_argv(name))
    device = device_model("h200")
    row = project_layout(job, job.layout(8), device, compute_rates(device, None), parse_args(["--config", "-"]),
                         optimizer=False)
    gb = lambda d: (d["intra_gb"] + d["inter_gb"]) * 1e9  # noqa: E731
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
    (row,) = out["rows"]
    assert row["layout"] == "dense 1x4x2 | experts 1x1x8"
    assert row["host_syncs"] == 1 + 2  # the step's readback + 2 MoE layers x 1 micro-batch under ep=8
    assert row["time_s"]["step"] > 0 and 0 < row["mfu"] < 1 and row["fits"]
