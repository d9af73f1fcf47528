"""Run a test function on N gloo ranks forked from the pytest process.

Forking from a parent that already imported torch (and torch._dynamo, see conftest.py) costs well
under a second per call on 2 cores, against 30-45 s for spawning 8 fresh interpreters. Ranks
rendezvous through a FileStore on a temp file (no ports). Each rank reports its result or its
traceback with a timestamp; the parent raises with the FIRST rank that failed (peers then typically
fail with "connection closed", which is noise), and on timeout kills every rank and names the ones
that never reported. Never call this after CUDA was initialized in the parent.

Garbage: the parent collects its garbage before forking, and each rank freezes what it inherited
(`gc.freeze`), so no rank ever finalizes a parent's object (a process group, a device mesh, their
threads and sockets). Without this, a rank's garbage collector could reach cycles left by earlier
tests in the pytest process and run their destructors in the child: a rank of
test_gpu_check.py hung or segfaulted in garbage collection in the full suite only.
"""

import gc
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

_CTX = mp.get_context("fork")


def _child(fn, rank, world_size, store_path, conn, args, kwargs, torchrun_env):
    gc.freeze()  # the parent's objects stay out of this rank's collections (module docstring)
    torch.set_num_threads(1)
    try:
        if torchrun_env is None:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        else:  # `fn` is an entry point that initializes its own process group, as under torchrun
            os.environ.update(torchrun_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size))
        result = fn(rank, world_size, *args, **kwargs)
        conn.send((rank, "ok", time.time(), pickle.dumps(result)))
        if dist.is_initialized():
            dist.barrier()  # a rank that returns early must not tear down peers still in a collective
    except BaseException:  # report everything, including assertion failures and KeyboardInterrupt
        if not conn.closed:
            try:
                conn.send((rank, "error", time.time(), traceback.format_exc()))
            except OSError:  # the parent already has this rank's result and stopped listening
                pass
    finally:
        conn.close()
        os._exit(0)  # skip atexit handlers inherited from pytest


def run_ranks(fn, world_size, *args, timeout=120, as_torchrun=False, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return per-rank results.

    as_torchrun=True: no process group is created; each rank gets torchrun's environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) so `fn` can call a real entry point.
    """
    torchrun_env = _torchrun_env() if as_torchrun else None
    gc.collect()  # the parent's garbage is finalized here, not in the ranks (module docstring)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        pipes, procs = [], []
        for rank in range(world_size):
            recv, send = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(target=_child, args=(fn, rank, world_size, store_path, send, args, kwargs, torchrun_env))
            proc.start()
            send.close()
            pipes.append(recv)
            procs.append(proc)
        reports = _collect(pipes, procs, timeout)
    return _results_or_raise(reports, world_size, timeout)


def _torchrun_env():
    with socket.socket() as sock:  # a free loopback port for the entry point's TCP rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _collect(pipes, procs, timeout):
    deadline, reports, pending = time.monotonic() + timeout, {}, dict(enumerate(pipes))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        for conn in ready:
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                reports[rank] = conn.recv()
            except EOFError:  # died without reporting (segfault, os._exit, killed)
                reports[rank] = (rank, "error", time.time(), f"rank {rank} exited without reporting")
            del pending[rank]
    for proc in procs:
        if proc.is_alive() and len(reports) < len(procs):
            proc.kill()
        proc.join()
    return reports


def _results_or_raise(reports, world_size, timeout):
    errors = sorted((r for r in reports.values() if r[1] == "error"), key=lambda r: r[2])
    if errors:
        rank, _, _, tb = errors[0]
        others = [r[0] for r in errors[1:]]
        raise AssertionError(f"rank {rank} failed first (also failed: {others}):\n{tb}")
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        raise AssertionError(f"ranks {missing} hung for more than {timeout}s and were killed")
    return [pickle.loads(reports[r][3]) for r in range(world_size)]
