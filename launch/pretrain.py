"""Entry point: `torchrun --nproc_per_node N launch/pretrain.py [--config PATH] [--section.key=value ...]`.

load config -> check the layout and data (every rank, before any process group) -> init the process
group -> open the data that needs the ranks to check it (post-training's rollouts) -> lock the run dir
-> build meshes -> train -> tear down in `finally`. Run as a script, the config and layout are checked
first, before torch loads (launch/precheck.py): a typo costs no import. A launch refused by any of these
checks leaves no run dir behind; the run dir's `kind` file is written when the first step starts.

Exit status: 0 done; 2 bad input, config or run dir; 3 diverged; 4 a collective timed out or a peer died
(runtime/comm.py); 143 preempted (checkpoint saved). Every stop prints one line, from rank 0 only, except
4: one line per rank (runtime/errors.py).
"""

import dataclasses
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch import precheck  # noqa: E402
from launch.precheck import stop  # noqa: E402

if __name__ == "__main__":  # a config error exits here, before torch and the model code load
    precheck.training_job(sys.argv[1:])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.meshes import build_meshes, describe  # noqa: E402
from runtime.cli import EXIT_USER_ERROR  # noqa: E402
from runtime.comm import init_process_group  # noqa: E402
from runtime.config import TrainingConfig  # noqa: E402
from runtime.config_parser import help_text  # noqa: E402
from parallel.ep.direct import check_fp8_device  # noqa: E402
from runtime.data.loader import Loader, check_token_ids, token_files  # noqa: E402
from runtime.errors import RunError  # noqa: E402
from runtime.paths import check_profile_dir, check_run_dir_apart, check_run_kind, job_kind  # noqa: E402
from runtime.posttrain.config import PosttrainConfig  # noqa: E402
from runtime.checkpoint.pretrained import check_init_from  # noqa: E402
from runtime.checkpoint.run_lock import check_run_dir, run_lock  # noqa: E402
from runtime.train import compile_backend, describe_compile, train  # noqa: E402

STORE_TIMEOUT = datetime.timedelta(minutes=10)


def check_environment(config) -> None:
    """The requested device exists, the run dir can be made, the data sources open and no key is set
    that only post-training reads (ValueError naming the key otherwise)."""
    if config.training.device_type() == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device='cuda' but torch sees no CUDA device (use 'auto' or 'cpu')")
    for key in ("ep_dispatch_dtype", "ep_combine_grad_dtype"):
        if getattr(config.parallel, key) != "compute":
            check_fp8_device(config.training.device_type(), key)  # parallel.<key>: float8 on this device
    if config.data.source == "rollouts":
        raise ValueError("data.source='rollouts' is post-training data: run launch/posttrain.py")
    default = PosttrainConfig()
    if changed := [f"posttrain.{f.name}" for f in dataclasses.fields(default)
                   if getattr(config.posttrain, f.name) != getattr(default, f.name)]:
        raise ValueError(f"{', '.join(changed)}: read by launch/posttrain.py only, no effect on pre-training")
    check_run(config)
    check_token_sources(config)
    check_init_from(config)  # model.init_from: files, keys, shapes (headers only)


def check_run(config) -> None:
    """run.dir can be made, holds no run of the other kind, and what the run writes there (checkpoints/,
    metrics.jsonl) is none of its inputs (runtime/paths.py): ValueError naming the keys otherwise."""
    check_run_dir(config.run.dir)
    check_run_kind(config.run.dir, job_kind(config))
    data = config.data
    keys = [("data.path", data.path), ("eval.path", config.eval.path), ("model.init_from", config.model_init_from),
            ("posttrain.init_from", config.posttrain.init_from)]
    keys += [(f"data.sources[{i}].path", source.path) for i, source in enumerate(data.sources)]
    check_run_dir_apart(config.run.dir, [(f"{key}={path}", path) for key, path in keys])
    if config.profile.enabled:
        check_profile_dir(config.run.dir, config.profile.dir)


def check_compile_backend(config, layout) -> None:
    """ValueError when training.compile_backend is set but nothing compiles (it would be ignored)."""
    backend = config.training.compile_backend
    if backend != TrainingConfig().compile_backend and compile_backend(config, layout) is None:
        raise ValueError(f"training.compile_backend={backend!r} has no effect: nothing compiles here "
                         f"({describe_compile(config, layout)[len('compile: '):]}); drop it, or compile with "
                         f"training.compile=true")


def check_token_sources(config) -> None:
    """Every token source the run will read (training, held-out) opens, holds a window of data.seq_len + 1
    tokens in its split and only ids below model.vocab_size: what the loaders would find after init."""
    scanned = set()  # a held-out split reads data.path too: its ids are scanned once
    for split, (data, holdout, key) in config.token_splits().items():
        Loader(data, config.training.seed, grad_accum=config.training.grad_accum,
               vocab_size=config.model.vocab_size, holdout=holdout, split=split, path_key=key)
        for path, path_key in token_files(data, key):
            if path not in scanned:
                check_token_ids(path, data.dtype, config.model.vocab_size, path_key)
                scanned.add(path)


def rendezvous_store(rank: int, world_size: int) -> dist.Store:
    """The env:// store, with keys prefixed per torchrun restart attempt.

    torchrun's agent keeps ONE store across `--max-restarts` attempts, and torch's env:// init gives
    every attempt the same key names, so restarted workers read the dead workers' gloo addresses
    ("connectFullMesh failed ... Connection refused"; reproduced on torch 2.13 with 5 of 6 restarts
    failing, 0 of 6 with this prefix)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=STORE_TIMEOUT)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def set_allocator_defaults(environ=os.environ) -> None:
    """Expandable segments for the CUDA caching allocator, unless the user chose an allocator setting:
    MoE tensors change size every step (tokens per expert), which fragments fixed-size segments. Read by
    torch when CUDA first allocates, so set before any CUDA work; no effect on the CPU."""
    if "PYTORCH_ALLOC_CONF" not in environ and "PYTORCH_CUDA_ALLOC_CONF" not in environ:
        environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def main(argv: list[str], *, check=check_environment, build_objective=None, path_source: str = "bin",
         open_data=None) -> int:
    """`check(config)` raises ValueError on a bad device or data source; `build_objective`: see runtime/train.py;
    `path_source`: what a data.path given without data.source is (runtime/config_parser.py load_config);
    `open_data(config)`: collective, after the process group exists and before the run dir is locked (so a
    bad file leaves no run dir): the data the loader reads (RunError when it is bad), passed to `train`."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    set_allocator_defaults()
    world_size, rank = precheck.world()
    try:
        config, layout = precheck.job(argv, world_size, path_source)
        check(config)
        check_compile_backend(config, layout)
    except ValueError as e:  # ConfigError and data/device errors: every rank fails the same way, before any collective
        return stop(rank, f"config error: {e}", EXIT_USER_ERROR)
    except RunError as e:  # e.g. an unreadable checkpoint marker met by a check
        return stop(rank, str(e), e.exit_code)
    device_type = config.training.device_type()
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")) if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device_type == "cuda" else "gloo"
    store = rendezvous_store(rank, world_size) if "MASTER_ADDR" in os.environ else dist.HashStore()
    init_process_group(config.comm, backend, store, rank, world_size, device, config.run.dir)
    try:
        data = open_data(config) if open_data is not None else None
        with run_lock(config.run.dir, rank):
            meshes = build_meshes(layout, device_type)
            if rank == 0:
                print(f"outputs: {os.path.abspath(config.run.dir)} (run.dir: metrics.jsonl, checkpoints/)", flush=True)
                print(describe(layout, config.model), flush=True)
                print(describe_compile(config, layout), flush=True)
            train(config, layout, meshes, device, build_objective, data=data)
    except RunError as e:  # raised identically on every rank (a CommFailure: each rank its own line)
        code = stop(rank, str(e), e.exit_code, every_rank=getattr(e, "every_rank", False))
        if getattr(e, "abandoned_write", False):  # a checkpoint thread stuck in a collective: exit without it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
