"""Step time of a MoE model's forward + backward with and without the chunked EP overlap, side by side.

    torchrun --nproc_per_node 4 benchmarks/ep_overlap.py [--chunks 2] [--steps 12] [--json PATH]
        [--dispatch-dtype compute|float8_e4m3]   (both variants dispatch in it)
        [--dedup]   (both variants node-deduplicated, 2 simulated nodes: the pieces pipeline the node hop)
        [--interleave]   (the overlapped variant is parallel.ep_interleave's two halves instead of pieces;
                          one sequence per rank: the split by positions)
        [--pair M]   (both variants run the halves over M micro-batches per step (--interleave implied); the
                      overlapped one pairs each backward with the next forward: parallel.ep_pair_micro_batches)
        [--ahead]   (both variants run the halves under full checkpointing with kept exchanges, paired if --pair;
                     the overlapped one recomputes ahead: parallel.ep_recompute_ahead)

Gloo on CPU: the debug preset widened (dim 256, 16 experts, top-4) so the grouped matmuls and the
all-to-alls both take time; ep over all ranks, FSDP over all ranks. The variants alternate step by
step (same data) so machine noise hits both alike; the first step of each is a warm-up. Reports
the median step time of each and their ratio (overlap / none), and for the overlapped run the
fraction of the first layer's grouped-matmul time during which another piece's all-to-all was in
flight (from parallel/ep_overlap.py's timeline). On shared cores gloo's transfer threads compete
with the matmuls for the same CPUs, so the ratio measures little more than that the pipeline costs
nothing; the overlap itself pays on a GPU, where the network and the SMs are separate hardware.
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
import torch.distributed as dist

from models import Transformer, preset
from parallel.gradients import loss_fn
from parallel.ep.dispatcher import dispatchers
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize
from runtime.cli import user_errors
from runtime.paths import check_outputs
from runtime.train import forward_backward

SHAPE = dict(dim=256, moe_inter_dim=512, n_routed_experts=16, n_activated_experts=4, n_layers=3)
BATCH, SEQ = 4, 128


def build(chunks: int, dispatch_dtype: str = "compute", dedup: bool = False, interleave: bool = False,
          pair: bool = False, checkpoint: str = "none", ahead: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset("debug", **SHAPE))
    model.init_weights()
    world = dist.get_world_size()
    layout = ParallelConfig(dp_shard=world, ep=world, edp_shard=1, ep_overlap_chunks=1 if interleave else chunks,
                            ep_interleave=interleave, ep_dispatch_dtype=dispatch_dtype, ep_dedup=dedup,
                            ep_pair_micro_batches=pair, ep_recompute="keep" if checkpoint != "none" else "resend",
                            ep_recompute_ahead=ahead, ranks_per_node=max(1, world // 2)).resolve(world)
    parallelize(model, build_meshes(layout, "cpu"), layout, activation_checkpoint=checkpoint)
    return model


def step(model, tokens, micro_batches: int = 1) -> float:
    start = time.perf_counter()
    if micro_batches == 1:
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], tokens[:, 1:].numel())
        loss.backward()
    else:  # runtime/train.py's loop (paired under parallel.ep_pair_micro_batches)
        positions = torch.arange(SEQ)
        batches = [(t[:, :-1], t[:, 1:], positions) for t in tokens.chunk(micro_batches)]
        forward_backward(model, batches, tokens[:, 1:].numel(), torch.device("cpu"))
    dist.barrier()
    return time.perf_counter() - start


def overlap_fraction(timeline) -> float:
    """Fraction of the pieces' forward grouped-matmul time during which another piece's all-to-all was
    in flight (between its start and its wait)."""
    t = {(e, p): w for e, p, w in timeline}
    pieces = sorted({p for e, p in t if e == "compute_start"})
    covered = total = 0.0
    for i in pieces:
        lo, hi = t["compute_start", i], t["compute_end", i]
        spans = sorted((max(lo, t[f"{k}_start", j]), min(hi, t[f"{k}_wait", j]))
                       for k in ("dispatch", "combine") for j in pieces if j != i)
        end = lo
        for a, b in spans:  # length of the union of the clipped spans
            if b > max(a, end):
                covered += b - max(a, end)
                end = b
        total += hi - lo
    return covered / total if total else 0.0


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json")
    p.add_argument("--dispatch-dtype", default="compute", choices=("compute", "float8_e4m3"))
    p.add_argument("--dedup", action="store_true")
    p.add_argument("--interleave", action="store_true")
    p.add_argument("--pair", type=int, default=0, help="micro-batches per step, paired in the overlapped variant")
    p.add_argument("--ahead", action="store_true", help="in order vs recompute ahead (full checkpointing, halves)")
    args = p.parse_args(argv)
    if args.pair == 1 or args.pair < 0:
        p.error(f"--pair {args.pair}: needs at least 2 micro-batches (0: off)")
    args.interleave = args.interleave or args.pair > 1 or args.ahead
    if args.interleave and args.dedup:
        p.error("--interleave with --dedup: parallel.ep_interleave does not combine with parallel.ep_dedup")
    check_outputs([("--json", args.json)])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    pair, M = args.pair > 1, max(1, args.pair)
    both = args.ahead  # --ahead: the halves (and the pairing) in both variants, only the recompute's time differs
    models = {c: build(c, args.dispatch_dtype, args.dedup, args.interleave and (c > 1 or pair or both),
                       pair and (c > 1 or both), "full" if both else "none", both and c > 1)
              for c in (1, args.chunks)}
    tokens = torch.randint(0, 256, (BATCH * M, SEQ + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    times = {c: [] for c in models}
    for _ in range(args.steps + 1):
        for c, model in models.items():
            times[c].append(step(model, tokens, M))
    timeline = []
    dispatchers(models[args.chunks])[0].timeline = timeline
    step(models[args.chunks], tokens, M)
    medians = {c: statistics.median(v[1:]) for c, v in times.items()}
    out = {"world": dist.get_world_size(), "dispatch_dtype": args.dispatch_dtype, "dedup": args.dedup, "interleave": args.interleave, "pair_micro_batches": args.pair, "ahead": args.ahead, "shape": SHAPE, "batch": BATCH, "seq": SEQ, "steps": args.steps,
           "median_step_s": {str(c): m for c, m in medians.items()},
           "ratio_overlap_over_none": medians[args.chunks] / medians[1],
           # the paired forward's and backward's marks share the timeline: tests/test_ep_pairing.py reads that overlap
           "forward_matmul_time_covered_by_other_pieces_all_to_all": None if pair or both else overlap_fraction(timeline)}
    if dist.get_rank() == 0:
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
