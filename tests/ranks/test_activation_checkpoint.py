"""Activation checkpointing (none | full | selective) changes memory, not math.

Same losses and gradients as `none` in fp32 (the recompute reruns the same ops on the same inputs,
so 1e-6 relative is a loose bound: observed bitwise), on one process and on the headline 8-rank
layout (cp=2, ep=8: the recomputed regions contain the cp K/V all-gather and the ep all-to-alls,
which must rerun in the same order on every rank), with router counts counted once. The peak
tensor memory of one forward/backward (measured by torch's MemTracker) drops.
"""

import pytest

from multirank import run_ranks
from parallel.activation_checkpoint import MODES
from parallel.gradients import global_loss, loss_fn
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize
from parity_cases import BATCH, HEADLINE, SEQ, WORLD, _assert_same, _local_batch, _model, _single


def _headline(rank, world_size) -> dict:
    out = {}
    for mode in MODES:
        model = _model("headline_cp2_ep8")
        layout = HEADLINE.resolve(world_size)
        meshes = build_meshes(layout, "cpu")
        parallelize(model, meshes, layout, activation_checkpoint=mode)
        inputs, labels, positions = _local_batch(model.config.vocab_size, layout, meshes)
        loss = loss_fn(model(inputs, positions_S=positions), labels, BATCH * SEQ)
        loss.backward()
        out[mode] = {"loss": global_loss(loss).item(), "counts": [r.tokens_per_expert.clone() for r in model.routers()],
                     "grads": {k: p.grad.to_local() for k, p in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def single():
    return {mode: _single(mode) for mode in MODES}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_one_process_same_losses_grads_and_counts(single, mode):
    _assert_same(single[mode], single["none"], f"1 process, {mode}")
    assert sum(c.sum() for c in single[mode]["counts"]) == BATCH * SEQ * 2 * 2  # 2 MoE layers, top-2


def test_headline_8_ranks_cp_and_ep_recomputed_in_step():
    per_rank = run_ranks(_headline, WORLD, timeout=300)
    for rank, by_mode in enumerate(per_rank):
        for mode in ("full", "selective"):
            _assert_same(by_mode[mode], by_mode["none"], f"rank {rank}, {mode}")


def test_peak_memory_drops(single):
    """debug preset, 8 x 32 tokens: full keeps one block input per layer, selective drops attention and experts."""
    peaks = {mode: single[mode]["peak"] for mode in MODES}
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
