"""`posttrain.sft_coef`: the next-token loss over assistant tokens, against a plainly written masked
cross-entropy loop (one sequence per forward, no padding, F.cross_entropy), one process, fp32.
The 8-rank check runs end to end in tests/entry/test_posttrain_transcripts.py."""

import copy
import json
import random

import pytest
import torch
import torch.nn.functional as F

from examples.make_rollouts import trajectory
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import read_rollouts
from seeded_models import seeded_model


class _Data:
    def __init__(self, path, batch_tokens):
        self.path, self.batch_tokens = path, batch_tokens


@pytest.fixture
def setup(tmp_path):
    rng = random.Random(3)
    records = [trajectory(rng) for _ in range(6)]
    records[0]["turns"][0]["role"] = "assistant"  # an assistant turn at token 0: its first token has no label
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    budget = sum(t.cost() for t in read_rollouts(str(path), 256, 256))  # the whole file, once
    loader = RolloutLoader(_Data(str(path), budget), seed=0, vocab_size=256, max_seq_len=256,
                           grad_accum=2)  # two padded micro-batches
    step = loader.batch(0)
    ids = loader.plan.step(0)
    assert sorted(ids) == list(range(6))  # the plain loop sees the same trajectories
    model = seeded_model("debug", init="default")
    return model, step, records


def _plain_sft(model, records) -> torch.Tensor:
    """Sum over assistant tokens j >= 1 of -log p(tokens[j] | tokens[:j]), over their count."""
    total, count = 0.0, 0
    for r in records:
        tokens = torch.tensor(r["tokens"])
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        for t in r["turns"]:
            mask[t["start"]:t["end"]] |= t["role"] == "assistant"
        logits = model(tokens[None])[0, :-1].float()
        ce = F.cross_entropy(logits, tokens[1:], reduction="none")
        total = total + ce[mask[1:]].sum()
        count += int(mask[1:].sum())
    return total / count


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_sft_loss_and_gradients_match_a_plain_masked_cross_entropy(setup):
    """sft_coef alone: loss, `sft_loss` and every gradient equal the plain loop (fp32: 1e-5 relative;
    measured differences are fp32 summation order only)."""
    model, step, records = setup
    reference = copy.deepcopy(model)
    expected = _plain_sft(reference, records)
    expected.backward()
    objective = FeedbackObjective(PosttrainConfig(sft_coef=1.0, rl_coef=0.0, feedback_coef=0.0))
    loss, _, metrics = objective.forward_backward(model, step, torch.device("cpu"))
    assert metrics["sft_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for got, want in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert sum(g.abs().sum() for g in _grads(model)) > 0


def test_sft_term_adds_to_the_other_losses(setup):
    """loss(sft_coef=0.5) - loss(sft_coef=0) = 0.5 * L_sft with RL and feedback on; sft_loss is reported
    either way (it is the assistant tokens' NLL)."""
    model, step, records = setup
    with torch.no_grad():
        plain = _plain_sft(model, records).item()
    out = {}
    for coef in (0.0, 0.5):
        m = copy.deepcopy(model)
        loss, _, metrics = FeedbackObjective(PosttrainConfig(sft_coef=coef)).forward_backward(m, step, torch.device("cpu"))
        out[coef] = loss.item()
        assert metrics["sft_loss"] == pytest.approx(plain, rel=1e-5) and metrics["target_tokens"] > 0
    assert out[0.5] - out[0.0] == pytest.approx(0.5 * plain, rel=1e-5)


def test_negative_sft_coef_is_refused():
    with pytest.raises(ValueError, match=r"posttrain.sft_coef=-1.0 must be >= 0"):
        PosttrainConfig(sft_coef=-1.0)
