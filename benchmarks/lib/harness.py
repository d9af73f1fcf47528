"""Check, time and count the optimizer step of several methods in one process group.

  check  after `steps` steps from the same start, each method's parameter change (gathered full on
         rank 0) must equal the single-process reference's change: a baseline that computes a
         different update would be a fake result.
  time   methods run interleaved (m1, m2, ..., m1, m2, ...) so load drift on a shared machine hits
         all of them alike; each rank times its step after a barrier, the step's time is the
         slowest rank's; medians over `steps`.
  count  one more step per method under `counters.count_step()`: measured matmul FLOPs and bytes
         per rank.
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.lib.counters import count_step

# fp32 NS: the baselines run the reference's own pieces on the same blocks and are bitwise equal on
# this CPU; the sharded Muon is within ~1e-6 (measured); on GPU batched kernels may round
# differently. 1e-5 relative is issue 4's equivalence bound.
FP32_TOLERANCE = 1e-5
# bf16 NS anywhere (the method's or the reference's): the tolerance is a multiple of a yardstick
# measured on the same parameters, the single-process reference's change with bf16 NS against its
# change with fp32 NS (`bf16_yardstick`). A bf16 method and a bf16 reference are each about one
# yardstick from the fp32 update, rounding in different orders (batching, their own NS code), so
# they are within about 2 yardsticks of each other; 3 leaves room for a rounding path that is a
# little worse. Measured on this CPU: the yardstick is 1.5e-2 (debug) and 2.0e-2 (kimi_slice);
# torchtitan's bf16 update is 0.98 and 1.15 yardsticks from the fp32 reference, 1.21 from the bf16
# one (debug); our sharded bf16 step is 2.8e-7 from the bf16 reference. A wrong update (missing lr
# scale, wrong block split, stale momentum) is off by >= 0.3 (debug, no lr adjustment: 0.56, 38
# yardsticks).
BF16_YARDSTICKS = 3.0


def tolerance(ns_dtype: torch.dtype, reference_dtype: torch.dtype, yardstick: float | None) -> float:
    if ns_dtype == reference_dtype == torch.float32:
        return FP32_TOLERANCE
    if yardstick is None:
        raise ValueError(f"a method or reference with NS in {ns_dtype}/{reference_dtype} needs a bf16 yardstick")
    return BF16_YARDSTICKS * yardstick


def full_values(params: dict) -> dict:
    """fqn -> full tensor (collective for DTensors): on every rank."""
    return {fqn: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for fqn, p in params.items()}


def check_against(methods: dict, reference, before: dict, steps: int, yardstick: float | None = None) -> dict:
    """Step every method and the reference `steps` times; name -> {max_rel_err, tol, ok} (rank 0
    decides). `yardstick`: `bf16_yardstick`'s, needed where bf16 NS is involved."""
    for _ in range(steps):
        reference.step()
        for m in methods.values():
            m.step()
    out = {}
    for name, m in methods.items():
        err = _max_rel_err(full_values(_sharded_params(m)), reference.params, before)
        tol = tolerance(m.ns_dtype, reference.ns_dtype, yardstick)
        out[name] = {"max_rel_err": err, "tol": tol, "ok": bool(err <= tol), "steps": steps}
    return out


def bf16_yardstick(fp32_reference, bf16_reference, before: dict, steps: int) -> float:
    """The max relative difference between two single-process references' parameter changes after
    `steps` steps from `before`, one with NS in bf16 and one in fp32 (rank 0 decides)."""
    for _ in range(steps):
        fp32_reference.step()
        bf16_reference.step()
    return _max_rel_err(bf16_reference.params, fp32_reference.params, before)


def _max_rel_err(values: dict, reference: dict, before: dict) -> float:
    """max over parameters of |change - reference change| / |reference change|, computed on rank 0
    (where the single-process reference lives), broadcast to all."""
    err = 0.0
    if dist.get_rank() == 0:
        for fqn, value in values.items():
            ref = reference[fqn].detach() - before[fqn]
            err = max(err, float((value.detach() - before[fqn] - ref).norm() / ref.norm().clamp_min(1e-30)))
    err_t = torch.tensor([err], dtype=torch.float64)
    dist.broadcast(err_t, src=0)
    return float(err_t)


def _sharded_params(method) -> dict:
    return {fqn: p for fqn, p in method.params.items() if isinstance(p, DTensor)}


def time_steps(methods: dict, steps: int, device: torch.device) -> dict:
    """name -> list of step seconds (slowest rank), methods interleaved."""
    local = {name: [] for name in methods}
    for _ in range(steps):
        for name, m in methods.items():
            dist.barrier()
            start = time.perf_counter()
            m.step()
            _sync(device)
            local[name].append(time.perf_counter() - start)
    names = list(methods)
    t = torch.tensor([local[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: t[i].tolist() for i, n in enumerate(names)}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def count_steps(methods: dict, device: torch.device) -> dict:
    """name -> list (per rank) of StepCounts of one step."""
    out = {}
    for name, m in methods.items():
        dist.barrier()
        with count_step() as counts:
            m.step()
            _sync(device)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, counts)
        out[name] = gathered
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
