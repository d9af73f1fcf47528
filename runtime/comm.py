"""Process groups for long jobs, and hangs that explain themselves (the `[comm]` section).

Timeouts: the default group starts with `comm.init_timeout_s` (communicator set-up, the first step's
first all-to-alls and NS buckets, a resume's load); after the first step every training group gets the
short `comm.train_timeout_s`. Checkpoint coordination (DCP's gathers and barriers) runs on a separate
gloo group with `comm.checkpoint_timeout_s` (runtime/checkpoint/checkpointer.py): a slow write of tens of GiB on
one rank never trips the training groups' timeout or NCCL's watchdog. On CUDA the default group gets
`device_id` (eager NCCL init; sub-groups are split from its communicator).

When a collective times out (or a peer dies), every rank prints ONE line naming itself, the step, the
phase, and the last collective it issued (kind, the mesh axes of its group, the group's size and the
collective's sequence number on it), writes torch's flight-recorder trace to
`run.dir/comm_traces/rank_<r>` (read them all with `python -m torch.distributed.flight_recorder.fr_trace
run.dir/comm_traces`; a rank whose sequence number is behind the others' on a group is the one that
never joined), and exits with status 4 so torchrun restarts the job.

Flight recorder on CPU: torch 2.13 records gloo collectives too (TORCH_FR_BUFFER_SIZE; checked here:
kind, group, sizes, sequence number), but not their completion, so "the last collective it issued" is
the newest entry, not necessarily the one that hung when several are in flight. On CUDA, NCCL's own
watchdog also dumps its traces into the same directory (TORCH_NCCL_DUMP_ON_TIMEOUT).

Heartbeat: after every step each rank rewrites `run.dir/heartbeat/rank_<r>` ({"step", "time",
"step_time_s"}); an outside watchdog that sees every file older than a few step times knows the job
hangs rather than runs a slow step.

Private torch APIs (checked on torch 2.13): `distributed_c10d._set_pg_timeout`, `_world.pg_names`,
`torch._C._distributed_c10d._dump_fr_trace{,_json}`.
"""

import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from runtime.comm_config import CommConfig
from runtime.errors import RunError

TRACES = "comm_traces"
HEARTBEAT = "heartbeat"


class CommFailure(RunError):
    """A collective timed out or a peer died; every rank prints its own line (`every_rank`)."""
    exit_code = 4
    every_rank = True
    abandoned_write = False  # a checkpoint write was still in flight (runtime/checkpoint/checkpointer.py close)


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def init_process_group(config: CommConfig, backend: str, store, rank: int, world_size: int,
                       device: torch.device, run_dir: str) -> None:
    """The default group with `init_timeout_s`; the flight recorder on (environment, before any group)."""
    if config.trace_entries:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(config.trace_entries))
        if backend == "nccl":  # NCCL's watchdog dumps its own traces there on a timeout
            os.makedirs(os.path.join(run_dir, TRACES), exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(run_dir, TRACES, "rank_"))
    device_id = device if device.type == "cuda" else None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=_seconds(config.init_timeout_s), device_id=device_id)


def checkpoint_group(config: CommConfig):
    """Collective: a gloo group of all ranks with `checkpoint_timeout_s`, or None without a process group."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=_seconds(config.checkpoint_timeout_s))


def host_group():
    """Collective: a gloo group of all ranks for small agreements on host values (post-training's check that
    its rollout file is unchanged, runtime/posttrain/rollout_file.py), under the training groups' timeouts
    (`CommWatch`); None without a process group."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")


def group_names(meshes) -> dict[str, str]:
    """{process group name: "dense.dp_shard / expert.ep ..."} for every axis of the run's meshes."""
    names: dict[str, list[str]] = {}
    staged = ("stage", "pp") if meshes.pp is not None else ()  # pipeline parallelism's two groups
    for label in ("dense", "expert", "dense_fsdp", "expert_fsdp", *staged):
        mesh = getattr(meshes, label)
        for axis in mesh.mesh_dim_names:
            names.setdefault(mesh.get_group(axis).group_name, []).append(f"{label}.{axis}")
    names.setdefault(dist.group.WORLD.group_name, []).append("world")
    return {group: " = ".join(dict.fromkeys(labels)) for group, labels in names.items()}


class CommWatch:
    """The training loop's view of its communication: which step and phase it is in, the switch to the
    short timeout after the first step, the heartbeat, and the report when a collective fails."""

    def __init__(self, config: CommConfig, run_dir: str, rank: int, meshes=None, exempt=()):
        self.config, self.run_dir, self.rank = config, run_dir, rank
        self.names = group_names(meshes) if meshes is not None and dist.is_initialized() else {}
        self.exempt = {g.group_name for g in exempt if g is not None}  # keep their own timeout (checkpoints)
        self.step, self.phase, self.trained = None, "start-up", False

    def begin(self) -> None:
        """Once every group exists (meshes, optimizer): all training groups get `init_timeout_s` (groups made
        after init_process_group start with torch's default, 30 min gloo / 10 min NCCL)."""
        self._set_timeouts(self.config.init_timeout_s)

    def _set_timeouts(self, seconds: float) -> None:
        if dist.is_initialized():
            for group in list(c10d._world.pg_names):
                if group.group_name not in self.exempt:
                    c10d._set_pg_timeout(_seconds(seconds), group)

    def at(self, step: int | None, phase: str) -> None:
        self.step, self.phase = step, phase

    def step_done(self, step: int, step_time_s: float) -> None:
        """After a step: the short timeout from now on (first time), and the heartbeat."""
        if not self.trained:
            self._set_timeouts(self.config.train_timeout_s)
        self.trained = True
        if self.config.heartbeat:
            self._beat(step, step_time_s)

    def _beat(self, step: int, step_time_s: float) -> None:
        directory = os.path.join(self.run_dir, HEARTBEAT)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank_{self.rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step, "time": time.time(), "step_time_s": step_time_s}, f)
        os.replace(path + ".tmp", path)

    def timeout_s(self) -> float:
        return self.config.train_timeout_s if self.trained else self.config.init_timeout_s

    def failure(self, error: BaseException) -> CommFailure | None:
        """The one-line report (and the trace on disk) if `error` is a failed collective, else None."""
        what = comm_error_kind(error)
        if what is None:
            return None
        trace = self._dump_trace()
        last = self._last_collective()
        where = f"step {self.step}" if self.step is not None else "start-up"
        if what == "collective timed out":
            what += f" after {self.timeout_s():g} s"
        return CommFailure(f"rank {self.rank}: {what} in {where} ({self.phase}); "
                           f"last collective issued: {last}; flight-recorder trace: {trace}")

    def _dump_trace(self) -> str:
        if not self.config.trace_entries:
            return "off (comm.trace_entries=0)"
        directory = os.path.join(self.run_dir, TRACES)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank_{self.rank}")
        with open(path, "wb") as f:
            f.write(torch._C._distributed_c10d._dump_fr_trace(True, False))
        return path

    def _last_collective(self) -> str:
        try:
            entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])
        except RuntimeError:  # the flight recorder is off
            entries = []
        if not entries:
            return "none recorded"
        last = entries[-1]
        group = last["process_group"][0]
        mesh = self.names.get(group, f"group {group} ({last['process_group'][1]})")
        size = next((dist.get_world_size(g) for g, name in c10d._world.pg_names.items() if name == group), "?")
        sizes = "x".join(str(s) for s in (last.get("input_sizes") or [[]])[0]) or "-"
        return f"{last['profiling_name']} on {mesh} ({size} ranks, #{last['collective_seq_id']} on it, input {sizes})"


def comm_error_kind(error: BaseException) -> str | None:
    """"collective timed out" / "a peer rank died" for a failed collective's error, else None."""
    text = str(error)
    if "Timed out" in text or "timed out" in text or "Watchdog caught collective operation timeout" in text:
        return "collective timed out"
    if any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                               "NCCL communicator was aborted", "ProcessGroupNCCL is aborted")):
        return "a peer rank died"
    return None
