"""The step model's five physical parameters (planning/parameters.py `Efficiency`) fitted jointly on published
runs, and the model's error measured on runs it was not fitted on (leave-one-out).

    fit(runs)               least squares of ln(projected / measured) over the runs, in log-parameter space
                            (Levenberg-Marquardt with a finite-difference Jacobian, within BOUNDS), with a
                            prior tying the kernel classes' shares of peak (CLASS_PRIOR_WEIGHT); deterministic:
                            the same runs give the same parameters
    cross_validate(paths)   each case projected with the parameters fitted on every other case
Nothing per case: every case is projected with the same five numbers and the sourced network model.
"""

import math
import os

import numpy as np

from planning import step
from planning.calibration.case import load
from planning.parameters import Efficiency

START = Efficiency(gemm=0.5, grouped=0.4, attention=0.3, fp8_speedup=1.2, sync_s=1e-3)
BOUNDS = {"gemm": (0.05, 1.0), "grouped": (0.05, 1.0), "attention": (0.05, 1.0),  # shares of the peak
          "fp8_speedup": (1.0, 2.0),  # FP8 at most the datasheet's 2x, at least no slower than bf16
          "sync_s": (1e-6, 0.05)}
NAMES = tuple(BOUNDS)
CLASSES = ("gemm", "grouped", "attention")
# The prior that ties the kernel classes: each class's share of the peak lies within about 30% (a log-normal of
# 0.3) of the classes' mean (H100: cuBLAS bf16 GEMMs ~70% of peak, FlashAttention-3 ~75% forward and ~50%
# backward, grouped GEMMs of thousands of rows per expert ~60%), weighed against the 0.15 accuracy asked of a
# case: one pseudo-residual per class, (log share - mean log share) x 0.15 / 0.3. Without it the throughputs
# alone cannot tell the classes apart (the routed experts are about half of every model's FLOPs).
CLASS_PRIOR_WEIGHT = 0.15 / 0.3


def _efficiency(theta: np.ndarray) -> Efficiency:
    return Efficiency(**{k: float(math.exp(t)) for k, t in zip(NAMES, theta)})


def _clip(theta: np.ndarray) -> np.ndarray:
    return np.clip(theta, [math.log(BOUNDS[k][0]) for k in NAMES], [math.log(BOUNDS[k][1]) for k in NAMES])


def residuals(runs: list, eff: Efficiency) -> np.ndarray:
    """ln(projected / measured) of each (Run, measured tokens/s/GPU)."""
    return np.array([math.log(step.step_terms(run, eff)["tokens_per_gpu_s"] / measured) for run, measured in runs])


def objective(runs: list, eff: Efficiency) -> np.ndarray:
    """The residuals the fit minimizes: the runs' log ratios, then the kernel classes' prior (CLASS_PRIOR_WEIGHT)."""
    logs = np.log([getattr(eff, k) for k in CLASSES])
    return np.concatenate([residuals(runs, eff), CLASS_PRIOR_WEIGHT * (logs - logs.mean())])


def fit(runs: list, iterations: int = 200) -> Efficiency:
    """The Efficiency minimizing `objective` over `runs` (module docstring)."""
    theta = _clip(np.log([getattr(START, k) for k in NAMES]))
    r = objective(runs, _efficiency(theta))
    damping = 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(NAMES)))
        for j in range(len(NAMES)):
            h = np.zeros(len(NAMES))
            h[j] = 1e-5
            jac[:, j] = (objective(runs, _efficiency(theta + h)) - objective(runs, _efficiency(theta - h))) / 2e-5
        normal = jac.T @ jac
        trial = _clip(theta - np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), jac.T @ r))
        r_trial = objective(runs, _efficiency(trial))
        if r_trial @ r_trial < r @ r:
            converged = np.max(np.abs(trial - theta)) < 1e-9
            theta, r, damping = trial, r_trial, max(damping / 3, 1e-9)
            if converged:
                break
        else:
            damping *= 4
            if damping > 1e9:
                break
    return _efficiency(theta)


def runs_of(paths: list[str]) -> list:
    """[(Run, measured tokens/s/GPU)] of the case files."""
    out = []
    for path in paths:
        case, run = load(path)
        out.append((run, case["published"]["tokens_per_gpu_s"]))
    return out


def cross_validate(paths: list[str]) -> dict:
    """{"efficiency": the fit on every case, "fitted_ratios": each case's own ratio under it, "ratios": each
    case's ratio with the parameters fitted on all the others, "folds": those parameters}."""
    runs = runs_of(paths)
    names = [os.path.basename(p) for p in paths]
    everything = fit(runs)
    own = residuals(runs, everything)
    held, folds = {}, {}
    for i, name in enumerate(names):
        others = fit(runs[:i] + runs[i + 1:])
        folds[name] = dict(others.__dict__)
        held[name] = float(math.exp(residuals([runs[i]], others)[0]))
    return {"efficiency": dict(everything.__dict__), "fitted_ratios": {n: float(math.exp(x)) for n, x in zip(names, own)},
            "ratios": held, "folds": folds}


def summary(ratios: dict) -> dict:
    """The leave-one-out figures the tests hold: median |ln ratio|, share within +-25%, lowest and highest."""
    logs = np.abs(np.log(list(ratios.values())))
    return {"median_abs_log": float(np.median(logs)),
            "within_25_percent": float(np.mean([0.75 <= r <= 1.25 for r in ratios.values()])),
            "lowest": min(ratios.values()), "highest": max(ratios.values())}


def committed_form(cv: dict) -> dict:
    """What planning/calibration/fitted.json holds: the fit on every case, each case's fitted and held-out ratio,
    their summaries, and the fold parameters (rounded to 6 significant digits: the file is read back as is)."""
    rnd = lambda x: float(f"{x:.6g}")  # noqa: E731
    return {"efficiency": {k: rnd(v) for k, v in cv["efficiency"].items()},
            "fitted_ratios": {k: rnd(v) for k, v in cv["fitted_ratios"].items()},
            "cross_validation": {"ratios": {k: rnd(v) for k, v in cv["ratios"].items()},
                                 "summary": {k: rnd(v) for k, v in summary(cv["ratios"]).items()},
                                 "folds": {k: {p: rnd(v) for p, v in f.items()} for k, f in cv["folds"].items()}},
            "fitted_summary": {k: rnd(v) for k, v in summary(cv["fitted_ratios"]).items()}}
