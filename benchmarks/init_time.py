"""Time of the seeded init of ONE rank's shards for a preset and layout, on this machine's CPU.

No process group: each parameter's local box comes from the layout's placements
(planning/memory/pretrain.rank_boxes) at the given rank's mesh coordinate, and
`models.seeded_init.normal_box` draws exactly what that rank would draw (results are discarded, one
parameter at a time, so memory stays at one shard of one parameter).

    python benchmarks/init_time.py [--config configs/kimi_k2_256gpu.toml] [--world 256] [--rank 0] [--layers N] [--threads T]
"""

import argparse
import math
import os
import sys
import time

import torch

if __package__ in (None, ""):  # `python benchmarks/init_time.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from planning.memory.pretrain import rank_boxes  # noqa: E402
from models import Transformer  # noqa: E402
from models.layers import RMSNorm  # noqa: E402
from models.seeded_init import normal_box  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402


def drawn_boxes(config, layout, rank: int):
    """[(fqn, full shape, local shape, offset)] of the parameters `rank` draws (norm weights are ones)."""
    with torch.device("meta"):
        model = Transformer(config)
    norms = {f"{p}.weight" for p, m in model.named_modules() if isinstance(m, RMSNorm)}
    return [(fqn, full, shape, offset) for fqn, full, shape, offset, _ in rank_boxes(config, layout, rank)
            if fqn not in norms]


@user_errors
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
    boxes = drawn_boxes(config.model, config.layout(args.world), args.rank)
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
