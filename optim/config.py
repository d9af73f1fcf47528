"""Optimizer configuration (the `[optim]` section).

Muon hyperparameters follow Moonlight (arXiv 2502.16982): one learning rate and weight decay for
both the Muon and the AdamW parameter groups, made compatible by the "rms" per-block lr adjustment.
The last four fields are the sharded Muon's distributed options (optim/sharded/muon.py).
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optim.ns_coefficients import COEFFICIENT_SETS, LR_ADJUST_MODES, NS_METHODS

NAMES = ("muon", "adamw")
REPLICA_SPLIT = ("auto", "on", "off")
NS_DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # torch dtypes of those names (`resolve_ns_dtype`)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: str = "muon"  # "muon" (Muon for declared matrices, AdamW for the rest) or "adamw"
    lr: float = 0.02  # peak learning rate (shared by Muon and AdamW parameter groups)
    weight_decay: float = 0.1  # decoupled weight decay
    momentum: float = 0.95  # Muon momentum, in [0, 1)
    nesterov: bool = True  # Muon Nesterov momentum
    ns_steps: int = 5  # Newton-Schulz iterations
    coefficients: str = "jordan"  # "jordan" or "polar_express"
    lr_adjust: str = "rms"  # "rms": 0.2*sqrt(max(r,c)) per block; "spectral": sqrt(max(1,r/c)); "none"
    ns_dtype: str = "auto"  # Newton-Schulz dtype: "float32", "bfloat16", or "auto" (bf16 on CUDA, fp32 on CPU); weights, momentum stay fp32
    ns_tf32: bool = True  # allow TF32 tensor cores for fp32 Newton-Schulz matmuls on CUDA
    ns_method: str = "standard"  # "standard" NS, or "gram" (iterate on X X^T; blocks of aspect ratio > 2, standard elsewhere)
    adam_beta1: float = 0.9  # AdamW beta1 (the AdamW parameters under muon, all under adamw)
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    bucket_mb: float = 256.0  # sharded Muon: NS input each rank owns per pipelined all-to-all bucket, MiB
    replica_split: str = "auto"  # sharded Muon: split NS over HSDP replicas too ("on"/"off"; "auto" = the plan's cost model)
    overlap: bool = True  # sharded Muon: next bucket's all-to-all in flight during this bucket's NS
    qk_clip_tau: float = 0.0  # QK-clip: rescale q/k of heads whose step max logit > tau (0 = off; Kimi K2: 100)
    qk_clip_alpha: float = 0.5  # QK-clip: exponent of gamma on non-rotary queries (the key takes 1 - alpha)

    def __post_init__(self):
        choices = {"name": NAMES, "coefficients": tuple(COEFFICIENT_SETS), "lr_adjust": LR_ADJUST_MODES,
                   "ns_dtype": NS_DTYPE_CHOICES, "ns_method": NS_METHODS,
                   "replica_split": REPLICA_SPLIT}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"optim.{key}={getattr(self, key)!r}: expected one of {allowed}")
        # `not (lo <= x)` instead of `x < lo` so that NaN is rejected too; isfinite because inf passes `0 <= x`
        finite = {k: math.isfinite(getattr(self, k)) for k in ("lr", "weight_decay", "adam_eps", "bucket_mb",
                                                               "qk_clip_tau")}
        checks = {"lr": finite["lr"] and 0 < self.lr,  # 0 would train nothing
                  "weight_decay": finite["weight_decay"] and 0 <= self.weight_decay,
                  "momentum": 0 <= self.momentum < 1, "ns_steps": self.ns_steps >= 1,
                  "adam_beta1": 0 <= self.adam_beta1 < 1, "adam_beta2": 0 <= self.adam_beta2 < 1,
                  "adam_eps": finite["adam_eps"] and self.adam_eps > 0,
                  "bucket_mb": finite["bucket_mb"] and self.bucket_mb > 0,
                  "qk_clip_tau": finite["qk_clip_tau"] and self.qk_clip_tau >= 0,
                  "qk_clip_alpha": 0 <= self.qk_clip_alpha <= 1}
        ranges = {"lr": "finite and > 0 (0 trains nothing)", "weight_decay": "finite and >= 0", "momentum": "in [0, 1)",
                  "ns_steps": ">= 1", "adam_beta1": "in [0, 1)", "adam_beta2": "in [0, 1)",
                  "adam_eps": "finite and > 0", "bucket_mb": "finite and > 0",
                  "qk_clip_tau": "finite and >= 0", "qk_clip_alpha": "in [0, 1]"}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"optim.{key}={getattr(self, key)!r}: must be {ranges[key]}")
        if self.qk_clip_tau == 0 and self.qk_clip_alpha != 0.5:
            raise ValueError(f"optim.qk_clip_alpha={self.qk_clip_alpha} has no effect: QK-clip is off "
                             f"(optim.qk_clip_tau=0); set optim.qk_clip_tau > 0 (Kimi K2: 100)")

    def ns_torch_dtype(self, device: "torch.device | str | None" = None) -> "torch.dtype":
        """The torch dtype Newton-Schulz runs in on `device` (None: CPU)."""
        return resolve_ns_dtype(self.ns_dtype, device)


def resolve_ns_dtype(name: str, device: "torch.device | str | None" = None) -> "torch.dtype":
    """"auto": bf16 where matmuls run bf16 fast (CUDA tensor cores: ~2x fp32-TF32, ~16x plain fp32
    on an H100/H200, and half the all-to-all bytes), fp32 on CPU (where bf16 matmuls are no faster,
    see benchmarks/ns_kernels.py); otherwise the named dtype."""
    import torch  # here only: the config is read before torch loads (launch/precheck.py)

    if name == "auto":
        return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)
