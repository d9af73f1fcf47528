"""The post-training losses (runtime/posttrain/feedback.py) against their definitions: plainly written loops in
float64 and hand-computed cases.

Tolerances: the chunked KL and the loops compute the same sums in fp32 vs float64 and in another
order. Measured here: per-token KL values up to 3.1 differ by <= 3.6e-6 (1.2e-6 relative), logit
gradients up to 0.64 by <= 1.5e-7; so rtol 1e-5 / atol 1e-6 has margin for other CPUs, and still
catches any wrong term (a missing -kl in the gradient, a wrong normalizer or tail are O(1) errors).
"""

import math

import pytest
import torch

from runtime.posttrain import feedback

N, V = 12, 256


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(N, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _plain_kl(student_NV: torch.Tensor, teacher_NV: torch.Tensor) -> torch.Tensor:
    """Per token: sum_v p_s(v) (log p_s(v) - log p_t(v)), one token at a time, float64."""
    out = []
    for n in range(student_NV.shape[0]):
        p = torch.softmax(student_NV[n].double(), 0)
        q = torch.softmax(teacher_NV[n].double(), 0)
        out.append((p * (p.log() - q.log())).sum())
    return torch.stack(out)


def _value_and_grad(fn, student_NV, *args):
    student = student_NV.clone().requires_grad_(True)
    weights_N = torch.linspace(0.5, 1.5, N)  # a non-uniform upstream gradient exercises grad_N
    (fn(student, *args) * weights_N.to(fn(student, *args).dtype)).sum().backward()
    return fn(student.detach(), *args).double(), student.grad.double()


@pytest.mark.parametrize("chunk", [V, 100, 7])  # whole vocabulary, uneven chunks, many small chunks
def test_full_kl_equals_plain_loop(chunk):
    student, teacher = _logits(0), _logits(1)
    got, got_grad = _value_and_grad(lambda s: feedback.kl_full(s, teacher, chunk), student)
    want, want_grad = _value_and_grad(lambda s: _plain_kl(s, teacher), student)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_full_kl_sends_no_gradient_to_the_teacher():
    teacher = _logits(1).requires_grad_(True)
    feedback.kl_full(_logits(0).requires_grad_(True), teacher).sum().backward()
    assert teacher.grad is None


def test_topk_with_k_equal_vocab_equals_full():
    student, teacher = _logits(0), _logits(1)
    logp_NK, idx_NK, tail = feedback.teacher_topk(teacher, V)
    assert tail is None
    got, got_grad = _value_and_grad(lambda s: feedback.kl_topk(s, logp_NK, idx_NK, tail), student)
    want, want_grad = _value_and_grad(lambda s: feedback.kl_full(s, teacher), student)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_topk_with_tail_bucket_is_the_kl_of_k_plus_one_buckets():
    """Against the definition: coarse-grain both distributions into the teacher's top-k tokens and one
    bucket for the rest, then the plain KL over those k+1 buckets."""
    student, teacher, k = _logits(0), _logits(1), 5
    got = feedback.kl_topk(student, *feedback.teacher_topk(teacher, k)).double()
    for n in range(N):
        p, q = torch.softmax(student[n].double(), 0), torch.softmax(teacher[n].double(), 0)
        top = q.topk(k).indices
        rest = torch.ones(V, dtype=torch.bool)
        rest[top] = False
        pb = torch.cat([p[top], p[rest].sum()[None]])
        qb = torch.cat([q[top], q[rest].sum()[None]])
        assert got[n].item() == pytest.approx((pb * (pb.log() - qb.log())).sum().item(), rel=1e-5, abs=1e-6)
    coarse = feedback.kl_topk(student, *feedback.teacher_topk(teacher, k))
    assert (coarse <= feedback.kl_full(student, teacher) + 1e-6).all()  # coarse-graining never raises a KL


def test_sampled_matches_hand_computed_case():
    """p_s = (1/4, 1/2, 1/4), p_t = (1/2, 1/4, 1/4), sampled token 1: r = log(1/2) - log(1/4) = log 2.
    Value r; gradient r * d log p_s(1) / dz = log 2 * (onehot(1) - p_s) = log 2 * (-1/4, 1/2, -1/4)."""
    student = torch.tensor([[0.0, math.log(2.0), 0.0]], requires_grad=True)
    teacher = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    token = torch.tensor([1])
    loss = feedback.kl_sampled(feedback.token_logp(student, token), feedback.token_logp(teacher, token))
    assert loss.item() == pytest.approx(math.log(2.0), rel=1e-6)
    loss.sum().backward()
    expected = math.log(2.0) * torch.tensor([[-0.25, 0.5, -0.25]])
    torch.testing.assert_close(student.grad, expected, rtol=1e-6, atol=1e-7)


def test_ppo_hand_computed_cases():
    """ratio = 0.5 / 0.25 = 2, eps = 0.2. A = +1: min(2, 1.2) = 1.2 is the clipped term (no gradient).
    A = -1: min(-2, -1.2) = -2, unclipped, d(-ratio*A)/d logp = ratio = 2. Without a behaviour log-prob
    (old = logp.detach()) the ratio is 1 and the gradient is -A."""
    logp = torch.tensor([math.log(0.5)] * 3, requires_grad=True)
    old = torch.tensor([math.log(0.25), math.log(0.25), 0.0])
    old = torch.where(torch.tensor([True, True, False]), old, logp.detach())
    adv = torch.tensor([1.0, -1.0, 3.0])
    loss, clipped = feedback.ppo_loss(logp, old, adv, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2 + 2.0 - 3.0, rel=1e-6)
    assert clipped.item() == 1
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 2.0, -3.0]))


def _saved_bytes(fn, inputs) -> int:
    """Bytes of new storage autograd keeps for backward (the inputs themselves not counted)."""
    seen, total = {t.untyped_storage().data_ptr() for t in inputs}, 0

    def pack(x):
        nonlocal total
        if x.untyped_storage().data_ptr() not in seen:
            seen.add(x.untyped_storage().data_ptr())
            total += x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return total


def test_full_kl_keeps_no_vocabulary_sized_intermediates():
    """Memory proxy (CPU-countable): what autograd saves for backward. A plain softmax/log_softmax KL
    keeps 3 tensors of N x V (measured 24 MB for N=64, V=32768, logits 8 MB); the chunked function only
    the N-sized logsumexps and KL (0.75 KB), recomputing each chunk in backward."""
    student, teacher = torch.randn(64, 32768, requires_grad=True), torch.randn(64, 32768)
    plain = _saved_bytes(lambda: (torch.softmax(student, -1) * (torch.log_softmax(student, -1)
                                                                - torch.log_softmax(teacher, -1))).sum(-1),
                         [student, teacher])
    chunked = _saved_bytes(lambda: feedback.kl_full(student, teacher, chunk=4096), [student, teacher])
    assert plain >= 3 * student.numel() * 4
    assert chunked <= 3 * 64 * 4
