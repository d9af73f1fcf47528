"""The routed experts' SwiGLU block, w1 and w3 fused (one w13 grouped matmul) vs separate (two), side by side.

    python benchmarks/expert_block.py [--small] [--repeats 7] [--json PATH]

Per shape and dtype: grouped-matmul launches (aten._grouped_mm dispatches, counted with a dispatch
mode: a CPU-countable proxy for GPU kernel launches and weight reads) and all aten ops dispatched,
in the forward and the backward, and the wall time of forward + backward, median of `repeats`, the two variants
interleaved so load drift on a shared machine hits both alike (the ratio is the median of the
per-round ratios). "separate" is the pre-fusion code (`separate_swiglu`). CPU times say little
about a GPU's grouped GEMM: they are reported as measured.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from models.experts import grouped_linear, swiglu_experts  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402

# (local experts, tokens per expert, dim, expert hidden dim): a debug-sized and a wider block
SHAPES = [(8, 256, 256, 128), (8, 512, 1024, 512)]
SMALL_SHAPES = [(4, 16, 64, 32)]


def separate_swiglu(x_TD, w1_EFD, w3_EFD, w2_EDF, counts_E) -> torch.Tensor:
    """The experts before the fusion: w1 and w3 in two grouped matmuls."""
    hidden_TF = F.silu(grouped_linear(x_TD, w1_EFD, counts_E)) * grouped_linear(x_TD, w3_EFD, counts_E)
    return grouped_linear(hidden_TF, w2_EDF, counts_E)


class _OpCounter(TorchDispatchMode):
    """Counts aten ops by name (private API: TorchDispatchMode, checked on torch 2.13.0)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def op_counts(forward) -> dict[str, collections.Counter]:
    """{"forward": Counter, "backward": Counter} of the aten ops `forward()` and its backward dispatch."""
    with _OpCounter() as fwd:
        out = forward()
    grad = torch.ones_like(out)
    with _OpCounter() as bwd:
        out.backward(grad)
    return {"forward": fwd.counts, "backward": bwd.counts}


def grouped_mm_launches(forward) -> dict:
    """{"forward": n, "backward": m}: aten._grouped_mm dispatches of `forward()` and of its backward."""
    return {k: c["aten._grouped_mm"] for k, c in op_counts(forward).items()}


def _inputs(L, rows, D, Fh, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L * rows, D, generator=g).to(dtype)
    w13 = (torch.randn(L, 2 * Fh, D, generator=g) * D**-0.5).to(dtype)
    w2 = (torch.randn(L, D, Fh, generator=g) * Fh**-0.5).to(dtype)
    return x, w13, w2, torch.full((L,), rows, dtype=torch.int64)


def variants(L, rows, D, Fh, dtype) -> dict:
    """name -> fn() making fresh leaves (same weights for both) and returning the block's forward on them."""
    x, w13, w2, counts = _inputs(L, rows, D, Fh, dtype)
    w1, w3 = (t.contiguous() for t in w13.chunk(2, dim=1))

    def fused():
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        return lambda: swiglu_experts(*leaves, counts)

    def separate():
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
        return lambda: separate_swiglu(*leaves, counts)

    return {"fused": fused, "separate": separate}


def time_variants(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of forward + backward per round (the first round warms up and is dropped)."""
    times = {name: [] for name in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            forward = fn()
            start = time.perf_counter()
            out = forward()
            out.backward(torch.ones_like(out))
            times[name].append(time.perf_counter() - start)
    return {name: ts[1:] for name, ts in times.items()}


def run(shapes, dtypes, repeats: int) -> list[dict]:
    rows = []
    for L, tokens, D, Fh in shapes:
        for dtype in dtypes:
            fns = variants(L, tokens, D, Fh, dtype)
            counts = {name: op_counts(fn()) for name, fn in fns.items()}
            launches = {name: {k: c["aten._grouped_mm"] for k, c in cs.items()} for name, cs in counts.items()}
            ops = {name: {k: sum(c.values()) for k, c in cs.items()} for name, cs in counts.items()}
            times = time_variants(fns, repeats)
            # per-round ratio (the two ran back to back), then the median: robust to load drift
            ratios = [f / s for f, s in zip(times["fused"], times["separate"])]
            rows.append({"local_experts": L, "tokens_per_expert": tokens, "dim": D, "hidden": Fh,
                         "dtype": str(dtype).removeprefix("torch."), "launches": launches, "aten_ops": ops,
                         "median_s": {name: statistics.median(ts) for name, ts in times.items()},
                         "fused_over_separate": statistics.median(ratios)})
    return rows


@user_errors
def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="one tiny shape (the test suite's run)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    check_outputs([("--json", args.json)])
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(SMALL_SHAPES if args.small else SHAPES, [torch.float32, torch.bfloat16], args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("experts x tokens  dim  hidden  dtype     grouped mm fwd/bwd  aten ops fwd/bwd   median ms          median")
    print("                                           fused | separate    fused | separate   fused | separate   ratio")
    for r in rows:
        lf, ls, of, os_ = r["launches"]["fused"], r["launches"]["separate"], r["aten_ops"]["fused"], r["aten_ops"]["separate"]
        print(f"{r['local_experts']:3d} x {r['tokens_per_expert']:5d}  {r['dim']:5d}  {r['hidden']:5d}  {r['dtype']:8s}  "
              f"{lf['forward']}/{lf['backward']} | {ls['forward']}/{ls['backward']}         "
              f"{of['forward']}/{of['backward']} | {os_['forward']}/{os_['backward']}      "
              f"{1e3 * r['median_s']['fused']:7.2f} | {1e3 * r['median_s']['separate']:7.2f}   {r['fused_over_separate']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
