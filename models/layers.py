"""Small building blocks shared by attention, MoE and the model: RMSNorm, RoPE, FeedForward.

Shape letters: B batch, S sequence, H heads, R rotary width (per head), D model dim, F FFN hidden,
T tokens (B*S flattened).
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.region import Region
from models.rope import Rope
from models.splits import WHOLE, MatrixSplit


class RMSNorm(Region):
    """RMSNorm (Zhang & Sennrich 2019), computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_cos_sin(positions_S: torch.Tensor, rope: Rope):
    """cos/sin tables [S, R] for the given (global) token positions, in fp32 ("rotate half" layout:
    both halves of R hold the same R/2 angles), times YaRN's cos/sin factor (models/rope.py).

    Computed from the positions each call instead of a cached buffer: there is no buffer to
    re-create after building on the meta device, and context parallelism can pass any positions.
    """
    inv_freq_R2 = rope.inv_freq(positions_S.device)
    angles_SR2 = positions_S.to(torch.float32)[..., None] * inv_freq_R2  # positions [B, S] (documents): [B, S, R2]
    angles_SR = torch.cat([angles_SR2, angles_SR2], dim=-1)
    factor = rope.cos_sin_factor()
    return angles_SR.cos() * factor, angles_SR.sin() * factor


def apply_rope(x_BSHR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021), "rotate half" pairing (i, i + R/2), math in fp32."""
    x = x_BSHR.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = (cos_SR[None, :, None, :], sin_SR[None, :, None, :]) if cos_SR.dim() == 2 else (
        cos_SR[:, :, None, :], sin_SR[:, :, None, :])  # [B, S, R]: per-row positions (document masking)
    return (x * cos + rotated * sin).type_as(x_BSHR)


class FeedForward(Region):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x). Dense layers and shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def muon_splits(self) -> dict[str, MatrixSplit]:
        return {"w1.weight": WHOLE, "w2.weight": WHOLE, "w3.weight": WHOLE}
