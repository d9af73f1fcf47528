"""One command on one CUDA GPU: measured rates for the projections, and one real training step.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py --json gpu_check.json      # one GPU, < 8 minutes
    python benchmarks/gpu_check.py --device cpu --small --json /tmp/x.json      # same code path, seconds

Sections, in order; each is guarded (a failure is recorded under its name with the traceback and
the next section runs), the JSON is rewritten after each, and a section that would start after
the time budget (--budget-s) is recorded as skipped:
  env          torch, CUDA, device name, memory
  matmul       bf16 matmul TFLOP/s (square and Kimi K2 token x expert shapes)
  ns           Newton-Schulz TFLOP/s (optim.newton_schulz.orthogonalize) per coefficient set (and
               per method, where that module offers several) on every Muon block family of Kimi K2
               (one dense and one MoE layer: experts 2048 x 7168 hold ~98% of the NS FLOPs);
               every method's rate counts standard NS FLOPs (`ns_flops` of "standard"), so rates
               compare methods by time (Gram NS does fewer FLOPs for the same result)
  grouped_mm   models.experts.grouped_linear TFLOP/s, Kimi K2 expert shapes (48 local experts, ep=8)
               and the whole SwiGLU experts forward + backward
  attention    SDPA TFLOP/s on MLA shapes (64 heads, q/k 192, v 128, causal), per SDPA backend
               (which are eligible), and with v zero-padded to 192; forward + backward of the model's
               own CausalAttention (v padded or not, as training chooses: `training_pads_values`)
  train_step   the runtime's train_step (runtime/train.py) on moonlight_16b widths with as many
               layers as the memory estimate allows (bf16 FSDP mixed precision, Muon): tokens/s, MFU, peak
               memory against the estimated weight + gradient + optimizer-state bytes, host syncs
               (benchmarks/gpu_check_train.py)
  compiled_block
               a dense and a MoE block, eager vs compiled (inductor): seconds, graphs, recompiles; and with
               document masking (FlexAttention inside the compiled blocks): error ratio, recompiles
               (benchmarks/gpu_check_compile.py)
  cp_attention, grouped_mm_empty, train_variants
               the risky paths a world of one can check (benchmarks/gpu_check_paths.py): context
               parallelism's chunked flash attention against fp32, grouped matmuls with empty expert
               groups, training steps with activation checkpointing and with QK-clip
  calibration  the keys the projections read: "kimi_blocks_gflops" {dtype: GFLOP/s} (what
               planning/devices.py --calibration reads) and "rates_tflops" (matmul, grouped
               matmul, attention, MFU: benchmarks/step_projection.py --calibration)
Timing: CUDA events around `iters` back-to-back calls after warm-up (per-call mean); on the CPU,
perf_counter. FLOPs are counted from the shapes (2 m n k per matmul), not from the kernels.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
import warnings

if __package__ in (None, ""):  # `python benchmarks/gpu_check.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks.gpu_check_compile import section_compiled_block
from benchmarks.gpu_check_paths import SECTIONS as PATH_SECTIONS
from benchmarks.gpu_check_train import section_train_step
from runtime.cli import user_errors
from runtime.paths import check_outputs

DEFAULT_BUDGET_S = 450.0  # stop starting sections after this; the whole run stays under 8 minutes


class Timer:
    """Mean seconds per call of `fn` on `device`: warm-up, then enough calls to fill ~`target_s`."""

    def __init__(self, device: torch.device, target_s: float = 0.3, max_iters: int = 50):
        self.device, self.target_s, self.max_iters = device, target_s, max_iters

    def __call__(self, fn) -> float:
        fn()  # warm-up: allocations, kernel selection, autotuning
        one = self._run(fn, 1)
        iters = int(max(1, min(self.max_iters, math.ceil(self.target_s / max(one, 1e-6)))))
        return self._run(fn, iters) / iters

    def _run(self, fn, iters: int) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def section_env(ctx) -> dict:
    # fp32 matmuls the runtime leaves in fp32 (the router GEMM, fp32 params) run at this precision:
    # "none" (torch's default: the legacy allow_tf32 flag decides, off by default) or "ieee" = no TF32,
    # "tf32" = TF32; Newton-Schulz sets TF32 itself (optim.ns_tf32)
    out = {"torch": torch.__version__, "device": str(ctx.device), "cuda": torch.version.cuda,
           "small": ctx.small, "fp32_matmul_precision": torch.backends.cuda.matmul.fp32_precision,
           "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(name=props.name, memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    else:
        out["name"] = "cpu"
    return out


def section_matmul(ctx) -> dict:
    """bf16 (and one fp32) matmul rates: [m, k] @ [k, n]."""
    shapes = [(8192, 8192, 8192), (16384, 7168, 2048), (16384, 2048, 7168)] if not ctx.small else \
        [(256, 256, 256), (128, 64, 32)]
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in shapes if dtype == torch.bfloat16 else shapes[:1]:
            a = torch.randn(m, k, device=ctx.device, dtype=dtype)
            b = torch.randn(k, n, device=ctx.device, dtype=dtype)
            seconds = ctx.timer(lambda: a @ b)
            out[f"{_name(dtype)} {m}x{k}x{n}"] = _rate(2 * m * k * n, seconds)
            del a, b
    return out


def ns_block_families(small: bool) -> dict:
    """{(rows, cols): number of blocks} of every Muon block family of Kimi K2 (debug preset with
    --small), from one dense and one MoE layer: the planner's own splits (models/splits.py)."""
    from benchmarks.lib.matmul_rate import block_shape_counts
    from models import Transformer, preset
    from models.splits import muon_splits

    config = preset("debug" if small else "kimi_k2_1t", n_layers=2, n_dense_layers=1)
    with torch.device("meta"):
        model = Transformer(config)
    splits = muon_splits(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n in splits}
    return dict(block_shape_counts(shapes, splits))


def ns_variants() -> dict:
    """{label: orthogonalize kwargs}: every coefficient set, and every method where
    `optim.newton_schulz` offers more than one (a `METHODS` tuple and a `method` argument)."""
    import inspect

    from optim import newton_schulz as ns

    sets = list(ns.COEFFICIENT_SETS)
    methods = list(getattr(ns, "METHODS", ()) or getattr(ns, "NS_METHODS", ()))
    if methods and "method" in inspect.signature(ns.orthogonalize).parameters:
        return {f"{m}/{c}": {"method": m, "coefficients": c} for m in methods for c in sets}
    return {c: {"coefficients": c} for c in sets}


def default_ns_variant(labels: list[str]) -> str:
    """The variant the optimizer runs by default (optim/config.py), which the calibration reports."""
    from optim.config import OptimConfig

    config = OptimConfig()
    method = getattr(config, "ns_method", None) or getattr(config, "method", None)
    for label in labels:
        if label in (config.coefficients, f"{method}/{config.coefficients}"):
            return label
    return next((label for label in labels if label.endswith(config.coefficients)), labels[0])


def section_ns(ctx) -> dict:
    from optim.config import OptimConfig
    from optim.newton_schulz import ns_flops, orthogonalize

    families = ns_block_families(ctx.small)
    if ctx.small:  # the three families with the most NS FLOPs: same code path, seconds on a CPU
        families = dict(sorted(families.items(), key=lambda kv: -kv[1] * ns_flops(*kv[0]))[:3])
    cap_bytes = (64 << 20) if ctx.small else (1 << 30)  # one batch of blocks per family, at most this
    # fp32 rows run as training does: TF32 tensor cores where optim.ns_tf32 (default on) allows them
    tf32 = OptimConfig().ns_tf32
    out = {"families": {f"{r}x{c}": n for (r, c), n in families.items()}, "rates": {}, "float32_uses_tf32": tf32}
    dtypes = (torch.bfloat16, torch.float32)
    for label, kwargs in ns_variants().items():
        for dtype in dtypes:
            rates, total_flops, total_s = {}, 0.0, 0.0
            for (r, c), n in families.items():
                if dtype == torch.float32 and (r, c) != max(families, key=lambda s: families[s] * s[0] * s[1]):
                    continue  # fp32: only the dominant family (time)
                batch = max(1, min(n, cap_bytes // (r * c * 2)))
                x = torch.randn(batch, r, c, device=ctx.device, dtype=dtype)
                seconds = ctx.timer(lambda: orthogonalize(x, **kwargs, tf32=tf32))
                flops = batch * ns_flops(r, c)
                rates[f"{r}x{c}"] = _rate(flops, seconds)
                # weight each family by its share of a whole step's NS FLOPs
                total_flops += n * ns_flops(r, c)
                total_s += n * ns_flops(r, c) / (rates[f"{r}x{c}"] * 1e12)
                del x
            out["rates"][f"{label} {_name(dtype)}"] = {"per_family_tflops": rates,
                                                        "step_weighted_tflops": total_flops / total_s / 1e12}
    return out


def section_grouped_mm(ctx) -> dict:
    """grouped_linear on Kimi K2 expert shapes: L local experts, `rows` token copies each."""
    from models.experts import grouped_linear, swiglu_experts

    L, D, Fh, rows = (48, 7168, 2048, 512) if not ctx.small else (4, 64, 32, 16)
    dtype = torch.bfloat16
    counts_L = torch.full((L,), rows, dtype=torch.int64, device=ctx.device)
    x_TD = torch.randn(L * rows, D, device=ctx.device, dtype=dtype)
    w13 = torch.randn(L, 2 * Fh, D, device=ctx.device, dtype=dtype) * D**-0.5  # w1 and w3 fused
    w2 = torch.randn(L, D, Fh, device=ctx.device, dtype=dtype) * Fh**-0.5
    h_TF = torch.randn(L * rows, Fh, device=ctx.device, dtype=dtype)
    T = L * rows
    out = {"shape": {"local_experts": L, "rows_per_expert": rows, "dim": D, "hidden": Fh}}
    out["w13_forward_tflops"] = _rate(2 * T * D * 2 * Fh, ctx.timer(lambda: grouped_linear(x_TD, w13, counts_L)))
    out["w2_forward_tflops"] = _rate(2 * T * D * Fh, ctx.timer(lambda: grouped_linear(h_TF, w2, counts_L)))
    ws = [w.requires_grad_() for w in (w13, w2)]
    x_grad = x_TD.clone().requires_grad_()

    def forward_backward():  # grads set to None first: accumulating into them would add a read and a write per call
        for t in (*ws, x_grad):
            t.grad = None
        swiglu_experts(x_grad, *ws, counts_L).float().square().mean().backward()

    out["swiglu_forward_backward_tflops"] = _rate(3 * 3 * 2 * T * D * Fh, ctx.timer(forward_backward))
    return out


def section_attention(ctx) -> dict:
    """SDPA on MLA shapes, causal; FLOPs counted for the causal half: S^2/2 keys x 2 (qk + v) per head."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, S, QK, V = (1, 64, 4096, 192, 128) if not ctx.small else (1, 2, 64, 24, 16)
    dtype = torch.bfloat16
    q, k = (torch.randn(B, H, S, QK, device=ctx.device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, S, V, device=ctx.device, dtype=dtype)
    v_padded = F.pad(v, (0, QK - V))
    flops = B * H * S * S * (QK + V)  # 2 * (S^2 / 2) * (QK + V): causal half
    out = {"shape": {"batch": B, "heads": H, "seq": S, "qk_head_dim": QK, "v_head_dim": V}}
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    for label, values in (("v128", v), ("v_padded_to_qk", v_padded)):
        for name, backend in backends.items():
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext(), \
                        warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "kernel not used because ...": recorded below instead
                    seconds = ctx.timer(lambda: F.scaled_dot_product_attention(q, k, values, is_causal=True))
                out[f"{label} {name} forward_tflops"] = _rate(flops, seconds)
            except Exception as e:  # the backend refuses these shapes (not eligible)
                out[f"{label} {name} forward_tflops"] = f"not eligible: {str(e).splitlines()[0][:200]}"
    # what training runs: the model's CausalAttention, which pads v only where torch would otherwise
    # fall back to math (models/block_attention.sdpa_needs_padded_values)
    from models.attention import CausalAttention
    from models.block_attention import sdpa_needs_padded_values

    attention, pos = CausalAttention(), torch.arange(S, device=ctx.device)
    out["training_pads_values"] = sdpa_needs_padded_values(q, k, v, None, True, QK**-0.5)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def forward_backward():
        for t in (qg, kg, vg):
            t.grad = None
        attention(qg, kg, vg, pos, pos, QK**-0.5).float().square().mean().backward()

    out["training forward_backward_tflops"] = _rate(3.5 * flops, ctx.timer(forward_backward))  # bwd ~2.5x fwd
    return out


def section_calibration(ctx) -> dict:
    """The keys the projections read, from the sections above (missing ones are left out)."""
    r = ctx.results
    out = {}
    ns = r.get("ns", {}).get("rates", {})
    label = default_ns_variant(list(ns_variants()))
    kimi = {}
    for d in ("bfloat16", "float32"):
        rates = ns.get(f"{label} {d}")
        if rates is None:
            continue
        # the debug preset (--small) has no 2048 x 7168 family: its step-weighted rate stands in
        tflops = rates["step_weighted_tflops"] if ctx.small else rates["per_family_tflops"].get("2048x7168")
        if isinstance(tflops, float):
            kimi[d] = tflops * 1e3
    if kimi:
        out["kimi_blocks_gflops"] = kimi
        out["kimi_blocks_variant"] = label
    rates = {}
    matmul = r.get("matmul", {})
    bf16 = [v for k, v in matmul.items() if k.startswith("bfloat16") and isinstance(v, float)]
    if bf16:
        rates["matmul_bf16"] = max(bf16)
    gm = r.get("grouped_mm", {})
    if isinstance(gm.get("swiglu_forward_backward_tflops"), float):
        rates["grouped_mm_bf16"] = gm["swiglu_forward_backward_tflops"]
    att = r.get("attention", {})
    if isinstance(att.get("training forward_backward_tflops"), float):
        rates["attention_bf16"] = att["training forward_backward_tflops"]
    ts = r.get("train_step", {})
    if isinstance(ts.get("mfu"), float):
        rates["train_step_mfu"] = ts["mfu"]
    out["rates_tflops"] = rates
    return out


SECTIONS = {"env": section_env, "matmul": section_matmul, "ns": section_ns, "grouped_mm": section_grouped_mm,
            "attention": section_attention, "train_step": section_train_step, "compiled_block": section_compiled_block,
            **PATH_SECTIONS,
            "calibration": section_calibration}


def _rate(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolve_device(name: str) -> torch.device:
    """`name` as a device; "cuda" without an index is the current CUDA device, since
    torch.cuda.set_device rejects a device without an index (ValueError)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Context:
    def __init__(self, args):
        self.device = resolve_device(args.device)
        self.small = args.small
        self.timer = Timer(self.device, target_s=0.02 if args.small else 0.3, max_iters=5 if args.small else 50)
        self.results = {}
        self.start = time.perf_counter()
        self.budget_s = args.budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def progress(self, message: str) -> None:
        print(f"[gpu_check {self.elapsed():6.1f}s] {message}", flush=True)


def run(args) -> dict:
    ctx = Context(args)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    wanted = args.sections.split(",") if args.sections else list(SECTIONS)
    for name in wanted:
        if ctx.elapsed() > ctx.budget_s and name != "calibration":
            ctx.results[name] = {"skipped": f"time budget of {ctx.budget_s:.0f} s spent"}
            ctx.progress(f"{name}: skipped (budget)")
        else:
            ctx.progress(f"{name}: start")
            t0 = time.perf_counter()
            try:
                ctx.results[name] = SECTIONS[name](ctx)
                ctx.results[name]["seconds"] = time.perf_counter() - t0
                ctx.progress(f"{name}: done in {time.perf_counter() - t0:.1f}s: {_summary(ctx.results[name])}")
            except Exception as e:  # recorded, and the next section still runs
                ctx.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                ctx.progress(f"{name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        _write(args.json, ctx)
    calibration = ctx.results.get("calibration", {})
    for key in ("kimi_blocks_gflops", "rates_tflops"):  # top level: what device_model.calibrate reads
        if key in calibration:
            ctx.results[key] = calibration[key]
    ctx.results["device"] = ctx.results.get("env", {}).get("name", str(ctx.device))
    _write(args.json, ctx)
    _teardown()
    return ctx.results


def _summary(result: dict) -> str:
    flat = {k: v for k, v in result.items() if isinstance(v, float) and k != "seconds"}
    return ", ".join(f"{k} {v:.3g}" for k, v in list(flat.items())[:6])


def _write(path: str | None, ctx) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(ctx.results, f, indent=1, default=str)
    os.replace(tmp, path)


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results (and the calibration keys) here, after every section")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes and the debug preset (the CPU test)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="start no section (but the calibration) after this many seconds")
    p.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    return p.parse_args(argv)


@user_errors
def main(argv=None) -> dict:
    args = parse_args(argv)
    check_outputs([("--json", args.json)])
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device (use --device cpu --small for the CPU check)")
    return run(args)


if __name__ == "__main__":
    main()
