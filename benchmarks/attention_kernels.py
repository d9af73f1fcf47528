"""MLA attention kernels side by side: which SDPA kernel runs, ms per forward + backward, CP bytes.

    python benchmarks/attention_kernels.py [--json PATH] [--repeats 7] [--threads 1] [--small]

No process group. Variants run interleaved (a, b, c, a, b, c, ...) so load drift on a shared machine
hits all alike; medians over `repeats` samples of forward + backward (sum of outputs x a fixed
random gradient); `ratio` = the variant's median / the first variant's of its group.
  causal  (no context parallelism) MLA head widths of DeepSeek-V3 / Kimi K2 (q/k 192, v 128):
          unpadded  v 128, `is_causal`: what models/attention.py ran before (q/k and v widths differ)
          padded    v zero-padded to 192, `is_causal`, output sliced (models/attention.py now)
          masked    v 128, explicit boolean [S, S] causal mask
          masked_padded  v padded, explicit mask (the mask's own cost, same kernel as padded)
  cp      one cp rank's attention after the gather (queries: its 2 load-balanced chunks; keys: the
          whole sequence), rank 0 of cp:
          dense_mask  [S/cp, S] boolean mask by global positions, v 128 (parallel/context_parallel.py before)
          chunked     per local chunk: visible prefix + causal diagonal, log-sum-exp merge, v padded
                      (parallel/context_parallel.py now: `balanced_chunk_attention`)
Each row records the kernels the dispatcher ran (`flash` = `_scaled_dot_product_flash_attention_for_cpu`,
`math` = the math fallback, seen as `_safe_softmax`); cp rows also give `logits_per_head`, the
query-key pairs each variant evaluates (the flash kernel skips tiles above the diagonal, in whole
tiles, so slightly more than counted). `cp_bytes` lists, for the DeepSeek-V3 and
Kimi K2 presets, the values gathered per token (expanded K/V vs latent + rotary key) and the FLOPs of
the up-projection that every rank then runs on the gathered tokens. CPU timings say how the kernels
compare on this machine; GPU rates come from benchmarks/gpu_check.py.
"""

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/attention_kernels.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.block_attention import pad_values
from parallel.context_parallel import balanced_chunk_attention, load_balanced_positions
from runtime.cli import user_errors
from runtime.paths import check_outputs

QK, V = 192, 128  # DeepSeek-V3 / Kimi K2: qk_nope 128 + qk_rope 64, v 128
CAUSAL_SHAPES = [(1, 8, 512), (1, 8, 1024), (1, 16, 2048)]  # batch, heads, sequence
CP_SHAPES = [(1, 8, 1024, 2), (1, 8, 2048, 4), (1, 8, 2048, 8)]  # batch, heads, sequence, cp
MIN_SAMPLE_S = 0.2


class _Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "flash_attention" in name:
            self.seen.add("flash")
        elif "_safe_softmax" in name or name.startswith("aten._softmax."):
            self.seen.add("math")
        return func(*args, **(kwargs or {}))


def _inputs(B, H, S_q, S_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S_q, QK, generator=g).to(dtype)
    k = torch.randn(B, H, S_k, QK, generator=g).to(dtype)
    v = torch.randn(B, H, S_k, V, generator=g).to(dtype)
    grad = torch.randn(B, H, S_q, V, generator=g).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)], grad


def causal_variants(B, H, S, dtype) -> dict:
    (q, k, v), grad = _inputs(B, H, S, S, dtype)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    scale = QK**-0.5

    def padded(attn_mask=None):
        out = F.scaled_dot_product_attention(q, k, pad_values(v, QK), attn_mask=attn_mask,
                                             is_causal=attn_mask is None, scale=scale)
        return out[..., :V]

    return {
        "unpadded": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
        "padded": padded,
        "masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
        "masked_padded": lambda: padded(mask),
    }, grad


def cp_variants(B, H, S, cp, dtype) -> dict:
    (q, k, v), grad = _inputs(B, H, S // cp, S, dtype)
    q_pos = load_balanced_positions(S, cp, 0)
    kv_pos = torch.cat([load_balanced_positions(S, cp, r) for r in range(cp)])  # rank-major, as gathered
    mask = kv_pos[None, :] <= q_pos[:, None]
    order = torch.argsort(kv_pos)  # the new path's keys are in global order
    k_sorted, v_sorted = k.detach()[:, :, order].requires_grad_(), v.detach()[:, :, order].requires_grad_()
    scale = QK**-0.5
    return {
        "dense_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
        "chunked": lambda: balanced_chunk_attention(q, k_sorted, v_sorted, 0, cp, scale),
    }, grad


def cp_logits(S: int, cp: int, rank: int = 0) -> dict:
    """Query-key pairs whose logit each cp variant evaluates per head (a FLOP proxy): the dense mask
    evaluates every local query against every key; the chunked path the visible ones only."""
    c = S // (2 * cp)
    return {"dense_mask": 2 * c * S,
            "chunked": sum(k * c * c + c * (c + 1) // 2 for k in (rank, 2 * cp - 1 - rank))}


def _time(variants: dict, grad, repeats: int, min_sample_s: float = MIN_SAMPLE_S) -> dict:
    def run(fn):
        fn().backward(grad)

    calls = {}
    for name, fn in variants.items():  # warm-up, kernels seen, calls per sample
        with _Kernels() as k:
            run(fn)
        start = time.perf_counter()
        run(fn)
        calls[name] = (max(1, int(min_sample_s / max(time.perf_counter() - start, 1e-6))), sorted(k.seen))
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            n = calls[name][0]
            start = time.perf_counter()
            for _ in range(n):
                run(fn)
            samples[name].append((time.perf_counter() - start) / n * 1e3)
    first = statistics.median(samples[next(iter(variants))])
    return {name: {"ms": statistics.median(s), "ratio": statistics.median(s) / first, "kernels": calls[name][1]}
            for name, s in samples.items()}


def _check_equal(variants: dict) -> float:
    """Max |difference| of every variant's output from the first's (they compute the same attention)."""
    outs = [fn().detach().float() for fn in variants.values()]
    return max(float((o - outs[0]).abs().max()) for o in outs)


def cp_bytes() -> list[dict]:
    """Per gathered token: values moved (expanded K/V vs latent + rotary key) and the up-projection's
    FLOPs that each rank runs on it after the latent gather (forward; backward is twice that)."""
    from models.presets import PRESETS

    rows = []
    for name in ("deepseek_v3_671b", "kimi_k2_1t"):
        c = PRESETS[name]
        expanded = c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
        latent = c.kv_lora_rank + c.qk_rope_head_dim
        rows.append({"preset": name, "expanded_values": expanded, "latent_values": latent,
                     "ratio": expanded / latent,
                     "up_projection_mflop_forward": 2 * c.kv_lora_rank * c.n_heads
                     * (c.qk_nope_head_dim + c.v_head_dim) / 1e6})
    return rows


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--small", action="store_true", help="one tiny shape per group (tests)")
    args = p.parse_args(argv)
    check_outputs([("--json", args.json)])
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    causal_shapes, cp_shapes = (CAUSAL_SHAPES, CP_SHAPES) if not args.small else ([(1, 2, 64)], [(1, 2, 64, 4)])
    min_sample = MIN_SAMPLE_S if not args.small else 0.0  # --small: one call per sample
    rows = []
    for dtype in dtypes:
        for B, H, S in causal_shapes:
            variants, grad = causal_variants(B, H, S, dtype)
            diff = _check_equal(variants)
            for name, r in _time(variants, grad, args.repeats, min_sample).items():
                rows.append({"group": "causal", "dtype": str(dtype).split(".")[1], "shape": [B, H, S],
                             "variant": name, **r, "max_abs_diff_vs_first": diff})
        for B, H, S, cp in cp_shapes:
            variants, grad = cp_variants(B, H, S, cp, dtype)
            diff = _check_equal(variants)
            logits = cp_logits(S, cp)
            for name, r in _time(variants, grad, args.repeats, min_sample).items():
                rows.append({"group": "cp", "dtype": str(dtype).split(".")[1], "shape": [B, H, S], "cp": cp,
                             "variant": name, **r, "max_abs_diff_vs_first": diff, "logits_per_head": logits[name]})
    out = {"threads": args.threads, "repeats": args.repeats, "qk_head_dim": QK, "v_head_dim": V, "rows": rows,
           "cp_bytes": cp_bytes()}
    for r in rows:
        print(f"{r['group']:6s} {r['dtype']:8s} {str(r['shape']):16s} cp={r.get('cp', 1)} {r['variant']:14s} "
              f"{r['ms']:9.2f} ms  x{r['ratio']:.2f}  {','.join(r['kernels'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
