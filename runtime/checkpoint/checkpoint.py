"""Distributed checkpoints with torch.distributed.checkpoint (DCP), written atomically (the `[checkpoint]` section:
runtime/checkpoint/dirs.py).

Layout: `<run.dir>/checkpoints/step_<N>/` holds DCP shard files, `.metadata` and a `COMPLETE` marker;
step N means N optimizer steps are done, so a resumed run continues with step N.

Atomicity: every rank writes into `step_<N>.tmp/`; after all ranks finished (barrier) rank 0 writes the
marker, fsyncs it and renames the directory to `step_<N>` (a rename is atomic on POSIX file systems).
`latest_checkpoint` only returns directories named `step_<N>` that hold the marker, so a crash at any
point leaves either the previous checkpoint or the new complete one. All ranks must see the same file
system (a shared one across nodes).

What is checked: every checkpoint's marker also records what must match to resume (the model config,
the optimizer, the schedule; `meta` of `save`), so a resume with another model fails with one line
naming the differing keys instead of silently dropping weights (DCP ignores extra keys). A save that
fails (disk full, I/O error) removes its `.tmp` and keeps every older checkpoint.

Resharding: FSDP2 parameters and optimizer states are DTensors; DCP stores each shard with its global
offsets, so a checkpoint saved under one layout loads under another. Plain (replicated) tensors and
Python values are written once (by the rank DCP picks) and read by every rank: all ranks must hold
the same value (true for the data position, the step and the RNG states of a seeded run).
"""

import contextlib
import errno
import json
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from runtime.checkpoint.dirs import (  # noqa: F401 (the torch-free part, as checkpoint.X)
    MARKER, CheckpointConfig, Unloadable, checkpoint_dir, checkpoint_step, complete_checkpoints, latest_checkpoint,
    STEP_DIR, read_meta,
)
from runtime.comm import comm_error_kind
from runtime.errors import RunError


OPTIM_FORMAT = "flat"  # recorded in each checkpoint's marker (runtime/train.py run_meta): see ModelOptimState


class ModelOptimState:
    """Model and optimizer(s) as one Stateful, through DCP's FSDP2-aware state-dict API.

    `flat` (the format checkpoints are written in): the optimizer's param-group settings are stored per
    parameter name (`flatten_optimizer_state_dict`), as its state is, so a checkpoint whose ranks held
    different parameters (pipeline stages) loads under any layout; DCP's other format keeps one rank's
    param-group list, which names only that rank's parameters. Checkpoints written before this format
    (their marker records no `checkpoint.optim_format`) load with `flat=False`."""

    def __init__(self, model: torch.nn.Module, optimizers, flat: bool = True):
        self.model, self.optimizers, self.flat = model, optimizers, flat

    def in_format(self, flat: bool) -> "ModelOptimState":
        """The same model and optimizers, read or written in the other format."""
        return ModelOptimState(self.model, self.optimizers, flat)

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizers, options=self._options())
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._options())

    def _options(self) -> StateDictOptions:
        return StateDictOptions(flatten_optimizer_state_dict=self.flat)


class RNGState:
    """Python, NumPy, torch CPU (and CUDA when initialized) generator states as one Stateful."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def _single_process_ok():
    """Silence DCP's warning that it runs without a process group: single-process runs are intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, final: str, step: int, meta: dict) -> None:
    """Rank 0: mark `tmp` complete (the marker holds `meta` and the files the save wrote) and rename it to
    `final`."""
    marker = os.path.join(tmp, MARKER)
    files = sorted(os.listdir(tmp) + [MARKER])
    with open(marker, "w") as f:
        json.dump({"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1, **meta,
                   "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):  # re-saving a step (e.g. after a resume): the new one replaces it
        left = remove(final)
        if left:  # what was not the checkpointer's stays, under another name
            os.rename(final, f"{final}.replaced")
            _say_left(final, left, f"{os.path.basename(final)}.replaced")
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def prune(directory: str, retention: CheckpointConfig) -> None:
    """Rank 0: delete the complete checkpoints that `retention.kept` does not keep: the files their saves
    wrote, and the directory once empty; anything else in it stays, named in one line."""
    found = {checkpoint_step(path): path for path in complete_checkpoints(directory)}
    for step in sorted(set(found) - retention.kept(list(found))):
        left = remove(found[step])
        if left:
            _say_left(found[step], left, os.path.basename(found[step]))


WRITTEN = re.compile(r"^(\.metadata|__\d+\.metadata|__\d+_\d+\.distcp|COMPLETE)$")  # DCP's and ours (older markers)


def remove(path: str) -> list[str]:
    """Delete the files of checkpoint `path` that its save wrote (its marker lists them; DCP's file names
    for older ones), the marker first (a crash midway leaves an incomplete checkpoint, never a complete
    one without its shards), then the directory if nothing else is in it; returns the rest."""
    try:
        listed = read_meta(path).get("files")
    except Unloadable:
        listed = None
    ours = set(listed) if isinstance(listed, list) else {name for name in os.listdir(path) if WRITTEN.match(name)}
    for name in [MARKER] + sorted(ours - {MARKER}):
        if name in ours and os.path.isfile(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    left = sorted(os.listdir(path))
    if not left:
        os.rmdir(path)
    return left


def _say_left(path: str, left: list[str], now: str) -> None:
    shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
    print(f"checkpoint.keep: removed checkpoint {path} but not what its save did not write: {shown} (now in "
          f"{os.path.join(os.path.dirname(path), now)}); move it out of the run dir", flush=True)


def save(step: int, directory: str, app_state: dict, *, retention: CheckpointConfig | None = None,
         meta: dict | None = None, group=None) -> str:
    """Save `app_state` (name -> Stateful or state dict) as `<directory>/step_<step>`; collective.

    Every rank of `group` (default: the default process group) must call it; DCP's coordination and the
    barriers run on `group` (runtime/comm.py gives a gloo group with the checkpoint timeout). Returns the
    checkpoint's path. `meta` (JSON) goes into the marker (see `read_meta`); `retention` prunes older
    checkpoints (None keeps all). If writing fails on any rank, every rank raises RunError (DCP reports a
    failure on one rank to all), the `.tmp` is removed and older checkpoints stay.
    """
    tmp = prepare(step, directory, group)
    try:
        with _single_process_ok():
            dcp.save(app_state, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as e:  # DCP raises every rank's failure on all ranks
        _barrier(group)
        raise failed(e, step, directory) from None
    _barrier(group)  # every rank's shards are on disk
    final = finish(step, directory, retention, meta)
    _barrier(group)  # nobody looks for the checkpoint before it is published
    return final


def prepare(step: int, directory: str, group=None) -> str:
    """Collective: rank 0 removes leftovers of saves that crashed; returns the `.tmp` path to write into."""
    if _rank() == 0:
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):  # leftovers of saves that crashed (the run-dir lock excludes other runs)
            if name.endswith(".tmp") and STEP_DIR.match(name[:-4]):
                shutil.rmtree(os.path.join(directory, name))
    _barrier(group)  # nobody writes into tmp before the leftovers are gone
    return os.path.join(directory, f"step_{step}.tmp")


def finish(step: int, directory: str, retention: CheckpointConfig | None, meta: dict | None) -> str:
    """After every rank's write finished: rank 0 publishes `step_<step>` and prunes; returns its path."""
    final = os.path.join(directory, f"step_{step}")
    if _rank() == 0:
        _publish(final + ".tmp", final, step, meta or {})
        if retention is not None:
            prune(directory, retention)
    return final


def failed(error: BaseException, step: int, directory: str) -> RunError:
    """The one-line RunError of a save that failed (every rank); rank 0 removes the `.tmp`, older ones stay."""
    full = _disk_full(error, directory)
    if _rank() == 0:
        shutil.rmtree(os.path.join(directory, f"step_{step}.tmp"), ignore_errors=True)
    what = "no space left on device" if full else failure_reason(error)
    run_error = RunError(f"{what} while writing checkpoint step_{step} to {directory}; the older checkpoints are "
                         f"kept (newest: {latest_checkpoint(directory) or 'none'})")
    # a peer died (or a collective timed out) mid-write: runtime/train.py reports it as that collective failure
    run_error.__cause__ = next((e for e in _causes(error) if comm_error_kind(e)), None)
    return run_error


def _disk_full(error: BaseException, directory: str) -> bool:
    """Whether a failed save ran out of space: ENOSPC anywhere in the error, or (torch.save's zip writer
    reports a short write as "unexpected pos") under 64 MiB left on the file system."""
    if "No space left" in str(error) or any(getattr(e, "errno", None) == errno.ENOSPC for e in _causes(error)):
        return True
    return shutil.disk_usage(directory).free < 64 * 2**20


def _causes(error: BaseException | None):
    """`error`, the per-rank errors a DCP CheckpointException wraps, and their causes, depth first."""
    if error is None:
        return
    yield error
    for failure in getattr(error, "failures", {}).values():  # CheckpointException: rank -> (exception, traceback)
        yield from _causes(failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", None))
    yield from _causes(error.__cause__)


def failure_reason(error: BaseException) -> str:
    """The first root cause of `error` in one line, at most 200 characters."""
    causes = list(_causes(error))
    root = next((e for e in causes if not getattr(e, "failures", None) and e.__cause__ is None), error)
    text = (str(root).strip().splitlines() or [""])[0]
    return (f"{type(root).__name__}: {text}" if text else type(root).__name__)[:200]


def load(path: str, app_state: dict, group=None) -> None:
    """Load a checkpoint written by `save` into `app_state` in place (Stateful objects get load_state_dict);
    DCP coordinates on `group` (default: the default process group).

    Raises Unloadable (one line, on every rank) if it does not load: a missing, truncated or garbled file."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    _check_expert_layout(path)
    try:
        with _single_process_ok():
            dcp.load(app_state, checkpoint_id=path, process_group=group, no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as e:  # DCP raises every rank's failure on all ranks (a BaseException)
        raise Unloadable(failure_reason(e)) from None


def _check_expert_layout(path: str) -> None:
    """RunError (one line, every rank) for a checkpoint from before the routed experts' w1 and w3 were
    fused into one w13 parameter: its keys cannot fill the model (launch/export_hf.py still reads it)."""
    try:
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # an unreadable .metadata: dcp.load reports it as Unloadable
        return
    old = next((k for k in keys if k.endswith(".experts.w1")), None)
    if old is not None:
        raise RunError(f"{path} stores the routed experts' w1 and w3 apart ({old}), as before they were fused into "
                       f"w13: it cannot be resumed; export it (python launch/export_hf.py --run-dir RUN_DIR --out DIR) "
                       f"and start a new run.dir with --model.init_from=DIR (the optimizer state is not carried over)")


def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """`key: saved -> current` for every key of `current` whose saved value differs (keys the
    checkpoint does not record are skipped: older checkpoints record less)."""
    current = json.loads(json.dumps(current))  # tuples -> lists, as the marker stores them
    return [f"{prefix}{k}: {saved[k]!r} -> {v!r}" for k, v in current.items() if k in saved and saved[k] != v]


def all_finite(model: torch.nn.Module, optimizers) -> bool:
    """Whether every parameter and optimizer-state tensor is finite on every rank; collective
    (communication: one int, MIN over all ranks). Checked before a save: never checkpoint NaN."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            local += [v.to_local() if isinstance(v, DTensor) else v for v in state.values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
    device = local[0].device if local else torch.device("cpu")
    ok = torch.tensor([int(all(bool(torch.isfinite(t).all()) for t in local))], device=device)
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())
