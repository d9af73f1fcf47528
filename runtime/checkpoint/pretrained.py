"""Start a run from a Hugging Face checkpoint (`--model.init_from=DIR`).

`check_init_from` runs on every rank before any process group exists (every file's header, no tensor
bytes), so a bad directory fails in one line with nothing written. `init_from_pretrained` then fills each
rank's shards with only that rank's bytes (models/hf/checkpoint.py), opening only the files that hold them
(under pipeline parallelism a rank's model is its stages, so it opens only its stages' files), without
communication but for one small all-gather at the end: a tensor that cannot be read or holds NaN/inf on any
rank stops every rank with one line (RunError, exit 2; the run-dir lock is released on the way out). A run
directory that already holds a checkpoint resumes from it instead, and says so once.
"""

import torch.distributed as dist

from models.hf.check import check_checkpoint
from models.hf.checkpoint import load_state, plan_files
from models.hf.config import read_hf_config
from runtime.checkpoint import checkpoint
from runtime.errors import RunError


def resuming(run_dir: str) -> bool:
    return checkpoint.latest_checkpoint(checkpoint.checkpoint_dir(run_dir)) is not None


def check_init_from(config) -> None:
    """ValueError (one line, starting with model.init_from) if the directory does not fit config.model."""
    path = config.model_init_from
    if not path or resuming(config.run.dir):
        return
    try:
        check_checkpoint(path, config.model, read_hf_config(path)[1])
    except ValueError as e:
        raise ValueError(f"model.init_from: {e}") from None


def init_from_pretrained(config, model, rank: int) -> bool:
    """Load model.init_from into the (sharded, materialized) model, or this rank's pipeline stages of it
    (parallel/pp/part.py); False when there is nothing to load."""
    path = config.model_init_from
    if not path:
        return False
    if resuming(config.run.dir):
        if rank == 0:
            print(f"{config.run.dir} has checkpoints: resuming from them, model.init_from={path} is ignored", flush=True)
        return False
    error = None
    try:
        _, fmt = read_hf_config(path)
        files = plan_files(model, path, fmt)  # the files holding this rank's boxes: only these are opened
        notes = check_checkpoint(path, config.model, fmt, files)
        bytes_read = load_state(model, path, fmt, files)
    except ValueError as e:  # a file changed since the start-up check, an unreadable or non-finite tensor
        error = f"model.init_from: {e}"
    error = _first_error(error)
    if error is not None:
        raise RunError(error)
    if rank == 0:
        for note in notes:
            print(note, flush=True)
        print(f"initialized from {path}: rank 0 read {bytes_read:,} bytes of tensors from {len(files.names)} "
              f"of {len(set(files.weight_map.values()))} files", flush=True)
    return True


def _first_error(error: str | None) -> str | None:
    """The lowest failing rank's error, on every rank, so all stop together (a rank reads only its own
    boxes, so one may meet a bad tensor that the others never touch). Collective: one small all-gather."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)
