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

method="gram" (Gram Newton-Schulz, `gram_iterations`): the same polynomials, computed on the S x S
matrix R = X X^T with X touched only at the start, at a restart and at the end, for blocks of aspect
ratio above GRAM_MIN_ASPECT: 4 s^2 l + 34 s^3 FLOPs for 5 iterations in fp32 instead of
20 s^2 l + 10 s^3 (0.60x at 2048 x 7168). Normalized in fp32; bf16 inputs iterate in fp16.

Shapes: B batch of matrices, M x N each, S = min(M, N) short side, L = max(M, N) long side.
"""

import contextlib
import math

import torch

from optim.ns_coefficients import COEFFICIENT_SETS, LR_ADJUST_MODES, NS_METHODS

# Gram NS where long side > GRAM_MIN_ASPECT x short side. FLOPs break even at 1.5 (`ns_flops`: 8 s^2 l +
# 28 s^3 with one restart, 4 s^2 l + 34 s^3 without, against 20 s^2 l + 10 s^3); Dao AI Lab keep
# standard NS at aspect <= 2, where the small S x S products gain little over its fewer, larger ones.
# Measured (fp32, 1 CPU thread, 16 blocks of 128 x l, Gram / standard time): 1.26 at aspect 1, 1.14
# at 2, 0.83 at 2.5, 0.71 at 3.5 (a shared machine: +-15%).
GRAM_MIN_ASPECT = 2.0
GRAM_RESTART_EVERY = 3



def coefficient_schedule(coefficients: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations; past the published list the last tuple repeats."""
    if coefficients not in COEFFICIENT_SETS:
        raise ValueError(f"coefficients={coefficients!r}: expected one of {sorted(COEFFICIENT_SETS)}")
    if steps < 1:
        raise ValueError(f"steps={steps}: Newton-Schulz needs at least 1 iteration")
    tuples = COEFFICIENT_SETS[coefficients][0]
    return [tuples[min(i, len(tuples) - 1)] for i in range(steps)]


def orthogonalize(
    x: torch.Tensor, steps: int = 5, coefficients: str = "jordan", eps: float = 1e-7, method: str = "standard",
    tf32: bool = False,
) -> torch.Tensor:
    """Approximate polar factor of every matrix in x [..., m, n]; returns [..., m, n] in x.dtype.

    Each matrix is normalized by its own Frobenius norm (times the set's safety factor, plus eps,
    so an all-zero matrix gives zeros). `method`: "standard" iterates on X; "gram" iterates on the
    Gram matrix (`gram_iterations`) where the aspect ratio exceeds GRAM_MIN_ASPECT and is standard
    elsewhere (`uses_gram`). `tf32`: fp32 matmuls on CUDA may use TF32 tensor cores (10-bit
    significand products, fp32 accumulation; no effect on CPU or other dtypes). Batch entries never interact mathematically. Numerically, in fp32 on CPU
    the result for one matrix does not depend on what else is in the batch (measured, torch 2.13);
    in bf16 it can: CPUs with AMX-bf16 round a batched matmul's last bit differently with the batch
    size, so batched and one-by-one results agree only to bf16 rounding.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs [..., m, n], got shape {tuple(x.shape)}")
    if method not in NS_METHODS:
        raise ValueError(f"method={method!r}: expected one of {NS_METHODS}")
    schedule = coefficient_schedule(coefficients, steps)
    m, n = x.shape[-2:]
    # contiguous: BLAS picks kernels by memory layout, so strided views (per-head column blocks)
    # would round differently from the same values stacked contiguously by another caller
    x_BMN = x.reshape(-1, m, n).contiguous()
    x_BSL = x_BMN.mT if m > n else x_BMN  # short side first: the Gram matrix is S x S
    gram = uses_gram(m, n, method)
    if gram:  # normalized in (at least) fp32, iterated in the Gram dtype (bf16 -> fp16, as Dao AI Lab do)
        x_BSL = x_BSL.to(torch.promote_types(x.dtype, torch.float32))
    norm_B11 = torch.linalg.vector_norm(x_BSL, dim=(-2, -1), keepdim=True)
    X_BSL = x_BSL / (norm_B11 * COEFFICIENT_SETS[coefficients][1] + eps)
    shape, dtype = x.shape, x.dtype
    del x, x_BMN, x_BSL  # a caller that passed its last reference to x gets its memory back now
    with _tf32_matmuls(tf32 and X_BSL.is_cuda):
        if gram:
            work = gram_dtype(dtype)
            X_BSL = gram_iterations(X_BSL.to(work), schedule, gram_restarts(steps, work)).to(dtype)
        else:
            X_BSL = standard_iterations(X_BSL, schedule)
    return (X_BSL.mT if m > n else X_BSL).reshape(shape)


def gram_dtype(dtype: torch.dtype) -> torch.dtype:
    """What Gram NS iterates in for inputs of `dtype`: fp16 for bf16 (R = X X^T squares the condition
    number; bf16's 8-bit significand loses small singular values that fp16's 11 bits keep: on
    ill-conditioned 112 x 32 blocks, Polar Express, Gram in bf16 lands 23% farther from the polar
    factor than standard NS in bf16, in fp16 within 1%; tests/unit/test_newton_schulz.py), else `dtype`.
    Entries stay in fp16's range: R <= 1, Q <= the product of the a coefficients (< 1e3)."""
    return torch.float16 if dtype == torch.bfloat16 else dtype


@contextlib.contextmanager
def _tf32_matmuls(enabled: bool):
    """Allow TF32 for CUDA fp32 matmuls inside the block (restored after; nothing when not enabled).
    Through `fp32_precision`, not the legacy `allow_tf32`: reading the legacy flag raises once anything
    in the process enabled TF32 the new way (e.g. `torch.backends.fp32_precision = "tf32"`, torch 2.13),
    while a round trip of the new one leaves a legacy setting readable."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def standard_iterations(X_BSL: torch.Tensor, schedule) -> torch.Tensor:
    """Per (a, b, c): A = X X^T, X <- a X + (b A + c A^2) X."""
    for a, b, c in schedule:
        A_BSS = torch.bmm(X_BSL, X_BSL.mT)
        B_BSS = torch.baddbmm(A_BSS, A_BSS, A_BSS, beta=b, alpha=c)  # b A + c A^2
        X_BSL = torch.baddbmm(X_BSL, B_BSS, X_BSL, beta=a)  # a X + B X
    return X_BSL


def gram_iterations(X_BSL: torch.Tensor, schedule, restarts: tuple[int, ...] = ()) -> torch.Tensor:
    """The standard iterations rewritten on R = X X^T (Gram Newton-Schulz, Zhang, Amsel, Chen, Dao
    2026, https://github.com/Dao-AILab/gram-newton-schulz): every iterate is X_t = Q_t X_0 with Q_t a
    polynomial in R_0, so only S x S matrices are multiplied:

        Z = b R + c R^2,   Q <- Q (a I + Z),   R <- (a I + Z) R (a I + Z) = Z (R Z + a R) + a (R Z + a R)

    and X is touched at the start (R_0 = X X^T), at each restart (X <- Q X, R <- X X^T, Q <- I: the
    product Q accumulates rounding in low precision, so bf16 restarts, see `gram_restarts`) and at the
    end (Q X). R is not updated after the last iteration nor before a restart (it is recomputed).
    """
    S = X_BSL.shape[-2]
    R_BSS = torch.bmm(X_BSL, X_BSL.mT)
    Q_BSS = None
    for i, (a, b, c) in enumerate(schedule):
        if i in restarts and Q_BSS is not None:
            X_BSL = torch.bmm(Q_BSS, X_BSL)
            R_BSS = torch.bmm(X_BSL, X_BSL.mT)
            Q_BSS = None
        Z_BSS = torch.baddbmm(R_BSS, R_BSS, R_BSS, beta=b, alpha=c)
        if Q_BSS is None:  # Q = a I + Z
            Q_BSS = Z_BSS.clone()
            Q_BSS.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q_BSS = torch.baddbmm(Q_BSS, Q_BSS, Z_BSS, beta=a)
        if i + 1 < len(schedule) and i + 1 not in restarts:
            RZ_BSS = torch.baddbmm(R_BSS, R_BSS, Z_BSS, beta=a)
            R_BSS = torch.baddbmm(RZ_BSS, Z_BSS, RZ_BSS, beta=a)
    assert Q_BSS is not None and Q_BSS.shape[-1] == S
    return torch.bmm(Q_BSS, X_BSL)


def gram_restarts(steps: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Iterations that start from a fresh R = X X^T: none in fp32/fp64; in half precision the 3rd
    and every GRAM_RESTART_EVERY-th after it (for 5 iterations: one restart after the 2nd, Dao AI
    Lab's choice for their 5-step coefficients)."""
    if torch.finfo(dtype).bits > 16:  # fp32 and fp64: no restart needed (tests/unit/test_newton_schulz.py)
        return ()
    return tuple(range(2, steps, GRAM_RESTART_EVERY))


def uses_gram(m: int, n: int, method: str) -> bool:
    """Whether `orthogonalize(method=method)` takes the Gram path on an m x n matrix."""
    return method == "gram" and max(m, n) > GRAM_MIN_ASPECT * min(m, n)


def ns_flops(m: int, n: int, steps: int = 5, method: str = "standard", dtype: torch.dtype = torch.float32) -> int:
    """Matmul FLOPs of `orthogonalize` on one m x n matrix (s = min(m, n), l = max(m, n)).

    standard, per iteration: X X^T (2 s^2 l), A A (2 s^3) and B X (2 s^2 l).
    gram: 2 s^2 l for R_0 = X X^T and for the final Q X, 4 s^2 l per restart, and S x S products:
    R^2 every iteration, Q Z except the first after a (re)start, R Z and Z (RZ) except before a
    restart and after the last iteration (2 s^3 each).
    """
    s, l = min(m, n), max(m, n)
    if not uses_gram(m, n, method):
        return steps * (4 * s * s * l + 2 * s**3)
    restarts = gram_restarts(steps, dtype)
    products = 0
    for i in range(steps):
        products += 1 + (0 if i == 0 or i in restarts else 1)
        products += 2 if i + 1 < steps and i + 1 not in restarts else 0
    return (2 + 2 + 4 * len(restarts)) * s * s * l + 2 * products * s**3


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
