"""One decoupled AdamW step on one tensor (Loshchilov & Hutter, arXiv 1711.05101).

The arithmetic, op for op, of `torch.optim.AdamW(foreach=False)` (torch 2.13
`torch/optim/adam.py::_single_tensor_adam`), so the reference optimizer equals torch's AdamW
bitwise. Every op is elementwise: the sharded optimizer applies the same function to the local
shards of parameter, gradient and state and gets the same numbers as on the full tensor.
"""

import torch
from torch.optim.adamw import adamw


def init_adamw_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fresh state for `p`: "step" (a CPU fp32 scalar tensor, as torch keeps it), "exp_avg", "exp_avg_sq"."""
    return {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


@torch.no_grad()
def adamw_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """In place: p <- p (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)."""
    beta1, beta2 = betas
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    step = state["step"].item()
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


@torch.no_grad()
def adamw_multi_tensor(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """`adamw_update` on many tensors at once through torch's multi-tensor AdamW
    (`torch.optim.adamw.adamw(foreach=True)`: one _foreach_ op per elementwise step, a handful of
    kernels for all tensors on GPU instead of ~8 per tensor). Elementwise, so it runs on local shards.
    Same arithmetic as the single-tensor path up to rounding; on CPU (torch 2.13) bitwise equal
    (tests/unit/test_muon_reference.py)."""
    if not params:
        return
    adamw(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
          [s["step"] for s in states], foreach=True, amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
          weight_decay=weight_decay, eps=eps, maximize=False)
