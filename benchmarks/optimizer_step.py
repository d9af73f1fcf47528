"""Optimizer-step microbenchmark: our sharded Muon against the other distributed Muon designs.

    torchrun --nproc_per_node N benchmarks/optimizer_step.py [--json PATH] [--plot PATH]
        [--steps K] [--warmup K] [--shapes debug|kimi_slice|both] [--methods a,b,...]

CPU (gloo, one thread per rank) or GPU (nccl, one GPU per rank). For each shape set
(`benchmarks/lib/param_sets.py`: real models sharded by `parallel.parallelize`, fixed seeded
gradients) and each method (`benchmarks/lib/methods.py`), in ONE process group:
  1. build every method on its own copy of the parameters;
  2. check: `--check-steps` steps of each, parameter changes compared with the single-process
     reference Muon (a method that fails is reported as FAILED, its time is not a result);
  3. warm up, then time `--steps` interleaved steps (slowest rank per step, median);
  4. count one step per method: matmul (= NS) FLOPs, bytes sent + received, aten ops dispatched
     (`ops_per_step`), collectives issued (`collectives_per_step`), the peak of the memory the
     step allocates (`peak_extra_mb`) and the bytes its memory-bound ops move per parameter
     element (`memory_bytes_per_element`, outside NS; `ns_memory_bytes_per_element` inside), per
     rank (the busiest rank is reported);
  5. measure this machine's NS rate on the same block shapes (`matmul_rate.ns_rate`, all ranks
     at once, like the step), and report each method's NS GFLOP/s on its busiest rank against it.
Rank 0 prints a table per shape set; `--json PATH` and `--plot PATH` write the results
(`benchmarks/lib/report.py`). `main(argv)` is also the entry point the tests call on forked ranks.
"""

import argparse
import os
import sys
from collections import Counter
from dataclasses import replace

if __package__ in (None, ""):  # `torchrun benchmarks/optimizer_step.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.lib import harness, report
from benchmarks.lib.matmul_rate import block_shape_counts, ns_rate
from benchmarks.lib.methods import METHODS, Method, Skipped, build_method
from benchmarks.lib.param_sets import SHAPE_SETS, build_param_set
from optim.config import OptimConfig
from optim.newton_schulz import NS_METHODS
from runtime.cli import user_errors
from runtime.paths import check_outputs

KIMI_EXPERT_BLOCK = (2048, 7168)  # moe_inter_dim x dim of kimi_k2_1t


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write results as JSON to this path")
    p.add_argument("--plot", help="write a PNG bar chart to this path (needs matplotlib)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per method (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per method after the check")
    p.add_argument("--check-steps", type=int, default=2, help="steps compared with the reference")
    p.add_argument("--shapes", default="both", choices=SHAPE_SETS + ("both",))
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="sharded Muon bucket size (MB per rank)")
    p.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--ns-method", default="standard", choices=NS_METHODS)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--calibrate-kimi", type=int, default=None,
                   help="also measure the NS rate on N real Kimi K2 expert blocks (2048 x 7168) for "
                        "projection.py --calibration (default: 8 on GPU, 0 on CPU)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; expected a subset of {METHODS}")
    if min(args.steps, args.check_steps) < 1 or args.warmup < 0:
        p.error(f"--steps={args.steps} and --check-steps={args.check_steps} must be >= 1, --warmup >= 0")
    return args


@user_errors
def main(argv=None) -> dict:
    """Run the benchmark on the process group (initialized here from torchrun's environment)."""
    args = parse_args(argv)
    check_outputs([("--json", args.json), ("--plot", args.plot)])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    created = not dist.is_initialized()
    if created:
        # on GPU, CUDA tensors go over NCCL and the harness's CPU scalars over gloo
        dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
    try:
        if device.type == "cuda":
            device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(args.threads)
        results = run(args, device)
        if dist.get_rank() == 0:
            report.emit(results, json_path=args.json, plot_path=args.plot)
        return results
    finally:
        if created:
            dist.destroy_process_group()


def run(args, device: torch.device) -> dict:
    world = dist.get_world_size()
    config = OptimConfig(ns_dtype=args.ns_dtype, ns_method=args.ns_method)
    sets = SHAPE_SETS if args.shapes == "both" else (args.shapes,)
    results = {"world_size": world, "device": _device_name(device), "threads_per_rank": args.threads,
               "steps": args.steps, "warmup": args.warmup, "ns_dtype": args.ns_dtype, "ns_method": args.ns_method, "shape_sets": {}}
    for name in sets:
        results["shape_sets"][name] = run_shape_set(name, args, config, device)
    main_set = "kimi_slice" if "kimi_slice" in sets else sets[0]
    n_kimi = args.calibrate_kimi if args.calibrate_kimi is not None else (8 if device.type == "cuda" else 0)
    if n_kimi > 0:
        results["kimi_blocks_gflops"] = _kimi_rates(n_kimi, device)
    main = results["shape_sets"][main_set]  # the top-level "methods" and "speedup_vs" are this set's
    results.update(main_shape_set=main_set, methods=main["methods"], speedup_vs=main["speedup_vs"])
    return results


def run_shape_set(name: str, args, config: OptimConfig, device: torch.device) -> dict:
    param_set = build_param_set(name, dist.get_world_size(), device_type=device.type)
    wanted = args.methods.split(",")
    built = {m: build_method(m, param_set, config, args.bucket_mb) for m in wanted}
    reference = build_method("single", param_set, config, args.bucket_mb)
    methods = {m: x for m, x in built.items() if isinstance(x, Method)}
    before = harness.full_values(param_set.params)
    yardstick = bf16_yardstick(param_set, config, args, before, [reference, *methods.values()])
    checks = harness.check_against(methods, reference, before, args.check_steps, yardstick)
    for _ in range(args.warmup):
        for m in methods.values():
            m.step()
    times = harness.time_steps(methods, args.steps, device)
    counts = harness.count_steps(methods, device)
    rates = _ns_rates(param_set, methods, device)
    rows = {m: report.method_row(methods[m], times[m], counts[m], checks[m], rates[methods[m].ns_dtype])
            for m in methods}
    elements = _local_elements(methods)
    for m in methods:  # host-side proxies (counters.py), busiest rank
        rows[m].update(ops_per_step=max(c.ops for c in counts[m]),
                       collectives_per_step=max(c.collectives for c in counts[m]),
                       peak_extra_mb=max(c.peak_extra_bytes for c in counts[m]) / 2**20,
                       memory_bytes_per_element=_per_element(counts[m], elements[m], "memory_bytes"),
                       ns_memory_bytes_per_element=_per_element(counts[m], elements[m], "ns_memory_bytes"))
    rows.update({m: {"skipped": x.reason} for m, x in built.items() if isinstance(x, Skipped)})
    shapes = {fqn: tuple(p.shape) for fqn, p in param_set.params.items()}
    blocks = block_shape_counts(shapes, param_set.splits)
    return {"blocks": {f"{r}x{c}": n for (r, c), n in blocks.items()},
            "matmul_gflops": {str(k).replace("torch.", ""): v for k, v in rates.items()},
            "bf16_yardstick": yardstick, "methods": rows, "speedup_vs": report.speedups(rows)}



def bf16_yardstick(param_set, config: OptimConfig, args, before: dict, methods: list) -> float | None:
    """`harness.bf16_yardstick` on this shape set where any method or the reference runs NS in bf16."""
    if all(m.ns_dtype == torch.float32 for m in methods):
        return None
    refs = [build_method("single", param_set, replace(config, ns_dtype=d), args.bucket_mb) for d in ("float32", "bfloat16")]
    return harness.bf16_yardstick(*refs, before, args.check_steps)

def _local_elements(methods: dict) -> dict:
    """name -> per rank, the parameter elements the method updates there (`single`: all on rank 0)."""
    mine = {m: sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in x.params.values())
            for m, x in methods.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {m: [e[m] for e in every] for m in methods}


def _per_element(counts, elements, field) -> float:
    """Bytes of `field` per parameter element the rank updates, busiest rank (ranks with none skipped)."""
    return max((getattr(c, field) / n for c, n in zip(counts, elements) if n), default=0.0)


def _ns_rates(param_set, methods: dict, device: torch.device) -> dict:
    """NS dtype -> this machine's NS GFLOP/s on the set's blocks (mean over ranks, measured together)."""
    shapes = {fqn: tuple(p.shape) for fqn, p in param_set.params.items()}
    counts = block_shape_counts(shapes, param_set.splits)
    out = {}
    for dtype in sorted({m.ns_dtype for m in methods.values()}, key=str):
        dist.barrier()
        rate = torch.tensor([ns_rate(counts, dtype=dtype, device=device)], dtype=torch.float64)
        dist.all_reduce(rate)
        out[dtype] = float(rate) / dist.get_world_size()
    return out


def _kimi_rates(n: int, device: torch.device) -> dict:
    """NS GFLOP/s on n Kimi K2 expert blocks (99.8% of its NS FLOPs), bf16 and fp32, all ranks at once."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        dist.barrier()
        rate = torch.tensor([ns_rate(Counter({KIMI_EXPERT_BLOCK: n}), dtype=dtype, device=device)], dtype=torch.float64)
        dist.all_reduce(rate)
        out[str(dtype).replace("torch.", "")] = float(rate) / dist.get_world_size()
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def entry(rank: int, world_size: int, argv: list[str]) -> dict:
    """For tests/helpers/multirank.py run_ranks(..., as_torchrun=True): same as the command line."""
    return main(argv)


if __name__ == "__main__":
    main()
