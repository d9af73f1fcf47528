"""The output head's chunked losses (models/output_head.py) against plain autograd over whole logits: the
head alone, and the post-training objective, whose student used to compute every position's logits and the
losses over them in one piece (written out below as `whole_logits_student`, the reference)."""

import json

import pytest
import torch
import torch.nn.functional as F

from models.output_head import LossPart, OutputHead
from runtime.posttrain import feedback
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective, feedback_kl
from runtime.posttrain.rollout_batch import RolloutLoader
from posttrain_cases import Data, many_feedback_record, records
from seeded_models import seeded_model


def whole_logits_student(model, mb, data, step, c: PosttrainConfig) -> torch.Tensor:
    """The student before chunking: every position's logits [B, S, V], then the losses over them; backward
    run, the loss returned (benchmarks/output_head.py measures the same computation as its baseline)."""
    logits_TV = model(mb.inputs_BS, mb.positions_S, documents=mb.documents).flatten(0, 1)
    logp_n = feedback.token_logp(logits_TV[mb.trained_flat_n], mb.labels_n)
    old_n = torch.where(mb.has_old_n, mb.old_logp_n, logp_n.detach())
    rl_sum, _ = feedback.ppo_loss(logp_n, old_n, mb.advantages_n, c.clip_eps)
    kl_sum = feedback_kl(logits_TV[mb.target_flat_m], mb.target_labels_m, data, c).sum() if data else 0.0
    n_feedback = step.target_tokens if c.feedback_norm == "targets" else step.trained_tokens
    loss = (c.sft_coef * -logp_n.sum() + c.rl_coef * rl_sum) / step.trained_tokens + c.feedback_coef * kl_sum / n_feedback
    loss.backward()
    return loss.detach()


def _parts(g: torch.Generator, T: int, V: int) -> list[tuple[torch.Tensor, callable]]:
    """Two parts over rows of x in no particular order, with repeats: a weighted log-prob sum and a
    softmax-weighted sum (both with a gradient everywhere in the chunk's logits)."""
    idx_a, idx_b = torch.randint(0, T, (13,), generator=g), torch.randint(0, T, (6,), generator=g)
    labels, w = torch.randint(0, V, (13,), generator=g), torch.randn(6, V, generator=g)

    def a(logits, lo, hi):
        logp = F.log_softmax(logits.float(), -1).gather(1, labels[lo:hi, None]).squeeze(1)
        return torch.stack([logp.sum(), (logp * 0).sum(), torch.tensor(float(hi - lo))])

    def b(logits, lo, hi):
        value = (torch.softmax(logits.float(), -1) * w[lo:hi]).sum()
        return torch.stack([2 * value, value, torch.tensor(0.0)])
    return [(idx_a, a), (idx_b, b)]


@pytest.mark.parametrize("chunk", [1, 4, 13, 1000])
def test_chunked_head_equals_whole_logits(chunk):
    """Sums, and the gradients of x and the weight, against one head call and autograd (fp32). Measured
    within 1.5e-7 (relative; of each gradient's largest entry); allowed 1e-6."""
    g = torch.Generator().manual_seed(0)
    T, D, V = 17, 8, 11
    head = OutputHead(D, V)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    x = torch.randn(T, D, generator=g, requires_grad=True)
    parts = _parts(g, T, V)
    grad_K = torch.tensor([1.0, -0.5, 0.0])

    got = head(x, [LossPart(i, fn) for i, fn in parts], chunk)
    got.backward(grad_K)
    got_x, got_w = x.grad.clone(), head.weight.grad.clone()
    x.grad, head.weight.grad = None, None

    logits = head(x)
    want = sum(fn(logits[i], 0, len(i)) for i, fn in parts)
    want.backward(grad_K)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    for mine, ref in ((got_x, x.grad), (got_w, head.weight.grad)):
        assert (mine - ref).abs().max() <= 1e-6 * ref.abs().max(), (mine - ref).abs().max()


def test_empty_part_still_reaches_every_parameter():
    """A rank with no trained token (a slot of padding) still backpropagates zeros through the head, so every
    FSDP unit's gradient hook fires on every rank."""
    head = OutputHead(4, 5)
    x = torch.randn(3, 4, requires_grad=True)
    out = head(x, [LossPart(torch.zeros(0, dtype=torch.int64), lambda logits, lo, hi: logits.float().sum()[None])], 2)
    out.sum().backward()
    assert out.item() == 0 and (x.grad == 0).all() and (head.weight.grad == 0).all()


@pytest.mark.parametrize("mode", ["full", "topk", "sampled"])
def test_objective_with_chunked_head_equals_whole_logits(tmp_path, mode):
    """The whole objective (sft, RL and feedback KL all on; two packed micro-batches of trajectories with many
    flagged turns and the fixture's two) with a 7-token head chunk, against the whole-logits student: loss and
    every parameter's gradient, fp32. Measured <= 1.4e-7 relative on the loss and <= 1.04e-6 of each
    gradient's largest entry (summation order); allowed 1e-6 and 5e-6. Dropping each chunk's last row moves
    them by 0.15 and 0.57-0.80."""
    path = tmp_path / "r.jsonl"
    rows = records() + [many_feedback_record(i, 40 + 9 * i, 256) for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = seeded_model("debug", init="default")
    data = Data(str(path))
    data.batch_tokens = 10_000
    step = RolloutLoader(data, seed=0, vocab_size=256, max_seq_len=256, grad_accum=2).batch(0)
    config = PosttrainConfig(sft_coef=0.2, rl_coef=0.7, feedback_coef=1.3, mode=mode, top_k=8, vocab_chunk=50,
                             head_chunk=7)
    objective = FeedbackObjective(config)
    loss, _, metrics = objective.forward_backward(model, step, torch.device("cpu"))
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    want = 0.0
    for mb in step.micro_batches:
        teacher_data, _ = objective._teacher(model, mb)
        want += whole_logits_student(model, mb, teacher_data, step, config).item()
    assert metrics["target_tokens"] > 100 and len(step.micro_batches) == 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    for k, p in model.named_parameters():
        err, scale = (got[k] - p.grad).abs().max().item(), p.grad.abs().max().item()
        assert err <= 5e-6 * scale + 1e-12, (k, err, scale)
