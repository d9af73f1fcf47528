"""compressed-tensors `pack-quantized` INT4 weights (Kimi K2-Thinking / K2.5 routed experts): read, check, write.

A quantized linear `P` of shape [out, in] is stored as three tensors:
    P.weight_packed  int32 [out, ceil(in / 8)]   value q in [-8, 7] stored as the nibble q + 8, 8 nibbles
                                                 per word along the input dim, lowest bits first
    P.weight_scale   bf16/fp16/fp32 [out, ceil(in / 32)]   one scale per group of 32 inputs
    P.weight_shape   int [2] = [out, in]
and means W[o, j] = q[o, j] * scale[o, j // 32] (symmetric, no zero point). This is
`compressed_tensors`' `pack_to_int32` / `unpack_from_int32` for num_bits = 4 (checked against the
library in tests/ranks/test_hf_int4.py); the few lines here keep the library out of the runtime.

Which linears are quantized: models/hf/int4_scheme.py (`read_scheme`), re-exported here with the constants.
"""

import sys

import torch

from models.hf.int4_scheme import (  # noqa: F401 (the scheme and constants, as int4.X)
    BITS, FORMAT, GROUP, METHOD, PER_WORD, SUFFIXES, WORDS_PER_GROUP, Int4Scheme, read_scheme,
)


def unpack(packed_RW: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> int8 [R, 8 W] in [-8, 7]: nibble i of word w is value 8 w + i.

    Through the words' bytes (byte k of a little-endian word holds values 2k and 2k + 1 in its low and
    high nibble): 18x faster than shifting each word 8 times (0.033 vs 0.59 s for 2048 x 7168 on one core)."""
    R, W = packed_RW.shape
    bytes_RB = packed_RW.contiguous().view(torch.uint8).view(R, W, 4)
    if sys.byteorder == "big":
        bytes_RB = bytes_RB.flip(-1)
    nibbles = torch.stack((bytes_RB & 0xF, bytes_RB >> 4), dim=-1).view(R, 8 * W)
    return nibbles.view(torch.int8) - 8


def pack(q_RC: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] in [-8, 7] -> int32 [R, ceil(C / 8)] (the last word zero-padded, as compressed-tensors pads)."""
    R, C = q_RC.shape
    nibbles = torch.nn.functional.pad(q_RC.to(torch.int64) + 8, (0, -C % PER_WORD)).view(R, -1, PER_WORD)
    words = (nibbles << torch.arange(0, 32, BITS, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement of the top bit


def dequantize(packed_RW: torch.Tensor, scale_RG: torch.Tensor) -> torch.Tensor:
    """fp32 [R, 8 W] = q * scale of its group (exact: a 4-bit integer times a bf16/fp16 scale fits fp32).
    The last group may be partial (8 W not a multiple of 32): scale_RG has ceil(8 W / 32) groups."""
    q_RC = unpack(packed_RW)
    R, C = q_RC.shape
    G = scale_RG.shape[1]
    if C != G * GROUP:
        q_RC = torch.nn.functional.pad(q_RC, (0, G * GROUP - C))
    w_RC = q_RC.float()
    w_RC.view(R, G, GROUP).mul_(scale_RG.float().unsqueeze(-1))  # in place: 0.14 s for 2048 x 7168 on one
    return w_RC[:, :C]  # core, against 0.11 s for a bf16 -> fp32 copy of the same weight (int8 * fp32: 0.31 s)


def quantize(w_RC: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-32 INT4 of w: (packed int32 [R, ceil(C/8)], scale [R, ceil(C/32)] in scale_dtype).

    scale = max|w| / 7 of the group, rounded to scale_dtype first; q = round(w / scale) with that stored
    scale, so |w - q * scale| <= scale / 2 for every value (max|w| / scale <= 7 / (1 - 2^-8) < 7.5:
    no clamping error even after the scale's rounding). An all-zero group has scale 0 and q 0."""
    R, C = w_RC.shape
    w = torch.nn.functional.pad(w_RC.float(), (0, -C % GROUP)).view(R, -1, GROUP)
    scale = (w.abs().amax(-1) / 7).to(scale_dtype)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1)), 0).clamp(-8, 7).to(torch.int8)
    return pack(q.view(R, -1)[:, :C]), scale
