"""The step model's fitted parameters and the error they were measured to carry, read from
planning/calibration/fitted.json (written by `python benchmarks/calibrate.py --cross-validate --write`, checked
by tests/unit/test_calibrate.py to be the fit of the committed cases, never edited by hand).

`Efficiency` is the only thing fitted, jointly on every committed published run (planning/calibration/fit.py):
  gemm         dense GEMMs' achieved share of the bf16 tensor-core peak (projections, shared experts, dense FFN,
               router, output head), end to end: kernel time over the step, the elementwise and memory-bound
               kernels around them included
  grouped      the routed experts' grouped GEMMs' share of the bf16 peak, likewise
  attention    causal attention's (SDPA forward and backward) share of the bf16 peak
  fp8_speedup  an FP8 GEMM's rate over the same GEMM in bf16, end to end (quantization kernels and the
               fine-grained scaling's promotions included; the datasheet's 2x is the ceiling)
  sync_s       seconds the device idles per MoE layer forward pass: the dispatch's host sync (its split sizes)
               and the kernel launches the host then owes before the GPU has work again; it is what makes
               many small micro-batches slower than few large ones for the same tokens
`cross_validation` holds each case's projection with the parameters fitted on all the others (leave-one-out):
the projected bands (planning/bands.py) rest on its spread, not on the fitted cases' own.
"""

import functools
import json
import os
from dataclasses import dataclass, fields

FITTED_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration", "fitted.json")


@dataclass(frozen=True)
class Efficiency:
    gemm: float
    grouped: float
    attention: float
    fp8_speedup: float
    sync_s: float

    @classmethod
    def from_dict(cls, d: dict) -> "Efficiency":
        return cls(**{f.name: float(d[f.name]) for f in fields(cls)})


@functools.lru_cache(maxsize=None)
def committed() -> dict:
    """The committed fit: {"efficiency": {...}, "cross_validation": {"ratios": {case: ratio}, ...}, ...}."""
    with open(FITTED_JSON) as f:
        return json.load(f)


def fitted() -> Efficiency:
    return Efficiency.from_dict(committed()["efficiency"])
