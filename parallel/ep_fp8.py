"""Low-precision EP all-to-alls: the dispatch's activations (`parallel.ep_dispatch_dtype = "float8_e4m3"`)
and the combine's gradient (`parallel.ep_combine_grad_dtype = "float8_e4m3"`) cross as FP8.

Each dispatched row x_D is sent as D float8_e4m3fn values q = x / s with one fp32 scale per token,
s = max|x| / 448 (the format's largest finite value), packed with the scale into one uint8 row of
D + 4 bytes (one all-to-all, half the bytes of bf16 rows, a quarter of fp32), and dequantized on
arrival (q s, in the compute dtype). The forward combine and the dispatch's gradient stay in the
compute dtype: the backward of the dispatch sends the received rows' gradient back unquantized
(straight through, as DeepSeek-V3 dispatches in FP8 and combines in BF16).

The combine's gradient (the gradient of the expert outputs, sent from each token's rank back to the
expert ranks in backward) crosses in the same packed rows under ep_combine_grad_dtype: DeepSeek-V3
(arXiv:2412.19437, "Low-Precision Storage and Communication") quantizes "the activation gradient
before MoE down-projections" to FP8 for that backward dispatch, and keeps both combines (forward, and
the backward one that returns the dispatch's gradient) in BF16, as here.
The combine all-to-alls (parallel/expert_parallel.py `all_to_all(..., grad_fp8=True)`, the pieces of
parallel/ep_overlap.py, the fixed-capacity and node-deduplicated combines) encode it before sending
and decode it on arrival, in the gradient's dtype; the forward is unchanged.

Not exact: e4m3 keeps 3 mantissa bits, a relative rounding of up to 2^-4 per value;
tests/test_ep_dispatch.py bounds the effect of each knob on training losses by the bf16-vs-fp32
difference.

Shape letters: N rows sent, M rows received, D model dim, B = D + 4 bytes per packed row.
"""

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4


def check_fp8_device(device_type: str, key: str = "ep_dispatch_dtype") -> None:
    """ValueError (one line, naming parallel.`key`) where the device cannot convert to float8_e4m3fn."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"parallel.{key}='float8_e4m3': torch {torch.__version__} has no float8_e4m3fn")
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ValueError(f"parallel.{key}='float8_e4m3' needs a GPU with float8 support (compute "
                         f"capability >= 8.9: Ada, Hopper or newer); this one is {major}.{minor}")


def encode(x_ND: torch.Tensor) -> torch.Tensor:
    """Rows -> packed uint8 [N, D + 4]: D e4m3 values, then the row's fp32 scale."""
    scale_N1 = x_ND.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    q_ND = (x_ND.detach().float() / scale_N1).to(torch.float8_e4m3fn)
    return torch.cat([q_ND.view(torch.uint8), scale_N1.view(torch.uint8)], dim=1)


def decode(packed_NB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows -> rows in `dtype` (q s computed in fp32, then rounded to dtype)."""
    q_ND = packed_NB[:, :-SCALE_BYTES].contiguous().view(torch.float8_e4m3fn)
    scale_N1 = packed_NB[:, -SCALE_BYTES:].contiguous().view(torch.float32)
    return (q_ND.float() * scale_N1).to(dtype)
