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

from benchmarks.counters import count_step

# fp32: the baselines run the reference's own pieces on the same blocks and are bitwise equal on
# this CPU; the sharded Muon is within ~1e-6 (measured); on GPU batched kernels may round
# differently. 1e-5 relative is issue 4's equivalence bound. bf16 NS (torchtitan): unit roundoff 2^-8 = 3.9e-3, amplified by
# five NS iterations with |coefficients| up to 4.8: torchtitan's bf16 update differs from the fp32
# reference by 1.4e-2 (debug) and 2.3e-2 (kimi_slice) relative on this CPU, while a wrong update
# (missing lr scale, wrong block split, stale momentum) is off by >= 0.3.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def full_values(params: dict) -> dict:
    """fqn -> full tensor (collective for DTensors): on every rank."""
    return {fqn: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for fqn, p in params.items()}


def check_against(methods: dict, reference, before: dict, steps: int) -> dict:
    """Step every method and the reference `steps` times; name -> {max_rel_err, tol, ok} (rank 0 decides)."""
    for _ in range(steps):
        reference.step()
        for m in methods.values():
            m.step()
    ref_delta = {fqn: p.detach() - before[fqn] for fqn, p in reference.params.items()} if dist.get_rank() == 0 else {}
    out = {}
    for name, m in methods.items():
        after = full_values(_sharded_params(m))
        err = 0.0
        if dist.get_rank() == 0:
            for fqn, value in after.items():
                ref = ref_delta[fqn]
                err = max(err, float((value - before[fqn] - ref).norm() / ref.norm().clamp_min(1e-30)))
        err_t = torch.tensor([err], dtype=torch.float64)
        dist.broadcast(err_t, src=0)
        tol = TOLERANCE[m.ns_dtype]
        out[name] = {"max_rel_err": float(err_t), "tol": tol, "ok": bool(float(err_t) <= tol), "steps": steps}
    return out


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
