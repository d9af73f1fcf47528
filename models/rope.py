"""Rotary position embedding tables: plain RoPE (Su et al. 2021) and YaRN context extension.

YaRN (Peng et al. 2023, arXiv 2309.00071), as DeepSeek-V3 and Kimi K2 configure it (`rope_scaling`
{"type": "yarn", factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}):
  - frequencies: a ramp over the rotary dims blends the original frequencies (high-frequency dims,
    "extrapolation") with frequencies divided by `factor` (low-frequency dims, "interpolation"); the
    ramp runs between the dims that complete beta_fast and beta_slow rotations over the original
    context, floored/ceiled to whole dims;
  - attention-scale correction, in two places: cos/sin are multiplied by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (or mscale(factor) when either is unset),
    and the softmax scale by mscale(factor, mscale_all_dim)^2, with mscale(s, m) = 0.1 m ln(s) + 1.
Same arithmetic as DeepSeek-V3's inference code and transformers' `_compute_yarn_parameters`.

Shape letters: S sequence, R rotary width (per head), R2 = R / 2 (one frequency per rotated pair).
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    dim: int  # rotary width R (even)
    theta: float  # base
    factor: float = 1.0  # YaRN context extension; 1 = plain RoPE
    original_seq_len: int = 4096  # YaRN: pretraining context (original_max_position_embeddings)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0 = unset
    mscale_all_dim: float = 0.0  # 0 = unset

    @property
    def is_yarn(self) -> bool:
        return self.factor != 1.0

    def inv_freq(self, device=None) -> torch.Tensor:
        """Inverse frequencies [R2], fp32."""
        pos_freqs_R2 = self.theta ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)
        extrapolation_R2 = 1.0 / pos_freqs_R2
        if not self.is_yarn:
            return extrapolation_R2
        interpolation_R2 = 1.0 / (self.factor * pos_freqs_R2)
        low, high = self._correction_range()
        if low == high:
            high += 0.001  # as the reference: avoid a zero-width ramp
        ramp_R2 = ((torch.arange(self.dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep_R2 = 1 - ramp_R2  # 1: original frequency (fast-rotating dims), 0: interpolated
        return interpolation_R2 * (1 - keep_R2) + extrapolation_R2 * keep_R2

    def _correction_range(self) -> tuple[float, float]:
        def dim_of(rotations: float) -> float:
            return self.dim * math.log(self.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = math.floor(dim_of(self.beta_fast)), math.ceil(dim_of(self.beta_slow))
        return max(low, 0), min(high, self.dim - 1)

    def cos_sin_factor(self) -> float:
        """YaRN's multiplier of the cos/sin tables (1 for plain RoPE)."""
        if not self.is_yarn:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor, 1.0)

    def softmax_scale_factor(self) -> float:
        """YaRN's multiplier of the attention softmax scale (1 for plain RoPE or mscale_all_dim unset)."""
        if not self.is_yarn or not self.mscale_all_dim:
            return 1.0
        return _mscale(self.factor, self.mscale_all_dim) ** 2


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
