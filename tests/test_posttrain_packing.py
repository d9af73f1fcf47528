"""Packed rows (runtime/posttrain/rollout_batch.py: a slot's trajectories end to end in one row, document masking,
student and teacher) against one trajectory per row padded to the longest (the layout packing
replaced): the same losses, metrics and gradients; `padding_fraction` on mixed lengths."""

import pytest
import torch

from models import Transformer, preset
from posttrain_cases import many_feedback_record
from runtime.posttrain.objective import FeedbackObjective, PosttrainConfig
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import trajectory_from_record

VOCAB, MAX_LEN = 256, 256
LENGTHS = (200, 31, 97, 12, 150, 64)  # mixed: one row per trajectory pads ~45% of the student positions
KEYS = ("loss", "rl_loss", "sft_loss", "feedback_kl", "clip_fraction", "teacher_entropy", "target_tokens",
        "teacher_tokens")
# fp32 both sides; the packed row runs masked attention blocks where the padded rows ran the flash
# kernel, and other matmul shapes: measured <= 3.8e-7 relative on the losses, <= 5e-7 relative (of the
# largest entry) on the gradients.
RTOL = 1e-5


def _step(pack: bool, grad_accum: int = 1):
    records = [many_feedback_record(i, n, VOCAB) for i, n in enumerate(LENGTHS)]
    for r in records[::2]:
        r["logprobs"] = [-5.0] * len(r["tokens"])
    trajs = [trajectory_from_record(r, VOCAB, MAX_LEN) for r in records]
    data = type("Data", (), {"batch_tokens": sum(t.cost() for t in trajs)})
    return RolloutLoader(data, seed=0, vocab_size=VOCAB, max_seq_len=MAX_LEN, trajectories=trajs, pack=pack,
                         grad_accum=grad_accum).batch(0)


def _run(step, mode: str):
    torch.manual_seed(0)
    model = Transformer(preset("debug"))
    model.init_weights(torch.Generator().manual_seed(0))
    objective = FeedbackObjective(PosttrainConfig(mode=mode, sft_coef=0.5))
    loss, _, metrics = objective.forward_backward(model, step, torch.device("cpu"))
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return {**metrics, "loss": loss.item()}, grads


@pytest.mark.parametrize("mode", ["full", "topk"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_packed_rows_equal_padded_rows(mode, grad_accum):
    packed, padded = _step(True, grad_accum), _step(False, grad_accum)
    assert all(mb.inputs_BS.shape[0] == 1 for mb in packed.micro_batches)
    (m_packed, g_packed), (m_padded, g_padded) = _run(packed, mode), _run(padded, mode)
    for key in KEYS:
        assert m_packed[key] == pytest.approx(m_padded[key], rel=RTOL), key
    assert g_packed.keys() == g_padded.keys()
    for k in g_packed:
        torch.testing.assert_close(g_packed[k], g_padded[k], rtol=0, atol=RTOL * g_padded[k].abs().max().item())


def test_padding_fraction_on_mixed_lengths():
    """Packed: only each row's tail (to a multiple of 2*cp) and the teacher's item rows (each padded to
    the slot's longest item) are padding; one row per trajectory pads to the longest."""
    packed, padded = _run(_step(True), "sampled")[0], _run(_step(False), "sampled")[0]
    # measured: 6.6% packed (the item rows' padding), 46.7% one trajectory per row
    assert packed["padding_fraction"] < 0.10 < padded["padding_fraction"]
