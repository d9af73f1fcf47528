"""Newton-Schulz: singular-value bands, dtypes, batching, zeros, FLOP count, lr scales."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optim.newton_schulz import (COEFFICIENT_SETS, GRAM_MIN_ASPECT, coefficient_schedule, gram_iterations,
                                 gram_restarts, lr_scale, ns_flops, orthogonalize, uses_gram)
from optim.ns_coefficients import POLAR_EXPRESS

# The band each coefficient set promises: five iterations map a singular value s of X / ||X||_F to
# the composed polynomial f(s) (see `scalar_ns`); for s in [s_min, 1], f(s) lies in [lo, hi].
# The numbers are the extremes of f on that interval (float64, fine grid; test_band_is_the_scalar_range
# re-derives them). Jordan: not convergent, about [0.68, 1.13] from s = 1e-2 (below that, f(s) -> 0
# and on [3e-3, 1e-2) f peaks at 1.20). Polar Express: minimax, 1 +- 0.141 equioscillating, widened
# at the bottom to 0.847 by the 1.02 safety factor at s = 1e-3.
BANDS = {"jordan": (1e-2, 0.6818, 1.1344), "polar_express": (1e-3, 0.8466, 1.1412)}
# |svd(NS(X)) - f(svd(X))|: fp32 measured <= 5e-6 (unit roundoff 6e-8, amplified by the polynomials'
# slopes, up to a = 8.2 per iteration); 1e-4 keeps 20x margin and is still far inside the band.
# bf16 (unit roundoff 2^-9 = 2e-3, every matmul result rounded) measured <= 3.5e-2 over these shapes;
# 0.06 is ~8 bf16 ulps at 1, well below the width of the band.
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.06}
SHAPES = [(48, 96), (96, 48), (64, 64)]  # wide, tall, square


def scalar_ns(coefficients: str, s: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """What NS does to one singular value s of the Frobenius-normalized input (float64)."""
    x = s / COEFFICIENT_SETS[coefficients][1]
    for a, b, c in coefficient_schedule(coefficients, steps):
        x = a * x + b * x**3 + c * x**5
    return x


def with_singular_values(m: int, n: int, s: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """U diag(s) V^T (float64) with random orthonormal U [m, k], V [n, k] from QR."""
    u, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=torch.float64))
    return u @ torch.diag(s) @ v.T


def test_band_is_the_scalar_range():
    for name, (s_min, lo, hi) in BANDS.items():
        f = scalar_ns(name, torch.logspace(math.log10(s_min), 0, 20_001, dtype=torch.float64))
        assert lo <= f.min() < lo + 1e-3 and hi - 1e-3 < f.max() <= hi, (name, f.min(), f.max())
    below = scalar_ns("jordan", torch.tensor([3e-3, 5e-3], dtype=torch.float64))
    assert below.max() > 1.15  # the jordan band really needs s >= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coefficients", list(BANDS))
def test_singular_values_follow_polynomial_and_stay_in_band(coefficients, dtype):
    s_min, lo, hi = BANDS[coefficients]
    g = torch.Generator().manual_seed(0)
    for m, n in SHAPES:
        k = min(m, n)
        # ill-conditioned: one direction at 1, the rest from 1.5 s_min to 0.1 (normalized min > s_min)
        s = torch.cat([torch.ones(1, dtype=torch.float64), torch.logspace(math.log10(1.5 * s_min), -1, k - 1,
                                                                           dtype=torch.float64)])
        inputs = [with_singular_values(m, n, s, g)]
        if m != n:  # random rectangular matrices are well conditioned (random square ones are not)
            inputs.append(torch.randn(m, n, generator=g, dtype=torch.float64))
        for x in inputs:
            x = x.to(dtype)
            s_in = torch.linalg.svdvals(x.double()) / torch.linalg.vector_norm(x.double())
            assert s_in.min() >= s_min
            s_out = torch.linalg.svdvals(orthogonalize(x, coefficients=coefficients).double())
            expected = scalar_ns(coefficients, s_in).sort().values
            torch.testing.assert_close(s_out.sort().values, expected, rtol=0, atol=TOL[dtype])
            assert lo - TOL[dtype] <= s_out.min() and s_out.max() <= hi + TOL[dtype], (m, n, s_out)


def test_output_keeps_dtype_and_shape():
    for dtype in (torch.float32, torch.bfloat16):
        for m, n in SHAPES:
            out = orthogonalize(torch.randn(2, m, n, dtype=dtype))
            assert out.dtype == dtype and out.shape == (2, m, n)


def test_batched_equals_loop_bitwise_fp32():
    # fp32 batch entries never interact: exact on CPU (torch 2.13, with and without AMX).
    g = torch.Generator().manual_seed(1)
    for x in batched_inputs(g, torch.float32):
        for coefficients in BANDS:
            assert torch.equal(orthogonalize(x, coefficients=coefficients), loop_orthogonalize(x, coefficients))
    x = torch.randn(16, 4, 8, generator=g).transpose(0, 1)  # strided like per-head column blocks
    assert torch.equal(orthogonalize(x), orthogonalize(x.contiguous()))


def test_batched_equals_loop_bf16_to_bf16_rounding():
    # bf16 is NOT batch-independent everywhere: on CPUs with AMX-bf16 a batched bf16 matmul rounds the
    # last bit differently with the batch size. Batched and looped must then agree to bf16 rounding,
    # measured as the bf16-vs-fp32 difference of the batched result (the yardstick): two bf16
    # roundings of the same result, each about a yardstick from fp32, can lie up to twice that apart
    # (0 apart on CPUs without AMX); a mixed-up batch entry would be off by O(1).
    g = torch.Generator().manual_seed(1)
    for x in batched_inputs(g, torch.bfloat16):
        for coefficients in BANDS:
            batched = orthogonalize(x, coefficients=coefficients).float()
            yardstick = (orthogonalize(x.float(), coefficients=coefficients) - batched).abs().max()
            assert 0 < yardstick < 0.1
            assert (batched - loop_orthogonalize(x, coefficients).float()).abs().max() <= 2 * yardstick


def batched_inputs(g, dtype):
    return [torch.randn(shape, generator=g).to(dtype) for shape in [(3, 2, 24, 40), (5, 40, 24)]]


def loop_orthogonalize(x, coefficients):
    """One matrix per call, stacked back to x's shape."""
    flat = x.reshape(-1, *x.shape[-2:])
    return torch.stack([orthogonalize(m, coefficients=coefficients) for m in flat]).reshape(x.shape)


def test_zero_matrix_gives_zeros():
    x = torch.randn(3, 8, 12)
    x[1] = 0
    out = orthogonalize(x, coefficients="polar_express")
    assert torch.equal(out[1], torch.zeros(8, 12))
    assert torch.equal(out[0], orthogonalize(x[0], coefficients="polar_express"))
    assert torch.equal(orthogonalize(torch.zeros(5, 4, dtype=torch.bfloat16)), torch.zeros(5, 4, dtype=torch.bfloat16))


def test_ns_flops_hand_count_and_measured():
    # one iteration on 3 x 5: X X^T 3x5 @ 5x3 = 2*3*5*3 = 90, A A 3x3 @ 3x3 = 54, B X 3x3 @ 3x5 = 90
    assert ns_flops(3, 5, steps=1) == ns_flops(5, 3, steps=1) == 234
    assert ns_flops(3, 5) == 5 * 234
    for shape, steps in [((4, 40, 24), 3), ((2, 16, 48), 5)]:  # tall (transposed) and wide
        with FlopCounterMode(display=False) as counter:
            orthogonalize(torch.randn(shape), steps=steps)
        assert counter.get_total_flops() == shape[0] * ns_flops(*shape[1:], steps=steps)


def test_schedules():
    assert coefficient_schedule("jordan", 7) == [(3.4445, -4.7750, 2.0315)] * 7
    assert coefficient_schedule("polar_express", 7) == list(POLAR_EXPRESS) + [POLAR_EXPRESS[-1]] * 2
    assert coefficient_schedule("polar_express", 2) == list(POLAR_EXPRESS[:2])


def test_bad_arguments():
    with pytest.raises(ValueError, match="coefficients='newton'"):
        orthogonalize(torch.randn(4, 4), coefficients="newton")
    with pytest.raises(ValueError, match="steps=0"):
        orthogonalize(torch.randn(4, 4), steps=0)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        orthogonalize(torch.randn(4))
    with pytest.raises(ValueError, match="method='fast'"):
        orthogonalize(torch.randn(4, 4), method="fast")
    with pytest.raises(ValueError, match="lr_adjust='max'"):
        lr_scale(4, 4, "max")


def test_lr_scale():
    assert lr_scale(64, 256, "rms") == pytest.approx(0.2 * 16)
    assert lr_scale(256, 64, "rms") == pytest.approx(0.2 * 16)
    assert lr_scale(256, 64, "spectral") == pytest.approx(2.0)
    assert lr_scale(64, 256, "spectral") == 1.0
    assert lr_scale(64, 256, "none") == 1.0


# ---------------------------------------------------------------- Gram Newton-Schulz


def published_gram_ns(x, coefficients, restarts):
    """Gram Newton-Schulz as its README writes it (Dao AI Lab, gram-newton-schulz, steps 1-9), one
    wide matrix (n <= m) at a time, plain matmuls; `restarts`: 0-based iterations preceded by X <- Q X,
    R <- X X^T, Q <- I (the README's t = 3 is iteration 2)."""
    a_scale = COEFFICIENT_SETS[coefficients][1]
    X = x / (torch.linalg.vector_norm(x) * a_scale + 1e-7)
    R, Q = X @ X.T, torch.eye(x.shape[0], dtype=x.dtype)
    for i, (a, b, c) in enumerate(coefficient_schedule(coefficients, 5)):
        if i in restarts:
            X, Q = Q @ X, torch.eye(x.shape[0], dtype=x.dtype)
            R = X @ X.T
        Z = b * R + c * R @ R
        Q = Q @ Z + a * Q
        RZ = R @ Z + a * R
        R = Z @ RZ + a * RZ
    return Q @ X


@pytest.mark.parametrize("restarts", [(), (2,)])
@pytest.mark.parametrize("coefficients", list(BANDS))
def test_gram_equals_the_published_loop(coefficients, restarts):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 12, 40, generator=g, dtype=torch.float64)
    X = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) * COEFFICIENT_SETS[coefficients][1] + 1e-7)
    ours = gram_iterations(X, coefficient_schedule(coefficients, 5), restarts)
    loop = torch.stack([published_gram_ns(m, coefficients, restarts) for m in x])
    # float64, the same products in another association: differences are rounding (~1e-15 relative)
    torch.testing.assert_close(ours, loop, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("coefficients", list(BANDS))
def test_gram_equals_standard_in_exact_arithmetic(coefficients):
    # X_t = Q_t X_0 exactly: in float64 Gram and standard NS differ only by rounding
    g = torch.Generator().manual_seed(4)
    for shape in [(4, 16, 72), (4, 72, 16)]:  # wide and tall (transposed inside), aspect 4.5 > 2
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(orthogonalize(x, coefficients=coefficients, method="gram"),
                                   orthogonalize(x, coefficients=coefficients), rtol=1e-10, atol=1e-11)


def polar_distance(out, x):
    """max over the batch of ||out - U V^T||_F / ||U V^T||_F, U V^T the exact polar factor of x (SVD)."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    polar = u @ vh
    return float(((out.double() - polar).norm(dim=(-2, -1)) / polar.norm(dim=(-2, -1))).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coefficients", list(BANDS))
def test_gram_distance_to_polar_factor_within_10_percent_of_standard(coefficients, dtype):
    # The accuracy bar: Gram's distance to the exact polar factor stays within 10% of
    # standard NS's with the same coefficients (measured: <= 2% apart in bf16, equal in fp32). The
    # distance itself is mostly the coefficients' (Jordan's band is [0.68, 1.13]), not rounding.
    g = torch.Generator().manual_seed(5)
    for shape in [(8, 32, 112), (8, 112, 32)]:
        x = torch.randn(shape, generator=g)
        x = (x * torch.logspace(-2, 0, shape[1])[:, None]).to(dtype)  # ill-conditioned rows
        standard = polar_distance(orthogonalize(x, coefficients=coefficients), x)
        gram = polar_distance(orthogonalize(x, coefficients=coefficients, method="gram"), x)
        assert gram <= 1.1 * standard, (shape, standard, gram)


def test_gram_only_above_the_aspect_threshold():
    assert uses_gram(16, 64, "gram") and uses_gram(64, 16, "gram") and not uses_gram(16, 64, "standard")
    assert not uses_gram(16, int(16 * GRAM_MIN_ASPECT), "gram")
    x = torch.randn(3, 16, 32)
    assert torch.equal(orthogonalize(x, method="gram"), orthogonalize(x))  # aspect 2: the standard path


def test_gram_flops_hand_count_and_measured():
    # 5 iterations, no restart (fp32) on s x l: R_0 and Q X (2 s^2 l each); S x S products: R^2 x5,
    # Q Z x4, R Z and Z (RZ) x4 each = 17 -> 4 s^2 l + 34 s^3. One restart (bf16, before iteration 2):
    # + X <- Q X and R <- X X^T (4 s^2 l); Q Z x3, R updates x3 -> 14 products = 28 s^3.
    s, l = 8, 40
    assert ns_flops(s, l, method="gram") == 4 * s * s * l + 34 * s**3
    assert gram_restarts(5, torch.bfloat16) == (2,) and gram_restarts(5, torch.float32) == ()
    assert ns_flops(l, s, method="gram", dtype=torch.bfloat16) == 8 * s * s * l + 28 * s**3
    for dtype in (torch.float32, torch.bfloat16):
        for shape, steps in [((4, 40, 8), 3), ((2, 8, 48), 5), ((2, 8, 48), 9)]:
            with FlopCounterMode(display=False) as counter:
                orthogonalize(torch.randn(shape).to(dtype), steps=steps, method="gram")
            expected = shape[0] * ns_flops(*shape[1:], steps=steps, method="gram", dtype=dtype)
            assert counter.get_total_flops() == expected, (dtype, shape, steps)


@pytest.mark.parametrize("api, value", [("legacy", False), ("new", "ieee"), ("new", "tf32")])
def test_tf32_scope_works_whichever_tf32_api_the_process_used(api, value):
    """ns_tf32 on CUDA: the scope sets and restores TF32 whether the process set its TF32 flag with the
    legacy `allow_tf32` or with the new `fp32_precision` (after which reading the legacy flag raises,
    as PyTorch's recommended `torch.backends.fp32_precision = "tf32"` does); a legacy setting stays
    readable after it. The flags exist on CPU builds too; nothing here runs a CUDA matmul."""
    from optim.newton_schulz import _tf32_matmuls

    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        if api == "legacy":
            matmul.allow_tf32 = value
        else:
            matmul.fp32_precision = value
        with _tf32_matmuls(True):
            assert matmul.fp32_precision == "tf32"
        assert matmul.fp32_precision == ("ieee" if api == "legacy" else value)
        if api == "legacy":
            assert matmul.allow_tf32 is value
    finally:
        matmul.fp32_precision = saved
