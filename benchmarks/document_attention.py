"""Document-masked attention on the CPU (models/document_attention.py) against unmasked causal attention:
forward + backward time (median) and peak tensor memory, at S = 2048 and 8192.

    python benchmarks/document_attention.py [--json PATH] [--seqs 2048,8192] [--repeats 3]

Variants, fp32, B = 1, H heads of width E (MLA-like widths are similar per FLOP):
  causal        F.scaled_dot_product_attention(is_causal=True): the CPU flash kernel, no mask (the floor)
  documents     document_attention over documents of `--doc-len` tokens (blocks of 512 queries, each on its
                visible key range with a boolean [B, 1, Q, K'] mask)
  one_document  document_attention with the whole row one document: its worst case (every key range long)
  dense_mask    one SDPA call with the whole boolean [B, 1, S, S] mask (what the blocks avoid)
Peak memory is measured by benchmarks/lib/memory_peak.py (torch's MemTracker: every tensor storage created,
inputs and their gradients included), not modelled. A CPU proxy: on CUDA the plan is FlexAttention.
"""

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks.lib.memory_peak import track_peak
from models.document_attention import document_attention
from runtime.cli import user_errors
from runtime.paths import check_outputs


def variants(S: int, doc_len: int):
    pos = torch.arange(S)
    docs = (pos // doc_len)[None]
    one = torch.zeros(1, S, dtype=torch.int64)
    dense = ((docs[:, None, :] == docs[:, :, None]) & (pos[None, :] <= pos[:, None])).unsqueeze(1)
    return {
        "causal": lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s),
        "documents": lambda q, k, v, s: document_attention(q, k, v, pos, pos, docs, s),
        "one_document": lambda q, k, v, s: document_attention(q, k, v, pos, pos, one, s),
        "dense_mask": lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=s),
    }


def run_once(fn, H: int, S: int, E: int) -> tuple[float, int]:
    """(seconds of forward + backward, peak bytes of the region)."""
    q, k, v = (torch.randn(1, H, S, E, requires_grad=True) for _ in range(3))
    with track_peak() as peak:
        start = time.perf_counter()
        fn(q, k, v, E**-0.5).sum().backward()
        seconds = time.perf_counter() - start
    return seconds, peak()["Total"]


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--seqs", default="2048,8192")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    check_outputs([("--json", args.json)])
    torch.set_num_threads(args.threads)
    rows = []
    for S in (int(s) for s in args.seqs.split(",")):
        base = None
        for name, fn in variants(S, args.doc_len).items():
            runs = [run_once(fn, args.heads, S, args.head_dim) for _ in range(args.repeats)]
            ms, mib = 1e3 * statistics.median(r[0] for r in runs), max(r[1] for r in runs) / 2**20
            base = base or (ms, mib)
            rows.append({"S": S, "variant": name, "ms": round(ms, 1), "peak_mib": round(mib, 1),
                         "time_vs_causal": round(ms / base[0], 2), "memory_vs_causal": round(mib / base[1], 2)})
            print(f"S={S:5d} {name:13s} {ms:9.1f} ms  {mib:8.1f} MiB  x{ms / base[0]:.2f} time  "
                  f"x{mib / base[1]:.2f} memory", flush=True)
    result = {"heads": args.heads, "head_dim": args.head_dim, "doc_len": args.doc_len, "threads": args.threads,
              "repeats": args.repeats, "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
