"""Load time, peak RSS and bytes read per rank for `--model.init_from` of a ~1 GB checkpoint.

    python benchmarks/hf_load.py --make DIR                      # write a random ~0.9 GB bf16 checkpoint
    torchrun --nproc_per_node N benchmarks/hf_load.py --dir DIR  # measure on N ranks (gloo, CPU)

Each rank builds the model on the meta device, shards it with the runtime's default layout for N
ranks (FSDP over all ranks, ep = gcd(N, experts)), materializes its shards and times `load_state`
(models/hf/checkpoint.py). Peak RSS is `ru_maxrss`, which counts the touched pages of the memory-mapped
safetensors files as well as the model shards; RSS before the load is reported alongside.
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models import Transformer, preset  # noqa: E402
from models.hf.checkpoint import load_state, save_pretrained  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402

# ~462M parameters: 0.92 GB in bf16 (80 experts of 1024 x 512 in each of 3 MoE layers: 82% of it).
SHAPE = dict(vocab_size=32000, dim=1024, n_layers=4, n_dense_layers=1, n_heads=8, q_lora_rank=256, kv_lora_rank=128,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, inter_dim=2048, moe_inter_dim=512,
             n_routed_experts=80, n_shared_experts=1, n_activated_experts=4, max_seq_len=4096, latent_norm_eps=1e-6)


def make(directory: str) -> None:
    model = Transformer(preset("debug", **SHAPE))
    model.init_weights(torch.Generator().manual_seed(0))
    save_pretrained(model, directory, dtype=torch.bfloat16, shard_bytes=2**28)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(directory: str) -> dict:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    config = load_config([f"--model.init_from={directory}", "--data.source=synthetic", "--data.batch_size=64"])
    layout = config.layout(world_size)
    with torch.device("meta"):
        model = Transformer(config.model)
    parallelize(model, build_meshes(layout, "cpu"), layout)
    model.to_empty(device="cpu")
    before = rss_mib()
    dist.barrier()
    start = time.perf_counter()
    bytes_read = load_state(model, directory)
    seconds = time.perf_counter() - start
    row = {"rank": rank, "seconds": seconds, "bytes_read": bytes_read, "rss_before_mib": before,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    rows = [None] * world_size
    dist.all_gather_object(rows, row)
    return {"world_size": world_size, "layout": str(layout), "ranks": rows}


@user_errors
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", help="write the benchmark checkpoint into this directory and exit")
    parser.add_argument("--dir", help="the checkpoint to load")
    parser.add_argument("--out", default="", help="append the result (JSON line) to this file")
    args = parser.parse_args(argv)
    if args.make:
        make(args.make)
        return 0
    check_outputs([("--out", args.out)], [("a file of the --dir checkpoint", args.dir)])
    load_and_report(args.dir, args.out)
    return 0


def load_and_report(directory: str, out: str, **fields) -> None:
    """`measure` on this torchrun job's ranks; rank 0 prints the result (with `fields` and the checkpoint's
    bytes) and appends it as one JSON line to `out` when given."""
    dist.init_process_group("gloo")
    try:
        result = measure(directory)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        result.update(fields, checkpoint_bytes=sum(os.path.getsize(os.path.join(directory, n))
                                                   for n in os.listdir(directory) if n.endswith(".safetensors")))
        print(json.dumps(result, indent=1))
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
