"""Step time of a MoE model's forward + backward with and without the chunked EP overlap, side by side.

    torchrun --nproc_per_node 4 benchmarks/ep_overlap.py [--chunks 2] [--steps 12] [--json PATH]
        [--dispatch-dtype compute|float8_e4m3]   (both variants dispatch in it)
        [--dedup]   (both variants node-deduplicated, 2 simulated nodes: the pieces pipeline the node hop)

Gloo on CPU: the debug preset widened (dim 256, 16 experts, top-4) so the grouped matmuls and the
all-to-alls both take time; ep over all ranks, FSDP over all ranks. The variants alternate step by
step (same data) so machine noise hits both alike; the first step of each is a warm-up. Reports
the median step time of each and their ratio (overlap / none), and for the overlapped run the
fraction of the first layer's grouped-matmul time during which another piece's all-to-all was in
flight (from parallel/ep/pieces.py's timeline). On shared cores gloo's transfer threads compete
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

SHAPE = dict(dim=256, moe_inter_dim=512, n_routed_experts=16, n_activated_experts=4, n_layers=3)
BATCH, SEQ = 4, 128


def build(chunks: int, dispatch_dtype: str = "compute", dedup: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset("debug", **SHAPE))
    model.init_weights()
    world = dist.get_world_size()
    layout = ParallelConfig(dp_shard=world, ep=world, edp_shard=1, ep_overlap_chunks=chunks,
                            ep_dispatch_dtype=dispatch_dtype, ep_dedup=dedup,
                            ranks_per_node=max(1, world // 2)).resolve(world)
    parallelize(model, build_meshes(layout, "cpu"), layout)
    return model


def step(model, tokens) -> float:
    start = time.perf_counter()
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], tokens[:, 1:].numel())
    loss.backward()
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
    args = p.parse_args(argv)
    check_outputs([("--json", args.json)])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    models = {c: build(c, args.dispatch_dtype, args.dedup) for c in (1, args.chunks)}
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    times = {c: [] for c in models}
    for _ in range(args.steps + 1):
        for c, model in models.items():
            times[c].append(step(model, tokens))
    timeline = []
    dispatchers(models[args.chunks])[0].timeline = timeline
    step(models[args.chunks], tokens)
    medians = {c: statistics.median(v[1:]) for c, v in times.items()}
    out = {"world": dist.get_world_size(), "dispatch_dtype": args.dispatch_dtype, "dedup": args.dedup,
           "shape": SHAPE, "batch": BATCH, "seq": SEQ, "steps": args.steps,
           "median_step_s": {str(c): m for c, m in medians.items()},
           "ratio_overlap_over_none": medians[args.chunks] / medians[1],
           "forward_matmul_time_covered_by_other_pieces_all_to_all": overlap_fraction(timeline)}
    if dist.get_rank() == 0:
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
