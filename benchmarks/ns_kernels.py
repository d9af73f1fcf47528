"""Newton-Schulz kernels side by side: standard vs Gram NS (and a plain bmm as the ceiling).

    python benchmarks/ns_kernels.py [--json PATH] [--sets debug,kimi_slice,kimi_k2_scaled]
        [--dtypes float32,bfloat16] [--repeats 5] [--threads 1]

No process group. For every block shape of a set (the set's real block counts, one batched call per
shape, as the optimizer runs them on one rank) and dtype, the methods run interleaved (standard,
gram, bmm, standard, ...) so load drift on a shared machine hits all alike; medians over `repeats`
samples, each of as many calls as last about MIN_SAMPLE_S.
  standard  `orthogonalize(method="standard")`
  gram      `orthogonalize(method="gram")` (Gram NS where the aspect ratio exceeds 2, standard elsewhere)
  bmm       X X^T as one bmm of the same operands: the machine's matmul rate on these shapes; its row
            reports the time the standard method's FLOPs would take at that rate (the ceiling)
Rows: {"set", "shape", "batch", "method", "dtype", "ms", "gflops", "polar_err"}; gflops = the method's
own matmul FLOPs (`ns_flops`) / time; polar_err = max over the first POLAR_SAMPLES blocks of
||NS(X) - U V^T||_F / ||U V^T||_F, U V^T the exact polar factor (SVD, float64) of random Gaussian X.
Sets:
  debug           the `debug` preset's blocks;
  kimi_slice      Kimi K2 shapes scaled 16x down (benchmarks/lib/param_sets.py), 2 MoE layers;
  momentum        (--momentum-checkpoint) the saved momentum buffers of a `debug` run, polar_err only;
  kimi_k2_scaled  Kimi K2's block kinds with every side scaled 8x down (2048 x 7168 experts -> 256 x 896),
                  in a small batch per kind (KIMI_K2_SCALED: block counts chosen to run in seconds).
"""

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/ns_kernels.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from optim.newton_schulz import ns_flops, orthogonalize
from runtime.cli import user_errors
from runtime.paths import check_outputs

METHODS = ("standard", "gram", "bmm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
POLAR_SAMPLES = 4
MIN_SAMPLE_S = 0.02  # small shapes: repeat the call so one timed sample lasts about this long
# Kimi K2 block (rows, cols) / 8 -> blocks per call: experts w1/w3 and w2 (transposed), q/kv/o heads,
# dense FFN, q/kv down-projections, router.
KIMI_K2_SCALED = {(256, 896): 16, (896, 256): 8, (24, 192): 16, (32, 64): 16, (896, 16): 16,
                  (896, 2304): 1, (192, 896): 1, (72, 896): 1, (48, 896): 1}


def set_blocks(name: str) -> dict[tuple[int, int], int]:
    """(rows, cols) -> number of blocks of that shape in the set."""
    if name == "kimi_k2_scaled":
        return dict(KIMI_K2_SCALED)
    from benchmarks.lib.matmul_rate import block_shape_counts
    from benchmarks.lib.param_sets import model_config
    from models import Transformer
    from models.splits import muon_splits

    with torch.device("meta"):
        model = Transformer(model_config(name))
    splits = muon_splits(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n in splits}
    return dict(block_shape_counts(shapes, splits))


def polar_error(out: torch.Tensor, x: torch.Tensor) -> float:
    u, _, vh = torch.linalg.svd(x[:POLAR_SAMPLES].double(), full_matrices=False)
    polar = u @ vh
    return float(((out[:POLAR_SAMPLES].double() - polar).norm(dim=(-2, -1)) / polar.norm(dim=(-2, -1))).max())


def run_method(method: str, x: torch.Tensor) -> torch.Tensor:
    if method == "bmm":
        xs = x.mT if x.shape[-2] > x.shape[-1] else x
        return torch.bmm(xs, xs.mT)
    return orthogonalize(x, method=method)


def method_flops(method: str, shape, batch: int, dtype) -> int:
    if method == "bmm":
        s, l = min(shape), max(shape)
        return batch * 2 * s * s * l
    return batch * ns_flops(*shape, method=method, dtype=dtype)


def bench_shape(set_name: str, shape, batch: int, dtype, repeats: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=gen).to(dtype)
    outs = {m: run_method(m, x) for m in METHODS}  # warm-up, and the outputs for polar_err
    start = time.perf_counter()
    run_method("standard", x)
    number = max(1, int(MIN_SAMPLE_S / max(time.perf_counter() - start, 1e-6)))  # calls per timed sample
    times = {m: [] for m in METHODS}
    for _ in range(repeats):
        for m in METHODS:
            start = time.perf_counter()
            for _ in range(number):
                run_method(m, x)
            times[m].append((time.perf_counter() - start) / number)
    rows = []
    standard_flops = method_flops("standard", shape, batch, dtype)
    for m in METHODS:
        seconds = statistics.median(times[m])
        rate = method_flops(m, shape, batch, dtype) / seconds
        ms = seconds * 1e3 if m != "bmm" else standard_flops / rate * 1e3  # the ceiling for standard's FLOPs
        err = polar_error(outs[m], x) if m != "bmm" else None
        rows.append({"set": set_name, "shape": list(shape), "batch": batch, "method": m,
                     "dtype": str(dtype).replace("torch.", ""), "ms": ms, "gflops": rate / 1e9, "polar_err": err})
    return rows


def momentum_rows(checkpoint: str, dtypes: list[str]) -> list[dict]:
    """polar_err of standard and Gram NS on the Muon blocks of real momentum buffers saved by a run
    of the `debug` preset (the Nesterov direction's main term), one row per block shape and dtype."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from benchmarks.lib.param_sets import model_config
    from models import Transformer
    from models.splits import muon_splits

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, f"{tmp}/state.pt")
        state = torch.load(f"{tmp}/state.pt", weights_only=False)["train"]["optim"]["state"]
    with torch.device("meta"):
        splits = muon_splits(Transformer(model_config("debug")))
    by_shape: dict[tuple, list] = {}
    for name, split in splits.items():
        blocks = split.to_blocks(state[name]["momentum_buffer"])
        by_shape.setdefault(tuple(blocks.shape[-2:]), []).append(blocks)
    rows = []
    for shape, blocks in by_shape.items():
        x = torch.cat(blocks)
        for dtype_name in dtypes:
            for method in ("standard", "gram"):
                out = orthogonalize(x.to(DTYPES[dtype_name]), method=method)
                err = max(polar_error(out[i:i + POLAR_SAMPLES], x[i:i + POLAR_SAMPLES]) for i in range(0, len(x), POLAR_SAMPLES))
                rows.append({"set": "momentum", "shape": list(shape), "batch": len(x), "method": method,
                             "dtype": dtype_name, "ms": None, "gflops": None, "polar_err": err})
                print(f"momentum {'x'.join(map(str, shape)):>9s} {len(x):4d} {dtype_name:9s} {method:8s} polar err {err:.4f}")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (set, dtype): the whole set's time per method and gram / standard."""
    out = []
    keys = sorted({(r["set"], r["dtype"]) for r in rows}, key=lambda k: (list(dict.fromkeys(r["set"] for r in rows))
                                                                          .index(k[0]), k[1]))
    for set_name, dtype in keys:
        total = {m: sum(r["ms"] for r in rows if (r["set"], r["dtype"], r["method"]) == (set_name, dtype, m))
                 for m in METHODS}
        out.append({"set": set_name, "dtype": dtype, **{f"{m}_ms": total[m] for m in METHODS},
                    "gram_over_standard": total["gram"] / total["standard"]})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write {'rows': [...], 'summary': [...]} to this path")
    p.add_argument("--sets", default="debug,kimi_slice,kimi_k2_scaled")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method and shape (median)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--momentum-checkpoint", help="a run's checkpoint directory (debug preset): also report polar_err "
                                                 "of both methods on its saved momentum buffers, per block shape")
    return p.parse_args(argv)


@user_errors
def main(argv=None) -> dict:
    args = parse_args(argv)
    check_outputs([("--json", args.json)], [("a file of --momentum-checkpoint", args.momentum_checkpoint)])
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'set':15s} {'shape':>11s} {'batch':>5s} {'dtype':9s} " + "  ".join(f"{m + ' ms':>12s}" for m in METHODS)
          + "  gram/std  polar err std/gram")
    for set_name in args.sets.split(","):
        for shape, batch in set_blocks(set_name).items():
            for dtype_name in args.dtypes.split(","):
                new = bench_shape(set_name, shape, batch, DTYPES[dtype_name], args.repeats)
                rows += new
                by = {r["method"]: r for r in new}
                print(f"{set_name:15s} {'x'.join(map(str, shape)):>11s} {batch:5d} {dtype_name:9s} "
                      + "  ".join(f"{by[m]['ms']:12.2f}" for m in METHODS)
                      + f"  {by['gram']['ms'] / by['standard']['ms']:8.2f}"
                      + f"  {by['standard']['polar_err']:.4f}/{by['gram']['polar_err']:.4f}", flush=True)
    if args.momentum_checkpoint:
        rows += momentum_rows(args.momentum_checkpoint, args.dtypes.split(","))
    summary = summarize([r for r in rows if r["set"] != "momentum"])
    for s in summary:
        print(f"{s['set']:15s} {s['dtype']:9s} whole set: standard {s['standard_ms']:.1f} ms, gram {s['gram_ms']:.1f} ms "
              f"({s['gram_over_standard']:.2f}x), bmm ceiling {s['bmm_ms']:.1f} ms")
    out = {"threads": args.threads, "repeats": args.repeats, "device": f"cpu ({os.cpu_count()} cores)",
           "rows": rows, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
