"""Activation checkpointing (none | full | selective) changes memory, not math.

Same losses and gradients as `none` in fp32 (the recompute reruns the same ops on the same inputs,
so 1e-6 relative is a loose bound: observed bitwise), on one process and on the headline 8-rank
layout (cp=2, ep=8: the recomputed regions contain the cp K/V all-gather and the ep all-to-alls,
which must rerun in the same order on every rank), with router counts counted once. The peak
tensor memory of one forward/backward (measured by torch's MemTracker) drops. A backward split in two
(the input's gradient, then the weights', as zero-bubble pipeline schedules run it) recomputes each
region twice and still gives the same gradients, counts and QK-clip maxima; the keep tape replays from
its start each time.
"""

import pytest
import torch

from models import Transformer, preset
from multirank import run_ranks
from optim.qk_clip import enable_recording, step_max_logits
from parallel.activation_checkpoint import MODES, apply_activation_checkpoint
from parallel.ep import keep
from parallel.gradients import global_loss, loss_fn
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize
from parity_cases import AC_RTOL, BATCH, HEADLINE, SEQ, WORLD, _assert_same, _local_batch, _model, _single


def _headline(rank, world_size) -> dict:
    out = {}
    for mode in MODES:
        model = _model("headline_cp2_ep8")
        layout = HEADLINE.resolve(world_size, activation_checkpoint=mode)
        meshes = build_meshes(layout, "cpu")
        parallelize(model, meshes, layout)
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


def _split_backward(mode: str) -> dict:
    """One process, the blocks run on a detached input: d loss / d input first (`autograd.grad`, graph
    kept), then d loss / d weights in a second backward pass. Under checkpointing the second pass
    recomputes every region again (torch's checkpoint recomputes once per backward that reads them)."""
    torch.manual_seed(0)
    model = Transformer(preset("debug"))
    model.init_weights()
    apply_activation_checkpoint(model, mode)
    enable_recording(model)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    h_BSD = model.tok_embeddings(tokens[:, :-1]).detach().requires_grad_()
    x_BSD = h_BSD
    for block in model.layers:
        x_BSD = block(x_BSD, torch.arange(SEQ))
    loss = loss_fn(model.output(model.norm(x_BSD)), tokens[:, 1:], BATCH * SEQ)
    (input_grad,) = torch.autograd.grad(loss, [h_BSD], retain_graph=True)
    names, weights = zip(*model.layers.named_parameters())
    grads = dict(zip(names, torch.autograd.grad(loss, weights)))
    return {"loss": loss.item(), "grads": grads, "input_grad": input_grad, "max_logits": step_max_logits(model),
            "counts": [r.tokens_per_expert.clone() for r in model.routers()],
            "recording": [a.sdpa.record_max_logits for a in (block.attention for block in model.layers)]}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_backward_split_in_two_recomputes_twice_with_the_same_results(mode):
    """Each recompute restores the routers' counts and pauses QK-clip recording anew (before: the
    recompute's context could be entered once, and the second backward failed)."""
    ref, got = _split_backward("none"), _split_backward(mode)
    _assert_same(got, ref, f"split backward, {mode}")
    scale = ref["input_grad"].abs().max()
    assert (got["input_grad"] - ref["input_grad"]).abs().max() <= AC_RTOL * scale
    assert torch.equal(got["max_logits"], ref["max_logits"]) and all(got["recording"])


class _Dispatcher:
    """What parallel/ep/keep.py reads of an EP dispatcher: its `tape` slot."""

    tape = None


def test_the_keep_tape_replays_from_its_start_at_each_recompute():
    """Forward: two exchanges recorded. Each of two recomputes reads both back, in order, sending nothing;
    outside the contexts the dispatcher holds no tape and exchanges run."""
    dispatchers, sent = [_Dispatcher(), _Dispatcher()], []

    def exchange(value):
        sent.append(value)
        return torch.tensor([value])

    forward, replay = keep.contexts(dispatchers)
    with forward:
        assert dispatchers[0].tape is dispatchers[1].tape is not None
        recorded = [keep.kept(d.tape, kind, lambda v=v: exchange(v)) for d, kind, v in
                    zip(dispatchers, ("counts", "rows"), (3, 4))]
    for _ in range(2):
        with replay():
            replayed = [keep.kept(d.tape, kind, lambda: exchange(-1))
                        for d, kind in zip(dispatchers, ("counts", "rows"))]
        assert [r.item() for r in replayed] == [r.item() for r in recorded] == [3, 4]
    assert sent == [3, 4] and all(d.tape is None for d in dispatchers)
    assert keep.kept(dispatchers[0].tape, "counts", lambda: exchange(5)).item() == 5 and sent == [3, 4, 5]
