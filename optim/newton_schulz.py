"""Newton-Schulz orthogonalization: the pure numerical core of Muon (no state, no communication).

`orthogonalize(X)` approximates the polar factor U V^T of X = U S V^T with a few quintic iterations

    A = X X^T,    X <- a X + (b A + c A^2) X,

each of which maps every singular value s of X to p(s) = a s + b s^3 + c s^5 while keeping the
singular vectors. Starting from X / ||X||_F (all singular values in [0, 1]), the composed
polynomials push the singular values into a band around 1:

  "jordan"         (3.4445, -4.7750, 2.0315) five times (Keller Jordan, modded-nanogpt, 2024):
                   s in [1e-2, 1] -> [0.682, 1.135]; deliberately not convergent, it trades accuracy
                   for a steep slope at 0 (a = 3.4445) so small singular values grow fast.
  "polar_express"  five per-iteration tuples as modded-nanogpt uses them, derived from Polar Express
                   (Amsel et al. 2025, arXiv 2505.16932; the paper's Algorithm 1 lists different
                   tuples with a 1.01 safety factor): s in [1e-3, 1] -> [0.847, 1.142] after the
                   1.02 safety margin on the normalization; more steps repeat the last tuple.

The Gram matrix A is formed on the short side (s = min(m, n)), so one iteration costs
4 s^2 l + 2 s^3 FLOPs with l = max(m, n) (`ns_flops`). All maths runs in the input dtype; callers
choose fp32 or bf16 (Muon's caller casts blocks, see `optim/muon_reference.py`).

Shapes: B batch of matrices, M x N each, S = min(M, N) short side, L = max(M, N) long side.
"""

import math

import torch

JORDAN = ((3.4445, -4.7750, 2.0315),) * 5
# modded-nanogpt's variant of Polar Express (not the tuples of the paper's Algorithm 1, which use a
# 1.01 safety factor); paired with a 1.02 factor on the normalization in COEFFICIENT_SETS.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# name -> (per-iteration (a, b, c) tuples, factor on ||X||_F in the normalization)
COEFFICIENT_SETS = {"jordan": (JORDAN, 1.0), "polar_express": (POLAR_EXPRESS, 1.02)}
LR_ADJUST_MODES = ("rms", "spectral", "none")


def coefficient_schedule(coefficients: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations; past the published list the last tuple repeats."""
    if coefficients not in COEFFICIENT_SETS:
        raise ValueError(f"coefficients={coefficients!r}: expected one of {sorted(COEFFICIENT_SETS)}")
    if steps < 1:
        raise ValueError(f"steps={steps}: Newton-Schulz needs at least 1 iteration")
    tuples = COEFFICIENT_SETS[coefficients][0]
    return [tuples[min(i, len(tuples) - 1)] for i in range(steps)]


def orthogonalize(
    x: torch.Tensor, steps: int = 5, coefficients: str = "jordan", eps: float = 1e-7
) -> torch.Tensor:
    """Approximate polar factor of every matrix in x [..., m, n]; returns [..., m, n] in x.dtype.

    Each matrix is normalized by its own Frobenius norm (times the set's safety factor, plus eps,
    so an all-zero matrix gives zeros). Batch entries never interact mathematically. Numerically, in
    fp32 on CPU the result for one matrix does not depend on what else is in the batch (measured,
    torch 2.13); in bf16 it can: CPUs with AMX-bf16 round a batched matmul's last bit differently
    with the batch size, so batched and one-by-one results agree only to bf16 rounding.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs [..., m, n], got shape {tuple(x.shape)}")
    schedule = coefficient_schedule(coefficients, steps)
    m, n = x.shape[-2:]
    # contiguous: BLAS picks kernels by memory layout, so strided views (per-head column blocks)
    # would round differently from the same values stacked contiguously by another caller
    x_BMN = x.reshape(-1, m, n).contiguous()
    x_BSL = x_BMN.mT if m > n else x_BMN  # short side first: the Gram matrix is S x S
    norm_B11 = torch.linalg.vector_norm(x_BSL, dim=(-2, -1), keepdim=True)
    X_BSL = x_BSL / (norm_B11 * COEFFICIENT_SETS[coefficients][1] + eps)
    for a, b, c in schedule:
        A_BSS = torch.bmm(X_BSL, X_BSL.mT)
        B_BSS = torch.baddbmm(A_BSS, A_BSS, A_BSS, beta=b, alpha=c)  # b A + c A^2
        X_BSL = torch.baddbmm(X_BSL, B_BSS, X_BSL, beta=a)  # a X + B X
    return (X_BSL.mT if m > n else X_BSL).reshape(x.shape)


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """Matmul FLOPs of `orthogonalize` on one m x n matrix: per iteration X X^T (2 s^2 l),
    A A (2 s^3) and B X (2 s^2 l), with s = min(m, n), l = max(m, n)."""
    s, l = min(m, n), max(m, n)
    return steps * (4 * s * s * l + 2 * s**3)


def lr_scale(rows: int, cols: int, mode: str) -> float:
    """Factor on the orthogonalized update of one rows x cols block.

    "rms":      0.2 * sqrt(max(rows, cols)): gives the update the RMS of a typical AdamW update, so
                AdamW learning rate and weight decay carry over (Moonlight, arXiv 2502.16982).
    "spectral": sqrt(max(1, rows / cols)) (Keller Jordan's Muon).
    "none":     1.
    Per-head and per-expert blocks use the block's shape, not the parameter's.
    """
    if mode == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "none":
        return 1.0
    raise ValueError(f"lr_adjust={mode!r}: expected one of {LR_ADJUST_MODES}")
