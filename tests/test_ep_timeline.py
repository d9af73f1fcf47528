"""benchmarks/lib/ep_timeline.py: the interleaved MoE block's two-stream program on hand-made durations,
each expected span worked out by hand (ops in FORWARD / BACKWARD order; a comm op starts when the comm
stream is free and the compute issued before it is done)."""

import pytest

from benchmarks.lib.ep_timeline import BACKWARD, FORWARD, exposed_s, recompute_ops, simulate


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
