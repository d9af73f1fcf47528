"""Packed rows (runtime/posttrain/rollout_batch.py: a slot's trajectories end to end in one row, document masking,
student and teacher) against one trajectory per row padded to the longest (the layout packing
replaced): the same losses, metrics and gradients; `padding_fraction` on mixed lengths."""

import pytest
import torch

from posttrain_cases import many_feedback_record
from runtime.posttrain.objective import FeedbackObjective, PosttrainConfig
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import trajectory_from_record
from seeded_models import seeded_model

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
    model = seeded_model("debug", init="generator")
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


def _mixed_trajectories(n: int = 64, seed: int = 0):
    """n trajectories of 40-1,200 tokens in 2-8 turns of random lengths, user and assistant in turn; every
    third one flagged on its last two assistant turns (hints of 4-19 tokens): items of 5 to ~1,000 tokens."""
    import numpy as np

    rng, records = np.random.default_rng(seed), []
    for k in range(n):
        length = int(rng.integers(40, 1201))
        cuts = sorted(rng.choice(np.arange(5, length - 1), size=int(rng.integers(1, 8)), replace=False).tolist())
        bounds = [0, *cuts, length]
        turns = [{"role": "assistant" if i % 2 else "user", "start": a, "end": b}
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        record = {"tokens": rng.integers(0, VOCAB, length).tolist(), "turns": turns, "advantage": 0.5}
        flagged = [i for i, t in enumerate(turns) if t["role"] == "assistant"][-2:]
        if k % 3 == 0:
            record["feedback"] = [{"turn": i, "hint": rng.integers(0, VOCAB, int(rng.integers(4, 20))).tolist()}
                                  for i in flagged]
        records.append(record)
    return [trajectory_from_record(r, VOCAB, 4096) for r in records]


@pytest.mark.parametrize("budget", [16384, 10**9])
def test_padding_fraction_is_low_and_covers_the_same_positions_on_every_layout(budget):
    """64 mixed trajectories (a third flagged): `padding_fraction` as the objective reports it (padding over
    positions, summed over every rank's micro-batches) under 0.10 on 1 process and on dp x cp layouts up to
    8 ranks, and on each its unpadded positions are exactly the step's tokens (student and teacher):
    each forwarded position counted once. Before the item rows were packed (each padded to the slot's
    longest item): 0.246 on 1 process and 0.137 on dp 4 x cp 2 (steps of 16,384 tokens); now 0.0001 and
    0.0009."""
    trajs = _mixed_trajectories()
    data = type("Data", (), {"batch_tokens": budget})
    for dp, cp in [(1, 1), (1, 2), (4, 2), (8, 1), (2, 4)]:
        positions = padding = 0
        for d in range(dp):
            for c in range(cp):
                step = RolloutLoader(data, seed=0, vocab_size=VOCAB, max_seq_len=4096, trajectories=trajs, dp_rank=d,
                                     dp_degree=dp, cp_rank=c, cp_degree=cp).batch(0)
                positions += sum(mb.positions for mb in step.micro_batches)
                padding += sum(mb.padding for mb in step.micro_batches)
        assert positions - padding == step.tokens, (dp, cp)
        assert padding / positions < 0.10, (dp, cp, padding / positions)
