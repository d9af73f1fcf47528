"""One run per run dir: rank 0 holds an exclusive `flock` on `<run.dir>/.lock` while the run lives.

Two runs on one directory would delete each other's `.tmp` checkpoints, adopt each other's checkpoints
and interleave metrics. The kernel drops a `flock` when its holder dies, so a crashed or killed run
leaves no stale lock behind: the file only keeps the last holder's description, which the next run
overwrites. File systems without `flock` support (some NFS mounts) run unlocked, with a warning.
"""

import contextlib
import datetime
import errno
import fcntl
import os
import socket

import torch.distributed as dist

from runtime.errors import RunError

LOCK_NAME = ".lock"


def check_run_dir(run_dir: str) -> None:
    """ValueError unless `run_dir` is, or can be created as, a writable directory. Every rank runs it
    before any process group, so a path that is a file (or lies under one) fails in one line instead
    of on rank 0 alone inside the collective `run_lock`."""
    path = os.path.abspath(run_dir)
    while not os.path.lexists(path):  # the nearest existing ancestor is where makedirs starts
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ValueError(f"run.dir={run_dir}: {path} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"run.dir={run_dir}: the directory {path} is not writable")


def _try_lock(path: str) -> tuple[int | None, str | None]:
    """(fd holding the lock, None) or (None, description of the holder)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return None, holder
        print(f"warning: cannot lock {path} ({e.strerror}); running without a run-dir lock", flush=True)
        return None, None
    me = f"pid {os.getpid()} on {socket.gethostname()} since {datetime.datetime.now():%Y-%m-%d %H:%M:%S}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, me.encode(), 0)
    return fd, None


def _from_rank0(value):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)  # communication: one small object from rank 0
    return box[0]


@contextlib.contextmanager
def run_lock(run_dir: str, rank: int):
    """Hold the run dir's lock for the body; collective. Every rank raises RunError if another run holds it."""
    fd = holder = error = None
    if rank == 0:
        try:
            os.makedirs(run_dir, exist_ok=True)
            fd, holder = _try_lock(os.path.join(run_dir, LOCK_NAME))
        except OSError as e:  # sent to every rank: the others would wait in the broadcast for ever
            error = f"run.dir={run_dir}: cannot create or lock it ({e.strerror})"
    holder, error = _from_rank0((holder, error))
    if error is not None:
        raise RunError(error)
    if holder is not None:
        raise RunError(f"run.dir {run_dir} is in use by another run ({holder}); wait for it to end or choose "
                       f"another run.dir")
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock
