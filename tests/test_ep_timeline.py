"""benchmarks/lib/ep_timeline.py: the interleaved MoE block's two-stream program on hand-made durations,
each expected span worked out by hand (ops in FORWARD / BACKWARD order; a comm op starts when the comm
stream is free and the compute issued before it is done)."""

import pytest

import itertools

from benchmarks.lib import ep_timeline
from benchmarks.lib.ep_timeline import (AHEAD, BACKWARD, FORWARD, backward_program, exposed_s, forward_chunks,
                                        forward_layers_started, paired_kept_layers, paired_program, recompute_ops,
                                        simulate, step_exposed_s, unpaired_layers)


def _spans(attn, experts, shared, dispatch, combine):
    """(forward, backward) (span, compute) of one half's durations; backward compute 2x, gradients as the forward."""
    forward = {"attn": attn, "experts": experts, "shared": shared, "counts": 0.0, "dispatch": dispatch,
               "combine": combine}
    backward = {"attn_bwd": 2 * attn, "experts_bwd": 2 * experts, "shared_bwd": 2 * shared,
                "dispatch_grad": dispatch, "combine_grad": combine}
    return simulate(FORWARD, forward), simulate(BACKWARD, backward)


def test_compute_bound_hides_every_all_to_all():
    # forward: attn A 0-10, dispatch A 10-11, attn B 10-20, dispatch B 20-21, experts 20-40 (combines
    # 30-31, 40-41), shared 40-60: the compute stream never waits
    assert _spans(10, 10, 10, 1, 1) == ((60, 60), (120, 120))


def test_comm_bound_runs_every_all_to_all_back_to_back():
    # forward: attn A 0-1, then the four all-to-alls of 10 one after another (1-41), and nothing after the
    # last combine: span = 1 + 40; backward: the four gradients 0-40, then attn_bwd A (2) after the last
    assert _spans(1, 1, 1, 10, 10) == ((41, 6), (42, 12))


def test_the_order_decides_what_waits():
    # forward: attn A 0-4, dispatch A 4-9; attn B 4-8, but counts B queues behind dispatch A (9): 1 idle;
    # dispatch B 9-14, experts A 9-11, combine A 14-19, experts B waits for dispatch B (3 idle) 14-16,
    # combine B 19-24, shared A 16-19, shared B 19-22, waits for combine B (2 idle): 24, 6 exposed.
    # backward: combine_grad B 0-5, shared_bwd B 0-6, combine_grad A 6-11, shared_bwd A 6-12,
    # experts_bwd B 12-16, dispatch_grad B 16-21, experts_bwd A 16-20, dispatch_grad A 21-26,
    # attn_bwd B waits for dispatch_grad B (1 idle) 21-29, attn_bwd A 29-37: 1 exposed
    assert _spans(4, 2, 3, 5, 5) == ((24, 18), (37, 36))
    # the same three ops, the all-to-all issued before or after the independent compute
    first = [("comm", "a", "A"), ("compute", "x", "A"), ("wait", "a", "A"), ("compute", "y", "A")]
    after = [("compute", "x", "A"), ("comm", "a", "A"), ("wait", "a", "A"), ("compute", "y", "A")]
    assert simulate(first, {"a": 10, "x": 10, "y": 10}) == (20, 20)
    assert simulate(after, {"a": 10, "x": 10, "y": 10}) == (30, 20)


def test_exposed_halves_the_micro_batch_and_adds_the_recompute():
    """The micro-batch's durations are twice the halves' above (counts stay whole); the exposure is 6 + 1
    (test_the_order_decides_what_waits). Full checkpointing reruns the forward first: with "keep" compute
    only (18 s: the backward starts at 18 with the comm stream free, the same 1 s exposed), with
    "resend" its all-to-alls too (the forward's 6 s again)."""
    compute = {"forward": {"attn": 8, "experts": 4, "shared": 6}, "recompute": {"attn": 8, "experts": 4, "shared": 6}}
    comm = {"counts": (0, 0), "dispatch": (10, 10), "combine": (10, 10)}
    assert exposed_s(compute, comm) == pytest.approx(7)
    assert exposed_s(compute, comm, "full", "keep") == pytest.approx(7)
    assert exposed_s(compute, comm, "full", "resend") == pytest.approx(13)


def test_recompute_reruns_what_activation_checkpointing_wraps():
    assert recompute_ops("none", "resend") == ()
    assert recompute_ops("full", "resend") == FORWARD
    assert {op[0] for op in recompute_ops("full", "keep")} == {"compute"}
    selective = recompute_ops("selective", "resend")  # attention + routed experts, their dispatch and combine
    assert {name for _, name, _ in selective} == {"attn", "experts", "dispatch", "combine"}


# -- micro-batch pairing: per half, forward attn 1, experts 2, shared 1, dispatch 3, combine 3 (counts 0);
# backward 2x the compute, gradients 3 each; no checkpointing
PAIR_COMPUTE = {"forward": {"attn": 2, "experts": 4, "shared": 2}, "recompute": {"attn": 0, "experts": 0, "shared": 0}}
PAIR_COMM = {"counts": (0, 0), "dispatch": (6, 6), "combine": (6, 6)}


def test_paired_program_on_three_layers_by_hand():
    """Alone, a layer's forward exposes 5 (span 13, compute 8: experts A waits dispatch A 2, experts B
    dispatch B 1, shared B's end combine B 2; the counts have a stream of their own) and its backward 1
    (span 17, compute 16): 6 per layer and micro-batch. Paired on 3 layers, only B's top layer (2) takes
    F's chunks (F's layer 0); from B's layer 1 on F's next chunk touches layers 0 and 1 (the crossing), so
    it waits until B is done:
      B2: combine_grad B 0-3, shared_bwd B 0-2, combine_grad A 3-6, shared_bwd A 2-4;
          F chunk 0: attn A 4-5, counts A (own stream), dispatch A behind combine_grad A 6-9, attn B 5-6,
          counts B, dispatch B 9-12;
          B waits combine_grad B (done 3), experts_bwd B 6-10, dispatch_grad B 12-15;
          F chunk 1: dispatch A done, experts A 10-12, combine A 15-18;
          B: experts_bwd A 12-16, dispatch_grad A 18-21;
          F chunk 2: experts B 16-18, combine B 21-24, shared A 18-19;
          B: attn_bwd B 19-21; F chunk 3: shared B 21-22; B waits dispatch_grad A (21): attn_bwd A 22-24;
      B1 from 24 and B0 from 41: 1 idle each, as alone (ends 58);
      F's layers 0 (its last combine, done at 24), 1 and 2 alone: 5 idle each (58-71, 71-84).
    Pair: span 84 - compute 72 (B 3 x 16, F 3 x 8) = 12 against 18 unpaired. Per step with M = 2:
    F(0) and B(1) alone (3 x 6) + the pair = 30 against 36; with M = 1 the unpaired 18."""
    assert exposed_s(PAIR_COMPUTE, PAIR_COMM) == 6
    program = paired_program(3)
    assert [layer for who, layer, _ in (op[2] for op in program) if who == "F"][:8] == [0] * 8  # chunk 0 first
    assert simulate(program, {**_pair_seconds()}) == (84, 72)
    assert step_exposed_s(PAIR_COMPUTE, PAIR_COMM, 3, 2, paired=True) == 30
    assert step_exposed_s(PAIR_COMPUTE, PAIR_COMM, 3, 2) == 36
    assert step_exposed_s(PAIR_COMPUTE, PAIR_COMM, 3, 1, paired=True) == step_exposed_s(PAIR_COMPUTE, PAIR_COMM, 3, 1)


def _pair_seconds(compute=PAIR_COMPUTE):
    forward, recompute, backward = ep_timeline.op_seconds(compute, PAIR_COMM)
    return forward | {f"re_{name}": s for name, s in recompute.items()} | backward


def test_recompute_ahead_by_hand():
    """parallel.ep_recompute_ahead, the durations above with full checkpointing and keep (the recompute
    reruns the forward's compute: attn 1, experts 2, shared 1 per half, 8 per layer; backward 16; every
    all-to-all 3). B alone on 2 layers: re(1) 0-8; layer 1's backward from 8 as before (cg B 8-11,
    shared_bwd 8-12, cg A 11-14, experts_bwd B 12-16, dg B 16-19, experts_bwd A 16-20, dg A 20-23), then
    at its dispatch-gradient B wait re(0) 20-28, attn_bwd B 28-30, attn_bwd A 30-32 (dg A done at 23: no
    idle, against 1 at 20-23 before); layer 0 from 32 waits dg A (1 idle): span 49 - compute 48 = 1
    against 2. Unpaired, M = 2: 2 x (F 2 x 5 + B 1) = 22 against 24.
    Paired on 3 layers: in B's layer 2 F's chunk 2 (experts B 24-26, combine B 29-32, shared A 26-27),
    then re(1) 27-35, then B waits dg B (23): B runs 0-40 without idle; B1 (no recompute at its start)
    40-64 with re(0) 52-60, no idle; B0 64-81, 1 idle (dg A 76-79); F's layers 1 and 2 alone, 5 each:
    span 107 - compute 96 (B 3 x 24, F 3 x 8) = 11 against 12. Step with M = 2: 15 + 1 + 11 = 27 against 30."""
    compute = {"forward": PAIR_COMPUTE["forward"], "recompute": PAIR_COMPUTE["forward"]}
    rerun = recompute_ops("full", "keep")
    seconds = _pair_seconds(compute)
    program = paired_program(3, rerun, ahead=True)
    tags = [(name, who, layer) for _, name, (who, layer, _) in program]
    assert AHEAD == ("wait", "dispatch_grad", "B")
    wait = program.index(("wait", "dispatch_grad", ("B", 2, "B")))
    assert tags[wait - 8:wait - 6] == [("combine", "F", 0), ("shared", "F", 0)]  # F's chunk 2's end, then
    assert tags[wait - 6:wait] == [(f"re_{name}", "B", 1) for _, name, _ in rerun]  # layer 1's recompute
    assert [layer for name, who, layer in tags if name.startswith("re_")] == [2] * 6 + [1] * 6 + [0] * 6
    assert simulate(backward_program(2, rerun), seconds) == (50, 48)
    assert simulate(backward_program(2, rerun, ahead=True), seconds) == (49, 48)
    assert (step_exposed_s(compute, PAIR_COMM, 2, 2, "full", "keep", ahead=True),
            step_exposed_s(compute, PAIR_COMM, 2, 2, "full", "keep")) == (22, 24)
    assert simulate(program, seconds) == (107, 96)
    assert simulate(paired_program(3, rerun), seconds) == (108, 96)
    args = (compute, PAIR_COMM, 3, 2, "full", "keep")
    assert (step_exposed_s(*args, paired=True, ahead=True), step_exposed_s(*args, paired=True)) == (27, 30)


def test_forward_chunks_and_the_crossing_rule():
    """4 n + 1 chunks, cut before F's dispatch and combine waits (its count waits stay inside); on 5 layers
    B's layers 4 and 3 take F's layers 0 and 1, F's chunk across layers 1-2 waits through B's layers 2
    and 1 (touching B's layer or the one below it), and runs in B's layer 0."""
    chunks = forward_chunks(5)
    assert len(chunks) == 21 and [sorted(c[0]) for c in chunks[:6]] == [[0], [0], [0], [0], [0, 1], [1]]
    assert all(op[0] != "wait" or op[1] == "counts" for _, ops in chunks for op in ops[1:])
    assert forward_layers_started(5) == {4: 1, 3: 2, 2: 2, 1: 2, 0: 3}
    assert unpaired_layers(5) == 2 and paired_kept_layers(5) == 6  # B's 5 + F's 1 at the top
    assert (unpaired_layers(60), paired_kept_layers(60)) == (3, 61)  # K2
    assert (unpaired_layers(58), paired_kept_layers(58)) == (3, 59)  # DeepSeek-V3
    assert len(paired_program(60, recompute_ops("full", "keep"))) == 60 * (6 + len(BACKWARD) + len(FORWARD))


# K2's per-op milliseconds on its config (benchmarks/step_projection.py, 1x2x128, bf16, FP8 dispatch and
# combine gradient): compute per micro-batch, all-to-alls (forward, backward) per exchange
K2_COMPUTE = {"attn": 2.22, "experts": 5.31, "shared": 0.52}
K2_COMM = {"counts": (0.0, 0.0), "dispatch": (5.51, 11.01), "combine": (11.01, 5.51)}


def test_pairing_exposes_less_around_k2s_shapes():
    """Around K2's config (compute x 0.5..2, forward all-to-alls x 0.5..2, the combine gradient in FP8: at
    most half the dispatch gradient), 60 layers, 4 micro-batches, full checkpointing with keep: pairing
    never projects more exposure than without, and on K2 itself (these rounded ms) 1.99 against 3.55 s."""
    for scale_c, scale_f, scale_g in itertools.product((0.5, 1, 2), repeat=3):
        compute = {k: v * scale_c for k, v in K2_COMPUTE.items()}
        comm = {"counts": (0.0, 0.0), "dispatch": (5.51 * scale_f, 11.01 * scale_g),
                "combine": (11.01 * scale_f, 5.51 * scale_g)}
        args = ({"forward": compute, "recompute": compute}, comm, 60, 4, "full", "keep")
        assert step_exposed_s(*args, paired=True) <= step_exposed_s(*args)
        for paired in (False, True):  # the recompute ahead neither
            assert step_exposed_s(*args, paired=paired, ahead=True) <= step_exposed_s(*args, paired=paired)
    args = ({"forward": K2_COMPUTE, "recompute": K2_COMPUTE}, K2_COMM, 60, 4, "full", "keep")
    assert step_exposed_s(*args) == pytest.approx(3546, abs=1)
    assert step_exposed_s(*args, paired=True) == pytest.approx(1988, abs=1)
    assert step_exposed_s(*args, ahead=True) == pytest.approx(2725, abs=1)
    assert step_exposed_s(*args, paired=True, ahead=True) == pytest.approx(951, abs=1)


def test_the_count_exchanges_own_stream_keeps_the_forwards_host_sync_off_the_gradients():
    """F's count exchange (a host sync inside its chunk) issued behind B's two combine gradients on one
    stream would wait for both: with a bf16 combine gradient twice the dispatch gradient, 4.4 / 10.6 / 1.0
    ms of attention / experts / shared compute, that projected 1525 ms paired against 1260 unpaired. On
    their own group (parallel/meshes.py `_counts_group`, the runtime's) the counts wait for nothing: 362."""
    compute = {"attn": 4.4, "experts": 10.6, "shared": 1.0}
    comm = {"counts": (0.0, 0.0), "dispatch": (2.8, 5.5), "combine": (5.5, 11.0)}
    args = ({"forward": compute, "recompute": compute}, comm, 60, 4, "full", "keep")
    assert step_exposed_s(*args, paired=True) == pytest.approx(362.25, abs=0.01)
    assert step_exposed_s(*args) == pytest.approx(1260, abs=0.01)
