"""Host synchronizations per training step (runtime/syncs.py), per rank, for any config.

    python benchmarks/host_syncs.py [--json PATH] [--section.key=value ...]          # 1 process
    torchrun --nproc_per_node 8 benchmarks/host_syncs.py [--json PATH] [overrides]   # 8 ranks

Builds the runtime's model, optimizer and loader exactly as `launch/pretrain.py` does, runs one
warm-up step (one-time work: plans, lazy state), then counts the syncs of the next `--steps` steps
of `runtime.train.train_step` and prints the per-step count, by kind and by call site (rank 0).
A CPU run counts what the same code would do on a GPU (see runtime/syncs.py for what it cannot see).
"""

import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/host_syncs.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from parallel.meshes import build_meshes
from runtime import train as T
from runtime.cli import user_errors
from runtime.config_parser import load_config
from runtime.paths import check_outputs
from runtime.syncs import count_syncs, mark_optimizer_host_state

SMALL = ["--training.steps=10", "--checkpoint.interval=0", "--run.dir=/tmp/twinmesh_host_syncs"]


def measure(argv: list[str], steps: int = 1) -> dict:
    """Syncs per step of this rank (process group already initialized), averaged over `steps` steps."""
    config = load_config(SMALL + argv)
    layout = config.layout(dist.get_world_size())
    device = torch.device(config.training.device_type())
    meshes = build_meshes(layout, device.type)
    model = T.build_model(config, meshes, layout, device)
    optimizer = T.build_optimizer(model, config)
    scheduler = T.build_scheduler(optimizer, config.training)
    loader = T.build_loader(config, meshes, layout)
    T.train_step(model, optimizer, scheduler, loader, config, device)  # warm-up
    mark_optimizer_host_state(optimizer)  # AdamW's step counters are CPU scalars on a GPU too
    with count_syncs(device.type) as counts:
        for _ in range(steps):
            T.train_step(model, optimizer, scheduler, loader, config, device)
    n_moe = len(model.routers())
    return {"per_step": counts.total / steps, "by_kind": {k: v / steps for k, v in counts.by_kind.items()},
            "by_site": {k: v / steps for k, v in counts.by_site.most_common()}, "world": layout.world_size,
            "ep": layout.ep, "moe_layers": n_moe, "micro_batches": config.training.grad_accum,
            "device": device.type}


def _print(result: dict) -> None:
    print(f"host syncs per step: {result['per_step']:g} (world {result['world']}, ep {result['ep']}, "
          f"{result['moe_layers']} MoE layers, {result['micro_batches']} micro-batches, {result['device']})")
    print("  by kind: " + ", ".join(f"{k} {v:g}" for k, v in result["by_kind"].items()))
    for site, n in result["by_site"].items():
        print(f"  {n:6g}  {site}")


@user_errors
def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    json_path = None
    if "--json" in argv:
        i = argv.index("--json")
        json_path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        check_outputs([("--json", json_path)])
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    backend = "gloo"
    if load_config(SMALL + argv).training.device_type() == "cuda":
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = measure(argv)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _print(result)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
