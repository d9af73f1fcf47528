"""The post-training losses on gathered token rows: pure functions, no process group.

Every loss returns a SUM over its N tokens; the caller divides by the step's GLOBAL token count, so
the per-rank sums add up to the single-process mean (parallel/gradients.py convention).

  ppo_loss             token-level policy gradient with a clipped importance ratio (PPO, Schulman et
                       al. 2017, eq. 7): -min(r A, clip(r, 1-eps, 1+eps) A), r = pi(y) / pi_old(y).
  kl_full              KL(student || teacher) = sum_v p_s(v) (log p_s(v) - log p_t(v)), exact over the
                       vocabulary, computed in vocabulary chunks by a custom autograd function whose
                       extra memory is N x chunk (the logits themselves are N x V).
  kl_topk              the same KL over k+1 buckets: the teacher's top-k tokens and one tail bucket
                       holding each side's remaining mass (without it, mass escaping the top-k is
                       unpenalized and the loss is unstable).
  kl_sampled           the per-token log-ratio on the sampled token, r = log p_s(y) - log p_t(y), used as
                       a per-token advantage -r (on-policy distillation): value sum r (the k1 estimate
                       of the KL for y ~ student), gradient sum r * grad log p_s(y).

Letters: N tokens, V vocabulary, K teacher top-k.
"""

import torch
import torch.nn.functional as F


def ppo_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, adv_N: torch.Tensor,
             clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, number of tokens whose clipped term is the active one). Where there is no behaviour
    log-prob, pass old_logp = logp.detach(): the ratio is 1 and the gradient is A * grad log pi."""
    ratio_N = torch.exp(logp_N - old_logp_N)
    unclipped_N = ratio_N * adv_N
    clipped_N = torch.clamp(ratio_N, 1.0 - clip_eps, 1.0 + clip_eps) * adv_N
    return -torch.minimum(unclipped_N, clipped_N).sum(), (clipped_N < unclipped_N).sum()


class _ChunkedKL(torch.autograd.Function):
    """kl_N = KL(softmax(student_NV) || softmax(teacher_NV)), one vocabulary chunk at a time.

    Backward: d kl_n / d z_nv = p_s(v) * (log p_s(v) - log p_t(v) - kl_n), recomputed chunk by chunk.
    The teacher gets no gradient (it is stop-gradient by definition)."""

    @staticmethod
    def forward(ctx, student_NV, teacher_NV, chunk):
        lse_s_N, lse_t_N = _chunked_logsumexp(student_NV, chunk), _chunked_logsumexp(teacher_NV, chunk)
        kl_N = torch.zeros_like(lse_s_N)
        for lo in range(0, student_NV.shape[1], chunk):
            ls_NC = student_NV[:, lo:lo + chunk].float() - lse_s_N[:, None]
            lt_NC = teacher_NV[:, lo:lo + chunk].float() - lse_t_N[:, None]
            kl_N += (ls_NC.exp() * (ls_NC - lt_NC)).sum(1)
        ctx.save_for_backward(student_NV, teacher_NV, lse_s_N, lse_t_N, kl_N)
        ctx.chunk = chunk
        return kl_N

    @staticmethod
    def backward(ctx, grad_N):
        student_NV, teacher_NV, lse_s_N, lse_t_N, kl_N = ctx.saved_tensors
        grad_NV = torch.empty_like(student_NV)
        for lo in range(0, student_NV.shape[1], ctx.chunk):
            ls_NC = student_NV[:, lo:lo + ctx.chunk].float() - lse_s_N[:, None]
            lt_NC = teacher_NV[:, lo:lo + ctx.chunk].float() - lse_t_N[:, None]
            grad_NV[:, lo:lo + ctx.chunk] = grad_N[:, None] * ls_NC.exp() * (ls_NC - lt_NC - kl_N[:, None])
        return grad_NV, None, None


def _chunked_logsumexp(x_NV: torch.Tensor, chunk: int) -> torch.Tensor:
    lse_N = torch.full(x_NV.shape[:1], -torch.inf, device=x_NV.device)
    for lo in range(0, x_NV.shape[1], chunk):
        lse_N = torch.logaddexp(lse_N, torch.logsumexp(x_NV[:, lo:lo + chunk].float(), dim=1))
    return lse_N


def kl_full(student_NV: torch.Tensor, teacher_NV: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Per-token exact KL(student || stopgrad teacher), fp32 [N], from logits (any float dtype)."""
    return _ChunkedKL.apply(student_NV, teacher_NV.detach(), chunk)


def teacher_topk(teacher_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p_t of the top-k [N, K], their token ids [N, K], log tail mass [N] or None when k >= V)."""
    logp_NV = F.log_softmax(teacher_NV.detach().float(), dim=-1)
    logp_NK, idx_NK = logp_NV.topk(min(k, logp_NV.shape[1]), dim=-1)
    return logp_NK, idx_NK, _log_tail(logp_NV, idx_NK)


def _log_tail(logp_NV: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor | None:
    """log of the mass outside idx_NK (exact: a logsumexp over the complement), None if it is empty."""
    if idx_NK.shape[1] >= logp_NV.shape[1]:
        return None
    return logp_NV.scatter(1, idx_NK, -torch.inf).logsumexp(dim=-1)


def kl_topk(student_NV: torch.Tensor, teacher_logp_NK: torch.Tensor, idx_NK: torch.Tensor,
            teacher_log_tail_N: torch.Tensor | None) -> torch.Tensor:
    """Per-token KL(student || teacher) over the teacher's top-k buckets plus the tail bucket, fp32 [N]."""
    logp_NV = F.log_softmax(student_NV.float(), dim=-1)
    logp_NK = logp_NV.gather(1, idx_NK)
    kl_N = (logp_NK.exp() * (logp_NK - teacher_logp_NK)).sum(1)
    if teacher_log_tail_N is not None:
        tail_N = _log_tail(logp_NV, idx_NK)
        kl_N = kl_N + tail_N.exp() * (tail_N - teacher_log_tail_N)
    return kl_N


def kl_sampled(student_logp_N: torch.Tensor, teacher_logp_N: torch.Tensor) -> torch.Tensor:
    """Per-token surrogate [N]: value r = log p_s(y) - log p_t(y), gradient r * grad log p_s(y)."""
    r_N = (student_logp_N - teacher_logp_N).detach()
    return r_N * (1.0 + student_logp_N - student_logp_N.detach())


def token_logp(logits_NV: torch.Tensor, tokens_N: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token], fp32 [N]."""
    return F.log_softmax(logits_NV.float(), dim=-1).gather(1, tokens_N[:, None]).squeeze(1)


def entropy(logits_NV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row, fp32 [N]."""
    logp_NV = F.log_softmax(logits_NV.detach().float(), dim=-1)
    return -(logp_NV.exp() * logp_NV).sum(1)
