"""The input pipeline against the training step: how long one rank waits for its batch.

    python benchmarks/data_pipeline.py [--json PATH] [--steps 6] [--seq-len 256] [--batch-size 16]

For each data setup, one process builds the runtime's model, optimizer and loader exactly as
launch/pretrain.py does (debug model, CPU) and times, per step, `loader.next_step()` (the batch this
rank reads: memory-mapped files, mixture draws, document ids) and the whole `train_step` (which calls
it). Also the loader alone as rank 0 of the headline layout (dp 4 x cp 2: an eighth of the rows, the
cp gather of its chunks), in tokens delivered per second. Setups (files generated once under --dir):
  flat          one flat .bin of 8M uint16 tokens
  mixture8      8 weighted indexed sources of 1M tokens each
  small_docs    one indexed dataset of ~200k documents of 1..80 tokens, data.document_mask = true
The training step of the 3-layer debug model is the smallest the runtime runs: for a real model the
same loader cost is a far smaller fraction.
"""

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.distributed as dist

from parallel.meshes import build_meshes
from runtime import train as T
from runtime.cli import user_errors
from runtime.config_parser import load_config
from runtime.data.indexed import IndexedWriter
from runtime.data.loader import Loader
from runtime.paths import check_output_dir, check_outputs


def make_files(directory: str, scale: int = 1) -> dict[str, str]:
    """The three setups' extra config lines (TOML), writing their files on first use (sizes / `scale`)."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    flat = os.path.join(directory, "flat.bin")
    if not os.path.exists(flat):
        rng.integers(0, 256, (8 << 20) // scale, dtype=np.uint16).tofile(flat)
    for i in range(8):
        _indexed(os.path.join(directory, f"source{i}"), lambda: rng.integers(100, 2000), (1 << 20) // scale, rng)
    _indexed(os.path.join(directory, "small_docs"), lambda: rng.integers(1, 80), (8 << 20) // scale, rng)
    sources = "".join(f'[[data.sources]]\npath = "{directory}/source{i}"\nweight = {i + 1}\nname = "s{i}"\n'
                      for i in range(8))
    return {"flat": f'path = "{flat}"\ndtype = "uint16"\n', "mixture8": sources,
            "small_docs": f'path = "{directory}/small_docs"\ndocument_mask = true\n'}


def _indexed(prefix: str, length, tokens: int, rng) -> None:
    if os.path.exists(prefix + ".idx"):
        return
    writer, left = IndexedWriter(prefix, np.uint16), tokens
    while left > 0:
        n = min(left, int(length()))
        writer.add_document(rng.integers(0, 256, n, dtype=np.uint16))
        left -= n
    writer.finalize()


def measure(config_path: str, steps: int) -> dict:
    """Median seconds per step of loader.next_step() and of the whole train_step, 1 process."""
    config = load_config(["--config", config_path])
    layout = config.layout(1)
    device = torch.device("cpu")
    meshes = build_meshes(layout, "cpu")
    model = T.build_model(config, meshes, layout, device)
    optimizer = T.build_optimizer(model, config)
    scheduler = T.build_scheduler(optimizer, config.training)
    loader = T.build_loader(config, meshes, layout)
    fetch, original = [], loader.next_step

    def timed_next_step():
        start = time.perf_counter()
        out = original()
        fetch.append(time.perf_counter() - start)
        return out

    loader.next_step = timed_next_step
    step_times = []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        T.train_step(model, optimizer, scheduler, loader, config, device)
        step_times.append(time.perf_counter() - start)
    step, batch = statistics.median(step_times[1:]), statistics.median(fetch[1:])
    return {"step_s": step, "fetch_s": batch, "fetch_fraction": batch / step,
            "step_tokens_per_s": config.data.tokens_per_step() / step}


def rank_rate(config_path: str, steps: int) -> float:
    """Tokens per second that loader.batch delivers to rank 0 of the headline layout (dp 4 x cp 2)."""
    config = load_config(["--config", config_path])
    data = config.data
    loader = Loader(data, 0, dp_rank=0, dp_degree=4, cp_rank=0, cp_degree=2, vocab_size=config.model.vocab_size,
                    holdout=config.eval.train_holdout())
    loader.batch(0)  # one-time work: lazy imports, the first epoch permutations, page faults
    start = time.perf_counter()
    tokens = sum(m.inputs_BS.numel() for step in range(1, steps + 1) for m in loader.batch(step))
    return tokens / (time.perf_counter() - start)


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default="/tmp/twinmesh_data_pipeline")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--small", action="store_true", help="files 64x smaller, 1 step (tests)")
    args = p.parse_args(argv)
    check_outputs([("--json", args.json)])
    check_output_dir("--dir", args.dir)
    torch.set_num_threads(args.threads)
    if args.small:
        args.steps, args.seq_len, args.batch_size = 1, 64, 8
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for name, lines in make_files(args.dir, 64 if args.small else 1).items():
            path = os.path.join(args.dir, f"{name}.toml")
            with open(path, "w") as f:
                f.write(f"[run]\ndir = \"{args.dir}/run_{name}\"\n[training]\nsteps = 1000\n[checkpoint]\ninterval = 0\n"
                        f"[eval]\ninterval = 0\n[data]\nseq_len = {args.seq_len}\nbatch_size = {args.batch_size}\n"
                        f"{lines}")
            row = {"setup": name, **measure(path, args.steps),
                   "rank0_of_8_tokens_per_s": rank_rate(path, 2 if args.small else 50)}
            rows.append(row)
            print(f"{name:11s} step {row['step_s'] * 1e3:8.1f} ms  fetch {row['fetch_s'] * 1e3:6.2f} ms "
                  f"({row['fetch_fraction']:.2%} of the step)  step {row['step_tokens_per_s']:,.0f} tok/s  "
                  f"loader alone (rank 0 of 8) {row['rank0_of_8_tokens_per_s']:,.0f} tok/s", flush=True)
    finally:
        dist.destroy_process_group()
    result = {"seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps, "threads": args.threads,
              "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
