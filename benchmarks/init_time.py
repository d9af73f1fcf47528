"""Time of the seeded init of ONE rank's shards for a preset and layout, on this machine's CPU.

No process group: each parameter's local box comes from the layout's placements
(optim/sharded_specs.py conventions, optim/sharded_boxes.local_box) at the given rank's mesh
coordinate, and `models.seeded_init.normal_box` draws exactly what that rank would draw (results
are discarded, one parameter at a time, so memory stays at one shard of one parameter).

    python benchmarks/init_time.py --preset kimi_k2_1t --world 256 --rank 0 [--layers N] [--threads T]
"""

import argparse
import math
import os
import sys
import time

import torch
from torch.distributed.tensor import Replicate, Shard

if __package__ in (None, ""):  # `python benchmarks/init_time.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import Transformer, preset
from models.experts import GroupedExperts
from models.layers import RMSNorm
from models.seeded_init import normal_box
from optim.sharded_boxes import local_box
from optim.sharded_specs import _expert_placements
from runtime.config import load_config


def rank_boxes(config, layout, rank: int):
    """[(fqn, full shape, box shape, box offset)] of the drawn parameters held by `rank`."""
    with torch.device("meta"):
        model = Transformer(config)
    experts = {f"{p}.{n}" for p, m in model.named_modules() if isinstance(m, GroupedExperts) for n in ("w1", "w2", "w3")}
    norms = {f"{p}.weight" for p, m in model.named_modules() if isinstance(m, RMSNorm)}
    dense_mesh = (layout.dp_replicate, layout.dp_shard * layout.cp)
    expert_mesh = (layout.edp_replicate, layout.edp_shard, layout.ep)
    out = []
    for fqn, p in model.named_parameters():
        if fqn in norms:
            continue  # filled with ones, not drawn
        mesh, placements = ((expert_mesh, _expert_placements(config.n_routed_experts, layout)) if fqn in experts
                            else (dense_mesh, (Replicate(), Shard(0))))
        coordinate = [int(c) for c in torch.arange(layout.world_size).view(mesh).eq(rank).nonzero()[0]]
        box = local_box(tuple(p.shape), mesh, placements, coordinate)
        out.append((fqn, tuple(p.shape), tuple(b - a for a, b in box), tuple(a for a, _ in box)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/kimi_k2_256gpu.toml")
    ap.add_argument("--world", type=int, default=256)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="time only the first N layers' parameters (0 = all)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    config = load_config(["--config", args.config])
    torch.set_num_threads(args.threads)
    boxes = rank_boxes(config.model, config.layout(args.world), args.rank)
    if args.layers:
        boxes = [b for b in boxes if not b[0].startswith("layers.") or int(b[0].split(".")[1]) < args.layers]
    start, elements = time.perf_counter(), 0
    for fqn, full, shape, offset in boxes:
        if math.prod(shape):
            normal_box(full, shape, offset, 0.02, 0, fqn)
            elements += math.prod(shape)
    seconds = time.perf_counter() - start
    result = {"preset": config.model_preset, "world": args.world, "rank": args.rank, "layers": args.layers or "all",
              "threads": args.threads, "elements": elements, "seconds": seconds, "elements_per_s": elements / seconds}
    print(result)
    return result


if __name__ == "__main__":
    main()
