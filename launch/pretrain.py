"""Entry point: `torchrun --nproc_per_node N launch/pretrain.py [--config PATH] [--section.key=value ...]`.

load config -> check the layout (every rank, before any process group) -> init the process group ->
build meshes -> train -> tear down in `finally`. A config mistake exits with status 2 and one line.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.meshes import build_meshes, describe  # noqa: E402
from runtime.config import help_text, load_config  # noqa: E402
from runtime.data import Loader  # noqa: E402
from runtime.train import train  # noqa: E402


def check_environment(config) -> None:
    """The requested device exists and the data source opens (ValueError naming the key otherwise)."""
    if config.training.device_type() == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device='cuda' but torch sees no CUDA device (use 'auto' or 'cpu')")
    Loader(config.data, config.training.seed, grad_accum=config.training.grad_accum,
           vocab_size=config.model.vocab_size).batch(0)  # the first batch's token ids fit the model


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        config = load_config(argv)
        layout = config.layout(world_size)
        check_environment(config)
    except ValueError as e:  # ConfigError and data/device errors: every rank fails the same way, before any collective
        print(f"config error: {e}", file=sys.stderr)
        return 2
    device_type = config.training.device_type()
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")) if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:  # torchrun (or any env:// launcher)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:  # plain `python launch/pretrain.py`: one process, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        meshes = build_meshes(layout, device_type)
        if rank == 0:
            print(describe(layout, config.model), flush=True)
        train(config, layout, meshes, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
