"""Two halves per MoE block (parallel/ep_interleave.py) on 8 gloo ranks in two simulated nodes, against the
single-process step: the split by positions (one sequence per rank) and by sequences (two per rank, under
context parallelism too), with full checkpointing and kept exchanges, FP8 dispatch; every all-to-all byte
counted and compared with the direct dispatch's, host syncs counted, the overlap read from timestamps.

The harness, the model (two MoE blocks, no dense one) and tolerances are tests/test_ep_dispatch.py's (fp32,
different summation orders). The direct dispatch on the folded layout is its folded_direct (same layout, model
and assertions: the step against one process, forward host syncs, and its bytes against the plan).
"""

import dataclasses

import pytest
import torch

from models import Transformer, preset
from multirank import run_ranks
from parallel.layout import ParallelConfig
from test_ep_dispatch import MODEL, NORM_RTOL, RPN, _reference, _run_case, assert_matches_single_process

WORLD = 8
BY_POSITION = dict(dp_shard=8, cp=1, ep=8, edp_shard=1, ranks_per_node=RPN)  # 1 sequence per rank
HEADLINE = dict(dp_shard=4, cp=2, ep=8, edp_shard=1, ranks_per_node=RPN)  # 2 sequences per rank, cp = 2
FOLDED = dict(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4, expert_inner="edp_shard", ranks_per_node=RPN)
CASES = {
    "position_direct": ParallelConfig(**BY_POSITION),
    "position_interleave": ParallelConfig(**BY_POSITION, ep_interleave=True),
    "position_interleave_full_keep": ParallelConfig(**BY_POSITION, ep_interleave=True, ep_recompute="keep"),
    "position_interleave_full_resend": ParallelConfig(**BY_POSITION, ep_interleave=True),
    "position_fp8": ParallelConfig(**BY_POSITION, ep_dispatch_dtype="float8_e4m3"),
    "position_interleave_fp8": ParallelConfig(**BY_POSITION, ep_interleave=True, ep_dispatch_dtype="float8_e4m3"),
    "position_fp8_fp8g_full_keep": ParallelConfig(**BY_POSITION, ep_dispatch_dtype="float8_e4m3",
                                                  ep_combine_grad_dtype="float8_e4m3", ep_recompute="keep"),
    "position_interleave_fp8_fp8g_full_keep": ParallelConfig(**BY_POSITION, ep_interleave=True, ep_recompute="keep",
                                                             ep_dispatch_dtype="float8_e4m3",
                                                             ep_combine_grad_dtype="float8_e4m3"),
    "headline_interleave": ParallelConfig(**HEADLINE, ep_interleave=True),
    "folded_interleave_full_keep": ParallelConfig(**FOLDED, ep_interleave=True, ep_recompute="keep"),
}
CHECKPOINT = {name: "full" for name in CASES if "_full_" in name}
INEXACT = ("position_fp8", "position_interleave_fp8", "position_fp8_fp8g_full_keep",
           "position_interleave_fp8_fp8g_full_keep")
ALPHA = 0.01  # the sequence-wise balance loss (the K2/V3 presets use 1e-4), on where cp = 1 (layout.py refuses it
# under cp), so its split over two calls of the router is tested


def _alpha(name: str) -> float:
    return ALPHA if name.startswith("position") else 0.0


def _model(alpha: float, dp: int = 1) -> Transformer:
    """MODEL (tests/test_ep_dispatch.py); with dp > 1 each router's balance loss is weighted by this rank's share of the
    sequences (as runtime/train.py does), so the gradients summed over ranks are the one-process ones."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(MODEL, aux_loss_alpha=alpha))
    model.init_weights()
    for router in model.routers():
        router.aux_loss_weight = 1.0 / dp
    return model


def _run_all(rank, world, references):
    import test_ep_dispatch

    out = {}
    for name, config in CASES.items():
        dp = config.resolve(world).dp
        test_ep_dispatch._model = lambda: _model(_alpha(name), dp)  # the harness builds this case's model
        torch.manual_seed(0)
        out[name] = _run_case(config, references[_alpha(name)], CHECKPOINT.get(name, "none"))
    return out


@pytest.fixture(scope="module")
def results():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        references = {alpha: _reference(lambda alpha=alpha: _model(alpha)) for alpha in (0.0, ALPHA)}
    finally:
        torch.set_num_threads(threads)
    return references, run_ranks(_run_all, WORLD, references, timeout=300)


@pytest.mark.parametrize("name", [n for n in CASES if n not in INEXACT])
def test_step_matches_single_process(results, name):
    references, per_rank = results
    assert_matches_single_process(references[_alpha(name)], [by_case[name] for by_case in per_rank])


def _planned(per_rank, name) -> dict[int, tuple[int, int]]:
    """{rank: (intra, inter) bytes} of the whole-step projection's per-layer EP term
    (benchmarks/lib/ep_projection.layer_link_bytes: forward, what the recompute resends, backward) on the
    run's own routing (each layer's two halves' routing put back together), summed over the MoE layers."""
    from benchmarks.lib.ep_projection import layer_link_bytes, layer_stages
    from parallel.ep_plan import Placement

    config, layout = MODEL, CASES[name].resolve(WORLD)
    halves = 2 if layout.ep_interleave else 1
    ep_ranks = tuple(per_rank[0][name]["ep_ranks"])
    placement = Placement(config.n_routed_experts, ep_ranks, RPN)
    totals = {r: [0, 0] for r in ep_ranks}
    calls = len(per_rank[0][name]["routing"])
    for layer in range(0, calls, halves):
        routing = [torch.cat(per_rank[r][name]["routing"][layer:layer + halves]) for r in ep_ranks]
        stages = layer_stages(config, layout, routing, 4, placement)
        for i, r in enumerate(ep_ranks):
            intra, inter = layer_link_bytes(stages, placement, i, CHECKPOINT.get(name, "none"), layout)
            totals[r][0] += intra
            totals[r][1] += inter
    return {r: tuple(v) for r, v in totals.items()}


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("position")])
def test_counted_bytes_equal_the_plan(results, name):
    """Every all-to-all byte of the step (forward and backward), per rank and within/across the two
    simulated nodes, equals the projection's per-layer EP term (ep = 8 on all 8 ranks: one ep group). The
    halves send the direct dispatch's rows plus one more count exchange per layer; with kept exchanges the
    recompute sends nothing, with "resend" it sends the forward again."""
    _, per_rank = results
    counted = {rank: tuple(a + b for a, b in zip(by_case[name]["forward"], by_case[name]["backward"]))
               for rank, by_case in enumerate(per_rank)}
    assert counted == _planned(per_rank, name)


def test_halves_send_the_direct_rows_and_one_more_count_exchange(results):
    """Against the direct dispatch on the same routing: the backward's bytes are equal, the forward's
    exceed them by one count exchange (L int64 to each peer) per MoE layer."""
    _, per_rank = results
    L = MODEL.n_routed_experts // 8
    for by_case in per_rank:
        direct, halves = by_case["position_direct"], by_case["position_interleave"]
        layers = len(direct["routing"])
        assert len(halves["routing"]) == 2 * layers
        assert halves["backward"] == direct["backward"]
        assert halves["forward"] == (direct["forward"][0] + layers * (RPN - 1) * L * 8,
                                     direct["forward"][1] + layers * RPN * L * 8)


@pytest.mark.parametrize("name", ["position_interleave", "headline_interleave"])
def test_one_half_is_in_flight_while_the_other_computes(results, name):
    """Recorded timestamps (first MoE layer, every rank). Forward: half A's dispatch is issued before half
    B's attention and waited for after it; A's combine is issued before B's experts and waited for after
    them. Backward: A's combine gradient is in flight during B's expert gradients, and A's dispatch
    gradient during B's attention gradients."""
    _, per_rank = results
    for by_case in per_rank:
        t = {(event, half): when for event, half, when in by_case[name]["timeline"]}
        assert t["dispatch_start", 0] < t["attention_start", 1] < t["attention_end", 1] < t["dispatch_wait", 0]
        assert t["combine_start", 0] < t["compute_start", 1] < t["compute_end", 1] < t["combine_wait", 0]
        assert (t["combine_grad_start", 0] < t["combine_grad_wait", 1] < t["dispatch_grad_start", 1]
                < t["combine_grad_wait", 0])
        assert (t["dispatch_grad_start", 0] < t["attention_grad_start", 1] < t["attention_grad_end", 1]
                < t["dispatch_grad_wait", 0])


@pytest.mark.parametrize("name", list(CASES))
def test_forward_host_syncs_are_the_plans(results, name):
    """Host syncs of the forward (runtime/syncs.py) = MoE layers x parallel/ep_plan.host_syncs_per_layer:
    one per half with the halves."""
    from parallel.ep_plan import host_syncs_per_layer

    _, per_rank = results
    layout = CASES[name].resolve(WORLD)
    layers = len(per_rank[0][name]["routing"]) // (2 if layout.ep_interleave else 1)
    for by_case in per_rank:
        assert sum(by_case[name]["syncs"].values()) == layers * host_syncs_per_layer(layout), by_case[name]["syncs"]


@pytest.mark.parametrize("halves, direct", [("position_interleave_fp8", "position_fp8"),
                                            ("position_interleave_fp8_fp8g_full_keep", "position_fp8_fp8g_full_keep")])
def test_fp8_halves_equal_fp8_direct(results, halves, direct):
    """FP8 dispatch (and FP8 combine gradient, with kept exchanges) with the halves rounds the same rows as
    without: loss and norm agree to fp32 summation-order tolerance (both differ from the fp32 reference by
    the FP8 rounding)."""
    _, per_rank = results
    for by_case in per_rank:
        got, want = by_case[halves], by_case[direct]
        assert got["loss"] == pytest.approx(want["loss"], rel=NORM_RTOL)
        assert got["norm"] == pytest.approx(want["norm"], rel=NORM_RTOL)
        assert got["loss"] != by_case["position_interleave"]["loss"]  # the FP8 path ran
    if "fp8g" in halves:  # the FP8 combine gradient ran: it moves the norm, not the loss
        assert per_rank[0][halves]["norm"] != per_rank[0]["position_interleave_fp8"]["norm"]


@pytest.mark.parametrize("extra, checkpoint, message", [
    ({"ep_overlap_chunks": 2}, "none", "parallel.ep_interleave with parallel.ep_overlap_chunks=2"),
    ({"ep_dedup": True}, "none", "parallel.ep_interleave with parallel.ep_dedup=True"),
    ({"ep_capacity_factor": 2.0}, "none", "parallel.ep_interleave with parallel.ep_capacity_factor=2.0"),
    ({}, "selective", "parallel.ep_interleave with training.activation_checkpoint='selective'"),
])
def test_bad_combinations_fail_in_one_line(extra, checkpoint, message):
    from parallel.layout import check_recompute

    with pytest.raises(ValueError) as error:
        layout = ParallelConfig(**BY_POSITION, ep_interleave=True, **extra).resolve(WORLD)
        layout.validate(preset("debug"), 32, 8)
        check_recompute(layout, checkpoint)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_interleave_without_ep_fails_in_one_line():
    with pytest.raises(ValueError, match="parallel.ep_interleave=True has no effect with parallel.ep=1"):
        ParallelConfig(dp_shard=8, ep=1, ep_interleave=True).resolve(WORLD).validate(preset("debug"), 32, 8)


def _bf16_grads(rank, world, variants):
    """Per variant (param dtype, interleave): every parameter's local gradient after one step on 2 ranks
    (ep = 2, one sequence per rank: the split by positions), bf16 weights making each router an FSDP unit
    of its own (parallel/fsdp.py), called once per half."""
    from parallel.gradients import loss_fn
    from parallel.meshes import build_meshes
    from parallel.parallelize import parallelize

    out = {}
    for name, (param_dtype, interleave) in variants.items():
        model = _model(ALPHA, dp=2)
        layout = ParallelConfig(dp_shard=2, ep=2, edp_shard=1, ep_interleave=interleave).resolve(world)
        parallelize(model, build_meshes(layout, "cpu"), layout, param_dtype=param_dtype, activation_checkpoint="full")
        tokens = torch.randint(0, model.config.vocab_size, (1, 65), generator=torch.Generator().manual_seed(rank))
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:], 2 * 64).backward()
        out[name] = {k: p.grad.to_local().float().clone() for k, p in model.named_parameters()}
    return out


def test_bf16_router_units_called_per_half_get_both_halves_gradients():
    """Yardstick: per parameter, the largest |bf16 - fp32| gradient difference of the direct dispatch (relative
    to the fp32 gradient's largest entry). The halves in bf16 may differ from the direct dispatch in bf16 by at
    most 3 of the largest yardstick; a router that reduced only one half's gradient would be off by ~50%."""
    variants = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "bf16_halves": (torch.bfloat16, True)}
    for grads in run_ranks(_bf16_grads, 2, variants, timeout=300):
        def rel(a, b):
            return {k: (grads[a][k] - grads[b][k]).abs().max().item() / grads["fp32"][k].abs().max().item()
                    for k in grads["fp32"] if grads["fp32"][k].numel() and grads["fp32"][k].abs().max() > 0}
        yardstick, halves = rel("bf16", "fp32"), rel("bf16_halves", "bf16")
        assert all(v <= 3 * yardstick[k] for k, v in halves.items()), halves


@pytest.mark.parametrize("argv, message", [
    (["--data.batch_size=4"], "parallel.ep_interleave with parallel.cp=2: 1 sequence(s) per rank and micro-batch"),
    (["--data.source=bin", "--data.path=x.bin", "--data.document_mask=true"],
     "parallel.ep_interleave with data.document_mask: not combined yet"),
    (["--training.activation_checkpoint=selective"],
     "parallel.ep_interleave with training.activation_checkpoint='selective'"),
])
def test_the_launch_config_refuses_what_the_halves_cannot_run(argv, message):
    """The debug config on 8 ranks (dp_shard 4 x cp 2, ep 8): refused before launch, in one line."""
    from runtime.config import load_config

    with pytest.raises(ValueError) as error:
        load_config(["--parallel.ep_interleave=true", *argv]).layout(WORLD)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
