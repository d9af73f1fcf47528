"""The post-training objective on the debug model, one process: locality of the feedback gradient,
`full` mode against a plainly written per-token KL loop over separately run teacher sequences, and
the modes against each other through the whole objective."""

import json

import pytest
import torch

from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective
from runtime.posttrain.rollout_batch import RolloutLoader
from posttrain_cases import Data, records
from seeded_models import seeded_model

@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    model = seeded_model("debug", init="default")
    step = RolloutLoader(Data(str(path)), seed=0, vocab_size=256, max_seq_len=256).batch(0)
    return model, step


def _capture_head_input(model, store):
    def hook(module, args, output):
        if output.requires_grad:  # the student forward (the teacher's runs under no_grad)
            output.retain_grad()
            store.append(output)
    return model.norm.register_forward_hook(hook)


def test_feedback_gradient_is_zero_outside_target_turns(setup):
    """The gradient reaching the head's input (the final norm's output, per position): the head runs only at
    trained and target positions, so a loss reading a wrong position would show here."""
    model, step = setup
    (mb,) = step.micro_batches
    captured = []
    handle = _capture_head_input(model, captured)
    objective = FeedbackObjective(PosttrainConfig(rl_coef=0.0, feedback_coef=1.0, mode="full", head_chunk=5))
    objective.forward_backward(model, step, torch.device("cpu"))
    handle.remove()
    (student,) = captured
    grad_TD = student.grad.flatten(0, 1)
    target = torch.zeros(grad_TD.shape[0], dtype=torch.bool)
    target[mb.target_flat_m] = True
    assert target.sum().item() == step.target_tokens == (60 - 31) + (9 - 1)
    assert (grad_TD[~target] == 0).all()  # exactly zero: no loss term reads those logits
    assert (grad_TD[target].abs().sum(1) > 0).all()  # and every target position gets a gradient


def _plain_feedback_loss(model, records, sampled=False) -> torch.Tensor:
    """Mean over target tokens of KL(student || teacher), written out: one sequence per forward, no
    padding, teacher = tokens[:at] + hint + tokens[at:end], token j at positions j-1 / j+H-1.
    sampled: the on-policy distillation loss instead, r * log p_s(y) with r = stopgrad(log p_s(y) -
    log p_t(y)) and y = tokens[j] (gradient r * grad log p_s(y)); its value is returned as the mean r."""
    terms = []
    for r in records:
        student = model(torch.tensor([r["tokens"]]))[0]
        for item in r["feedback"]:
            turn, hint = r["turns"][item["turn"]], item["hint"]
            at = item.get("at", turn["start"])
            teacher_seq = r["tokens"][:at] + hint + r["tokens"][at:turn["end"]]
            with torch.no_grad():
                teacher = model(torch.tensor([teacher_seq]))[0]
            for j in range(max(turn["start"], 1), turn["end"]):
                p = torch.softmax(student[j - 1], 0)
                q = torch.softmax(teacher[j + len(hint) - 1], 0)
                if sampled:
                    y = r["tokens"][j]
                    ratio = (p[y].log() - q[y].log()).detach()
                    terms.append(ratio * p[y].log() - (ratio * p[y].log()).detach() + ratio)
                else:
                    terms.append((p * (p.log() - q.log())).sum())
    return torch.stack(terms).mean()


def _assistant_tokens(records) -> int:
    return sum(t["end"] - max(t["start"], 1) for r in records for t in r["turns"] if t["role"] == "assistant")


@pytest.mark.parametrize("mode,norm", [("full", "targets"), ("sampled", "targets"), ("full", "assistant")])
def test_mode_equals_plain_per_token_loop(setup, mode, norm):
    """Loss value and every parameter's gradient. fp32 both sides; they differ in batch composition
    (padded rows, both trajectories in one forward) and summation order: measured 2.1e-7 relative on
    the loss and <= 8.2e-7 of each gradient's largest entry; we allow 1e-5 and 2e-5 (a wrong alignment
    by one position, a missing target or a wrong normalizer changes them by > 1e-2)."""
    model, step = setup
    objective = FeedbackObjective(PosttrainConfig(rl_coef=0.0, feedback_coef=1.0, mode=mode, vocab_chunk=100,
                                                  feedback_norm=norm))
    loss, _, metrics = objective.forward_backward(model, step, torch.device("cpu"))
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    mean_kl = _plain_feedback_loss(model, records(), sampled=mode == "sampled")  # mean over the 37 targets
    want_loss = mean_kl if norm == "targets" else mean_kl * 37 / _assistant_tokens(records())
    want_loss.backward()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert metrics["feedback_kl"] == pytest.approx(mean_kl.item(), rel=1e-5)
    for k, p in model.named_parameters():
        if p.grad is None:  # parameters the plain loop never reaches (none expected)
            assert got[k] is None or got[k].abs().max() == 0, k
            continue
        err, scale = (got[k] - p.grad).abs().max().item(), p.grad.abs().max().item()
        assert err <= 2e-5 * scale + 1e-9, (k, err, scale)


def test_topk_full_vocab_equals_full_through_the_objective(setup):
    model, step = setup
    results = {}
    for mode, k in (("full", 32), ("topk", 256)):
        model.zero_grad(set_to_none=True)
        objective = FeedbackObjective(PosttrainConfig(rl_coef=0.3, feedback_coef=1.0, mode=mode, top_k=k))
        loss, _, metrics = objective.forward_backward(model, step, torch.device("cpu"))
        results[mode] = (loss.item(), metrics, model.output.weight.grad.clone())
    assert results["topk"][0] == pytest.approx(results["full"][0], rel=1e-5)
    torch.testing.assert_close(results["topk"][2], results["full"][2], rtol=1e-5, atol=1e-7)
    assert results["full"][1]["teacher_entropy"] > 0 and results["full"][1]["target_tokens"] == 37
