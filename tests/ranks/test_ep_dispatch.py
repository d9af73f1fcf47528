"""EP dispatch at scale: the dispatch plan (parallel/ep/plan.py) against plain loops, and hand-picked dispatch
cases beyond tests/ranks/test_ep_grid.py's grid (no checkpointing, selective checkpointing, the folded HSDP layout,
dropping capacity, FP8 dispatch and FP8 combine gradient each alone) on 8 gloo ranks in two simulated nodes
(parallel.ranks_per_node=4) against the single-process step, with every all-to-all byte counted
(planning/recording.py) and compared with the plan. Shared fixtures and tolerances: tests/helpers/ep_cases.py.
"""

import itertools

import pytest
import torch

from ep_cases import (FOLDED, HEADLINE, MODEL, NORM_RTOL, RPN, SEQ, WORLD, assert_matches_single_process,
                      build_model, planned_bytes, reference_step, run_case)
from models import preset
from multirank import run_ranks
from parallel.ep.plan import Placement, capacity_slots, distinct_nodes_per_token, layer_traffic
from parallel.gradients import global_loss, loss_fn
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize

CASES = {f"{name}_{knob}": ParallelConfig(**layout, **extra)
         for (name, layout), (knob, extra) in itertools.product(
             (("headline", HEADLINE), ("folded", FOLDED)),
             (("direct", {}), ("dedup", {"ep_dedup": True}), ("capacity", {"ep_capacity_factor": 8.0})))}
CASES["headline_dropping"] = ParallelConfig(**HEADLINE, ep_capacity_factor=0.5)
CASES["headline_overlap"] = ParallelConfig(**HEADLINE, ep_overlap_chunks=2)
CASES["folded_overlap"] = ParallelConfig(**FOLDED, ep_overlap_chunks=3)
CASES["headline_dedup_overlap"] = ParallelConfig(**HEADLINE, ep_dedup=True, ep_overlap_chunks=2)
CASES["folded_dedup_overlap"] = ParallelConfig(**FOLDED, ep_dedup=True, ep_overlap_chunks=2)
CASES["headline_fp8"] = ParallelConfig(**HEADLINE, ep_dispatch_dtype="float8_e4m3")
CASES["headline_overlap_fp8"] = ParallelConfig(**HEADLINE, ep_overlap_chunks=2, ep_dispatch_dtype="float8_e4m3")
CASES["folded_dedup_overlap_fp8"] = ParallelConfig(**FOLDED, ep_dedup=True, ep_overlap_chunks=2,
                                                   ep_dispatch_dtype="float8_e4m3")
CASES["folded_dedup_fp8"] = ParallelConfig(**FOLDED, ep_dedup=True, ep_dispatch_dtype="float8_e4m3")
CASES["folded_dedup_full_keep"] = ParallelConfig(**FOLDED, ep_dedup=True, ep_recompute="keep")
CASES["headline_overlap_selective_keep"] = ParallelConfig(**HEADLINE, ep_overlap_chunks=2, ep_recompute="keep")
CASES["headline_dedup_overlap_selective_resend"] = ParallelConfig(**HEADLINE, ep_dedup=True, ep_overlap_chunks=2)
CASES["folded_dedup_fp8_full_keep"] = ParallelConfig(**FOLDED, ep_dedup=True, ep_dispatch_dtype="float8_e4m3",
                                                     ep_recompute="keep")
FP8G = {"ep_combine_grad_dtype": "float8_e4m3"}  # the combine's gradient as FP8 rows (twin: the name without _fp8g)
CASES["headline_direct_fp8g"] = ParallelConfig(**HEADLINE, **FP8G)
CASES["headline_overlap_fp8g"] = ParallelConfig(**HEADLINE, ep_overlap_chunks=2, **FP8G)
CASES["headline_capacity_fp8g"] = ParallelConfig(**HEADLINE, ep_capacity_factor=8.0, **FP8G)
CASES["folded_dedup_fp8g"] = ParallelConfig(**FOLDED, ep_dedup=True, **FP8G)
# (dedup + overlap would run no other combine code: parallel/ep/pieces.py's box, as headline_overlap_fp8g, and the
# direct combine for the fan-in, as folded_dedup_fp8g)
# activation checkpointing of the cases named ..._full_... / ..._selective_... (the others: none)
CHECKPOINT = {name: mode for name in CASES for mode in ("full", "selective") if f"_{mode}_" in name}
INEXACT = ("headline_dropping", "headline_fp8", "headline_overlap_fp8", "folded_dedup_fp8", "folded_dedup_overlap_fp8",
           "folded_dedup_fp8_full_keep", *(name for name in CASES if name.endswith("_fp8g")))


# -- the plan against plain loops (one process)

def _loop_traffic(experts_by_rank, placement):
    """Independent reference: direct copies, distinct (token, node) pairs and fan-out copies per
    (src, dst) by Python loops over tokens."""
    P, L = placement.size, placement.local_experts
    direct, pairs, fan = ([[0] * P for _ in range(P)] for _ in range(3))
    for src, experts_TK in enumerate(experts_by_rank):
        gateway = placement.gateway(src)
        for row in experts_TK.tolist():
            for e in row:
                direct[src][e // L] += 1
            for node in sorted({placement.node_of_rank[e // L] for e in row}):
                pairs[src][gateway[node]] += 1
            for e in row:
                fan[gateway[placement.node_of_rank[e // L]]][e // L] += 1
    return direct, pairs, fan


@pytest.mark.parametrize("ep_ranks", [tuple(range(8)), (0, 2, 4, 6), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)])
def test_plan_rows_equal_plain_loops(ep_ranks):
    placement = Placement(24, ep_ranks, RPN)
    g = torch.Generator().manual_seed(0)
    routing = [torch.rand(13, 24, generator=g).topk(4, dim=1).indices for _ in ep_ranks]
    direct, pairs, fan = _loop_traffic(routing, placement)
    plain = {s.name: s.rows.tolist() for s in layer_traffic(routing, placement, 16, 4, dedup=False)}
    dedup = {s.name: s.rows.tolist() for s in layer_traffic(routing, placement, 16, 4, dedup=True)}
    assert plain["dispatch"] == direct
    assert dedup["node_dispatch"] == pairs and dedup["fan_out"] == fan
    distinct = sum(len({placement.node_of_rank[e // placement.local_experts] for e in row})
                   for r in routing for row in r.tolist())
    assert sum(map(sum, pairs)) == distinct == sum(int(distinct_nodes_per_token(r, placement).sum()) for r in routing)


def test_gateway_is_self_on_own_node_and_one_per_node():
    placement = Placement(16, (0, 2, 4, 6, 8, 10, 12, 14), RPN)  # 2 ep ranks per node, 4 nodes
    for src in range(placement.size):
        gateway = placement.gateway(src)
        assert gateway[placement.node_of_rank[src]] == src
        assert [placement.node_of_rank[g] for g in gateway] == list(range(placement.n_nodes))


@pytest.mark.parametrize("argv, world, message", [
    (["--optim.ranks_per_node=4"], 8, "optim.ranks_per_node: moved to parallel.ranks_per_node"),
    (["--parallel.ranks_per_node=0"], 8, "parallel.ranks_per_node=0: must be >= 1"),
    (["--parallel.ep_capacity_factor=-1"], 8, "parallel.ep_capacity_factor=-1.0: must be finite and >= 0"),
    (["--parallel.ep_dedup=true", "--parallel.ep=1"], 8, "parallel.ep_dedup=True has no effect with parallel.ep=1"),
    (["--parallel.ep_overlap_chunks=0"], 8, "parallel.ep_overlap_chunks=0: must be >= 1"),
    (["--parallel.ep_overlap_chunks=2", "--parallel.ep_capacity_factor=1"], 8,
     "parallel.ep_overlap_chunks=2 with parallel.ep_capacity_factor=1.0: not combined yet"),
    (["--parallel.ep_recompute=keep"], 8,
     "parallel.ep_recompute='keep' has no effect with training.activation_checkpoint='none'"),
    (["--parallel.ep_recompute=keep", "--training.activation_checkpoint=full", "--parallel.ep=1"], 8,
     "parallel.ep_recompute='keep' has no effect with parallel.ep=1"),
    (["--parallel.ep_combine_grad_dtype=float8_e4m3", "--parallel.ep=1"], 8,
     "parallel.ep_combine_grad_dtype='float8_e4m3' has no effect with parallel.ep=1"),
    (["--parallel.ep_combine_grad_dtype=bfloat16"], 8, "parallel.ep_combine_grad_dtype"),
    (["--parallel.ep_dedup=true", "--parallel.ranks_per_node=3"], 8,
     "parallel.ep_dedup: parallel.ranks_per_node=3 does not divide the world size 8"),
])
def test_bad_dispatch_knobs_fail_in_one_line(argv, world, message):
    from runtime.config import ConfigError
    from runtime.config_parser import load_config

    with pytest.raises(ConfigError) as error:
        load_config(argv).layout(world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# -- 8 ranks, two simulated nodes

def _run_all(rank, world, reference):
    torch.manual_seed(0)
    return {name: run_case(config, reference, CHECKPOINT.get(name, "none")) for name, config in CASES.items()}


@pytest.fixture(scope="module")
def results():
    reference = reference_step()
    return reference, run_ranks(_run_all, WORLD, reference, timeout=300)


@pytest.mark.parametrize("name", [n for n in CASES if n not in INEXACT])
def test_step_matches_single_process(results, name):
    reference, per_rank = results
    assert_matches_single_process(reference, [by_case[name] for by_case in per_rank])


@pytest.mark.parametrize("name", list(CASES))
def test_counted_bytes_equal_the_plan(results, name):
    """Every all-to-all byte of the forward and of the backward, per rank, within and across the two
    simulated nodes, equals the projection's per-layer EP bytes for the run's own routing."""
    _, per_rank = results
    from planning.ep_traffic import expert_call_stages

    resent = {"full": None, "selective": expert_call_stages(CASES[name])}.get(CHECKPOINT.get(name), ())
    for direction in ("forward", "backward"):
        plan = planned_bytes(per_rank, name, CASES[name], direction == "backward")
        counted = {rank: by_case[name][direction] for rank, by_case in enumerate(per_rank)}
        if direction == "backward" and resent != () and CASES[name].ep_recompute == "resend":
            again = planned_bytes(per_rank, name, CASES[name], stages=resent)  # the recompute sends them again
            if "node_combine" in (resent or ()):  # torch's early stop: the last piece's node combine is not resent
                least = planned_bytes(per_rank, name, CASES[name], stages=tuple(s for s in resent if s != "node_combine"))
                for rank, (a, b) in plan.items():
                    assert a + least[rank][0] <= counted[rank][0] <= a + again[rank][0], rank
                    assert b + least[rank][1] < counted[rank][1] < b + again[rank][1], rank
                continue
            plan = {rank: (a + again[rank][0], b + again[rank][1]) for rank, (a, b) in plan.items()}
        assert counted == plan, direction


@pytest.mark.parametrize("keep, twin", [("folded_dedup_full_keep", "folded_dedup"),
                                        ("headline_overlap_selective_keep", "headline_overlap"),
                                        ("folded_dedup_fp8_full_keep", "folded_dedup_fp8")])
def test_keep_recomputes_without_resending(results, keep, twin):
    """parallel.ep_recompute='keep' under activation checkpointing: every rank's counted all-to-all bytes,
    forward and backward, equal the same dispatch without checkpointing (same routing), count exchanges
    included (their host read of split sizes is replayed with them: runtime/syncs.py cannot see a
    .tolist() inside a CPU recompute, its documented blind spot); loss and gradient norm equal the
    twin's (FP8 included: the replayed rows are the bytes that arrived). (tests/ranks/test_ep_grid.py: keep against
    resend on every route, wire dtype and schedule.)"""
    _, per_rank = results
    for rank, by_case in enumerate(per_rank):
        got, want = by_case[keep], by_case[twin]
        assert [torch.equal(a, b) for a, b in zip(got["routing"], want["routing"])] == [True] * len(want["routing"])
        assert (got["forward"], got["backward"]) == (want["forward"], want["backward"]), rank
        assert got["loss"] == pytest.approx(want["loss"], rel=NORM_RTOL)
        assert got["norm"] == pytest.approx(want["norm"], rel=NORM_RTOL)


def test_dedup_sends_fewer_bytes_across_nodes(results):
    _, per_rank = results
    for name in CASES:  # the figures (pytest -s): forward all-to-all bytes of all ranks, intra / inter node
        print(name, *(sum(r[name]["forward"][i] for r in per_rank) for i in (0, 1)))
    for layout in ("headline", "folded"):
        direct = sum(r[f"{layout}_direct"]["forward"][1] for r in per_rank)
        dedup = sum(r[f"{layout}_dedup"]["forward"][1] for r in per_rank)
        assert dedup < direct, (layout, dedup, direct)


def test_dedup_cross_node_rows_are_distinct_token_node_pairs(results):
    """Counted inter-node forward bytes of dedup, per rank = the off-node distinct (token, node) pairs
    it sends (row, K weights, K ids) and those it answers as a gateway (the summed row back), plus the
    count exchanges' off-node ints: a plain loop over the routing."""
    _, per_rank = results
    c = MODEL
    K = c.n_activated_experts
    for layout in ("headline", "folded"):
        name = f"{layout}_dedup"
        out_pairs, in_pairs = [0] * WORLD, [0] * WORLD
        for rank, by_case in enumerate(per_rank):
            ep_ranks = by_case[name]["ep_ranks"]
            L = c.n_routed_experts // len(ep_ranks)
            for experts_TK in by_case[name]["routing"]:
                for row in experts_TK.tolist():
                    nodes = {ep_ranks[e // L] // RPN for e in row} - {rank // RPN}
                    out_pairs[rank] += len(nodes)
                    for node in nodes:  # the gateway: the member of `node` at my position in my node
                        members = [r for r in ep_ranks if r // RPN == node]
                        mine = [r for r in ep_ranks if r // RPN == rank // RPN]
                        in_pairs[members[mine.index(rank) % len(members)]] += 1
        for rank, by_case in enumerate(per_rank):
            ep_ranks = by_case[name]["ep_ranks"]
            off_node_peers = sum(1 for r in ep_ranks if r // RPN != rank // RPN)
            counts = len(by_case[name]["routing"]) * off_node_peers * (2 + c.n_routed_experts // len(ep_ranks)) * 8
            expected = out_pairs[rank] * (c.dim * 4 + K * 4 + K * 8) + in_pairs[rank] * c.dim * 4 + counts
            assert by_case[name]["forward"][1] == expected, (name, rank)


def _loop_drops(per_rank, name, rank):
    """[dropped, routed] copies of `rank` by a plain loop: its copies sorted by expert (token order
    within an expert), the first C per destination rank kept."""
    ep_ranks = per_rank[rank][name]["ep_ranks"]
    L = MODEL.n_routed_experts // len(ep_ranks)
    dropped = routed = 0
    for experts_TK in per_rank[rank][name]["routing"]:
        copies = sorted(e for row in experts_TK.tolist() for e in row)
        C = capacity_slots(len(copies), len(ep_ranks), CASES[name].ep_capacity_factor)
        for dest in range(len(ep_ranks)):
            dropped += max(0, sum(1 for e in copies if e // L == dest) - C)
        routed += len(copies)
    return [dropped, routed]


def test_capacity_counts_the_copies_it_drops(results):
    """Factor 0.5 drops copies (counted as a plain loop counts them); factor ep drops none."""
    _, per_rank = results
    for rank, by_case in enumerate(per_rank):
        assert by_case["headline_dropping"]["drops"] == _loop_drops(per_rank, "headline_dropping", rank)
        assert by_case["headline_capacity"]["drops"][0] == 0 and by_case["folded_capacity"]["drops"][0] == 0
        assert by_case["headline_direct"]["drops"] is None
    assert sum(r["headline_dropping"]["drops"][0] for r in per_rank) > 0


def _pretrain(rank, world_size, argv):
    from launch.pretrain import main

    return main(argv)


def test_capacity_dispatch_has_one_host_sync_per_step_and_logs_drops(tmp_path):
    """2 ranks (ep=2), 2 MoE layers x 2 micro-batches: the direct dispatch reads split sizes 4 times a
    step (tests/ranks/test_host_syncs.py: 1 + 4, 1 + 8 with full recompute); the fixed-capacity one only the
    step's readback, also with full activation checkpointing, and
    metrics.jsonl carries the step's dropped fraction."""
    import json

    argv = ["--training.steps=3", "--data.seq_len=32", "--data.batch_size=8", "--training.grad_accum=2",
            "--checkpoint.interval=0", "--profile.enabled=true", "--profile.steps=1,2", f"--run.dir={tmp_path}",
            "--parallel.ep_capacity_factor=0.5", "--training.activation_checkpoint=full"]
    assert run_ranks(_pretrain, 2, argv, as_torchrun=True) == [0, 0]
    for rank in (0, 1):
        with open(tmp_path / "profile" / f"syncs_rank{rank}.json") as f:
            assert all(s["total"] == 1 for s in json.load(f).values())
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if '"step"' in line]
    fractions = [r["ep_dropped_fraction"] for r in rows if "ep_dropped_fraction" in r]
    assert len(fractions) == 3 and all(0 < x < 1 for x in fractions), rows


def test_overlap_keeps_a_piece_in_flight_while_another_computes(results):
    """Recorded timestamps (2 pieces, first MoE layer, every rank): forward, piece 1's dispatch is
    issued before piece 0's grouped matmul and waited for after it; backward, piece 0's combine
    gradient is issued before piece 1's gradient computation and waited for after it."""
    _, per_rank = results
    for by_case in per_rank:
        t = {(event, piece): when for event, piece, when in by_case["headline_overlap"]["timeline"]}
        assert t["dispatch_start", 1] < t["compute_start", 0] < t["compute_end", 0] < t["dispatch_wait", 1]
        assert t["combine_start", 0] < t["compute_start", 1]
        assert (t["combine_grad_start", 0] < t["combine_grad_wait", 1] < t["dispatch_grad_start", 1]
                < t["combine_grad_wait", 0])


@pytest.mark.parametrize("overlapped, plain", [("headline_overlap_fp8", "headline_fp8"),
                                                ("folded_dedup_overlap_fp8", "folded_dedup_fp8"),
                                                ("headline_overlap_fp8g", "headline_direct_fp8g")])
def test_overlap_with_fp8_equals_fp8_without_overlap(results, overlapped, plain):
    """FP8 rows (dispatch, or combine gradient) are quantized per token, so cutting the copies into pieces
    changes no value: loss and gradient norm equal the unpipelined FP8 path's (fp32 tolerances: only the
    summation order of the expert weight gradients differs)."""
    _, per_rank = results
    for by_case in per_rank:
        assert by_case[overlapped]["loss"] == pytest.approx(by_case[plain]["loss"], rel=NORM_RTOL)
        assert by_case[overlapped]["norm"] == pytest.approx(by_case[plain]["norm"], rel=NORM_RTOL)
        assert by_case[overlapped]["norm"] != by_case["headline_direct"]["norm"]  # the FP8 path ran


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("_fp8g")])
def test_fp8_combine_gradient_changes_only_the_backward(results, name):
    """parallel.ep_combine_grad_dtype against its twin (the case without _fp8g), every rank: the forward
    (routing, loss, every forward all-to-all byte) is the twin's; in backward every combine's gradient
    row (direct/capacity: "combine"; dedup: "fan_in" and "node_combine") crosses as D + 4 bytes instead
    of 4 D (fp32 here; bf16's 2 D: about half), so the counted backward bytes are the twin's less
    exactly the plan's saving on those stages, in-node and across nodes; the gradient norm moves (the
    FP8 path ran) by less than e4m3's largest relative rounding of one value (2^-4)."""
    _, per_rank = results
    twin, D = name.removesuffix("_fp8g"), MODEL.dim
    combines = ("combine", "fan_in", "node_combine")
    fp8, full = (planned_bytes(per_rank, n, CASES[n], True, combines) for n in (name, twin))
    for rank, by_case in enumerate(per_rank):
        got, want = by_case[name], by_case[twin]
        assert [torch.equal(a, b) for a, b in zip(got["routing"], want["routing"])] == [True] * len(want["routing"])
        assert (got["loss"], got["forward"]) == (want["loss"], want["forward"]), rank
        saved = tuple(a - b for a, b in zip(want["backward"], got["backward"]))
        assert saved == tuple(f - q for f, q in zip(full[rank], fp8[rank])), rank
        assert [q * 4 * D for q in fp8[rank]] == [f * (D + 4) for f in full[rank]] and sum(fp8[rank]) > 0, rank
        assert 0 < abs(got["norm"] - want["norm"]) <= 2 ** -4 * want["norm"], rank
    print(name, "norm", per_rank[0][name]["norm"], "twin", per_rank[0][twin]["norm"], "backward bytes",
          sum(sum(r[name]["backward"]) for r in per_rank), "twin", sum(sum(r[twin]["backward"]) for r in per_rank))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].ep_recompute == "keep"])
def test_kept_bytes_are_what_the_memory_estimate_counts(results, name):
    """The row buffers the tapes hold after the forward, summed over the 8 ranks, equal
    parallel/ep/keep.kept_bytes_per_layer (what launch/estimate_memory.py and the projection add) x MoE
    layers x ranks, with the run's mean distinct nodes per token (a plain loop over its routing)."""
    from parallel.ep.keep import kept_bytes_per_layer

    _, per_rank = results
    c, layout = MODEL, CASES[name].resolve(WORLD)
    tokens = per_rank[0][name]["routing"][0].shape[0]
    L = c.n_routed_experts // layout.ep
    distinct = [len({r[name]["ep_ranks"][e // L] // RPN for e in row}) for r in per_rank for t in r[name]["routing"]
                for row in t.tolist()]
    layers = len(per_rank[0][name]["routing"])
    expected = WORLD * layers * kept_bytes_per_layer(tokens, c, layout.ep_config, 4, sum(distinct) / len(distinct))
    assert sum(r[name]["kept_bytes"] for r in per_rank) == pytest.approx(expected, rel=1e-12)
    assert all(r[f"{name.split('_full')[0].split('_selective')[0]}"]["kept_bytes"] == 0 for r in per_rank)


def test_dedup_overlap_keeps_a_node_hop_in_flight_while_another_piece_fans_out(results):
    """Recorded timestamps (dedup, 2 pieces, first MoE layer, every rank): piece 1's node hop is issued
    before piece 0's fan-out and compute and waited for after them; piece 0's node combine is issued
    before piece 1's fan-out."""
    _, per_rank = results
    for by_case in per_rank:
        t = {(event, piece): when for event, piece, when in by_case["headline_dedup_overlap"]["timeline"]}
        assert t["dispatch_start", 1] < t["compute_start", 0] < t["compute_end", 0] < t["dispatch_wait", 1]
        assert t["combine_start", 0] < t["compute_start", 1]


def _train_losses(rank, world, variants, steps):
    """Per variant (param dtype, EP knobs): the global loss of `steps` AdamW steps on 2 ranks (ep=2)."""
    out = {}
    for name, (param_dtype, knobs) in variants.items():
        model = build_model(preset("debug"))  # the whole debug preset: the bf16 yardstick is measured on it
        layout = ParallelConfig(dp_shard=2, ep=2, edp_shard=1, **knobs).resolve(world)
        parallelize(model, build_meshes(layout, "cpu"), layout, param_dtype=param_dtype)
        opt = torch.optim.AdamW([p for p in model.parameters()], lr=3e-3, foreach=False)
        losses = []
        for step in range(steps):
            tokens = torch.randint(0, model.config.vocab_size, (4, SEQ + 1),
                                   generator=torch.Generator().manual_seed(100 * step + rank))
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], 2 * 4 * SEQ)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(global_loss(loss.float()).item())
        out[name] = losses
    return out


@pytest.fixture(scope="module")
def trained():
    """Losses of 20 steps: fp32 and bf16 (the yardstick), FP8 dispatch, FP8 combine gradient (direct and
    in 2 pieces), all on the same data."""
    fp8, overlap = {"ep_dispatch_dtype": "float8_e4m3"}, {"ep_overlap_chunks": 2}
    variants = {"fp32": (torch.float32, {}), "bf16": (torch.bfloat16, {}), "fp8": (torch.float32, fp8),
                "fp8g": (torch.float32, FP8G), "overlap2_fp8g": (torch.float32, overlap | FP8G)}
    losses = run_ranks(_train_losses, 2, variants, 20, timeout=300)[0]
    yardstick = max(abs(a - b) for a, b in zip(losses["bf16"], losses["fp32"]))
    return losses, yardstick


def test_fp8_dispatch_stays_within_three_bf16_yardsticks_over_20_steps(trained):
    """Yardstick: the largest |bf16 - fp32| loss difference over 20 steps (bf16 compute through FSDP's
    mixed precision). FP8 dispatch in an fp32 run may move the loss by at most 3 of them, and must move
    it (the FP8 path ran)."""
    losses, yardstick = trained
    fp8_error = max(abs(a - b) for a, b in zip(losses["fp8"], losses["fp32"]))
    print(f"yardstick {yardstick:.3g}, fp8 dispatch {fp8_error:.3g}, losses fp32 {losses['fp32'][0]:.4f} -> "
          f"{losses['fp32'][-1]:.4f}")
    assert 0 < fp8_error <= 3 * yardstick


@pytest.mark.parametrize("name", ["fp8g", "overlap2_fp8g"])
def test_fp8_combine_gradient_stays_within_three_bf16_yardsticks_over_20_steps(trained, name):
    """parallel.ep_combine_grad_dtype in an fp32 run: the first step's loss is the fp32 run's (the forward
    is unchanged: equal, to a few ulps in pieces), later ones move (the rounded gradients update the
    weights) by at most 3 yardsticks (as the FP8 dispatch)."""
    losses, yardstick = trained
    error = max(abs(a - b) for a, b in zip(losses[name], losses["fp32"]))
    print(f"yardstick {yardstick:.3g}, {name} {error:.3g}")
    if name == "fp8g":
        assert losses[name][0] == losses["fp32"][0]
    assert losses[name][0] == pytest.approx(losses["fp32"][0], rel=NORM_RTOL)
    assert 0 < error <= 3 * yardstick


def test_group_limited_routing_reaches_at_most_topk_group_nodes():
    """DeepSeek-V3's node-limited routing through the model's own Router: 4 groups of 4 experts, a token
    may use 2 groups; with one group per node (one ep rank of 4 experts per node) every token's
    experts span at most 2 nodes, and without the limit some span more."""
    from models.moe import Router

    config = preset("debug", n_routed_experts=16, n_activated_experts=4, n_expert_groups=4, n_limited_groups=2)
    placement = Placement(16, (0, 4, 8, 12), RPN)  # ep rank p on node p: experts 4p..4p+3 = group p
    torch.manual_seed(0)
    x = torch.randn(1, 256, config.dim)
    limited = Router(config).eval()
    unlimited = Router(preset("debug", n_routed_experts=16, n_activated_experts=4)).eval()
    unlimited.load_state_dict(limited.state_dict())
    with torch.no_grad():
        assert distinct_nodes_per_token(limited(x)[1], placement).max() <= 2
        assert distinct_nodes_per_token(unlimited(x)[1], placement).max() > 2


@pytest.mark.parametrize("name", list(CASES))
def test_forward_host_syncs_are_the_plans(results, name):
    """Host syncs of the forward (runtime/syncs.py) = MoE layers x parallel/ep/plan.host_syncs_per_layer:
    direct and overlapped 1, dedup 2, capacity 0. Index tensors the dispatch makes from host data once
    and caches ("copy", a first-forward cost) are left out."""
    from parallel.ep.plan import host_syncs_per_layer

    _, per_rank = results
    expected = len(per_rank[0][name]["routing"]) * host_syncs_per_layer(CASES[name].resolve(WORLD).ep_config)
    for by_case in per_rank:
        assert sum(by_case[name]["syncs"].values()) == expected, by_case[name]["syncs"]
