"""When and how the training loop saves: sync or async checkpoints, at most one in flight (`checkpoint.mode`).

    sync:  stall = gather the state dict + write every shard + fsync + publish (runtime/checkpoint/checkpoint.py save)
    async: stall = copy the state to host memory (pinned on CUDA; the buffers are reused by every save)
           then a background thread runs DCP's write (dcp.async_save) while training continues; when every
           rank's write finished (DCP gathers the write results on rank 0 before it returns), rank 0 writes
           the COMPLETE marker, renames `step_<N>.tmp` to `step_<N>` and prunes, in that same thread.

At most one save is in flight: a save first waits for the previous one, since the host buffers are reused
and the next save's clean-up removes leftover `.tmp` directories. The final step, SIGTERM and every
orderly stop (divergence, a config error found late) wait for the in-flight save (`close`); a rank killed
mid-write leaves `step_<N>.tmp` without a marker, so the previous checkpoint stays the newest loadable one.

Communication: DCP's coordination (plan gather, write-result gather, barriers) runs on `group`, a gloo
group with the checkpoint timeout (runtime/comm.py), never on the training's NCCL groups: a slow write
of tens of GiB cannot trip the NCCL watchdog, and the background thread's collectives cannot interleave
with the training's on one group. A failed async write (disk full, I/O error) is reported by the next
`wait` (the next save, or the end of the run), on every rank, as the sync save reports it.
"""

import concurrent.futures
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from runtime.checkpoint import checkpoint
from runtime.checkpoint.checkpoint import CheckpointConfig

ABANDON_AFTER_S = 5.0  # how long a failing run gives an in-flight write to finish or fail before leaving it


class Checkpointer:
    """Saves `<directory>/step_<N>` the `config.mode` way; `close()` waits for the last write."""

    def __init__(self, config: CheckpointConfig, directory: str, *, group=None, pin_memory: bool = False):
        self.config, self.directory, self.group = config, directory, group
        self._pending: tuple[int, concurrent.futures.Future] | None = None  # (step, publication)
        self._stager = None
        if config.mode == "async":  # one stager for the run: its host buffers are allocated by the first save only
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pin_memory, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))

    def save(self, step: int, app_state: dict, meta: dict) -> None:
        """Collective on `group`. sync: returns with `step_<step>` published. async: returns once the
        state is copied to host memory; the write and publication finish in the background."""
        self.wait()
        if self.config.mode == "sync":
            checkpoint.save(step, self.directory, app_state, retention=self.config, meta=meta, group=self.group)
            return
        tmp = checkpoint.prepare(step, self.directory, self.group)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            upload = dcp.async_save(app_state, checkpoint_id=tmp, process_group=self.group,
                                    async_stager=self._stager, no_dist=not dist.is_initialized())
        published = concurrent.futures.Future()
        upload.add_done_callback(lambda done: self._publish(done, published, step, meta))
        self._pending = (step, published)

    def _publish(self, upload: concurrent.futures.Future, published: concurrent.futures.Future, step: int,
                 meta: dict) -> None:
        """DCP's writer thread, once every rank's write finished (or failed): publish, or fail."""
        try:
            upload.result()
        except BaseException as e:  # DCP raises every rank's failure on all ranks (CheckpointException)
            published.set_exception(checkpoint.failed(e, step, self.directory))
            return
        try:
            published.set_result(checkpoint.finish(step, self.directory, self.config, meta))
        except BaseException as e:  # rank 0's marker or rename failed: the step stays a .tmp
            published.set_exception(checkpoint.failed(e, step, self.directory))

    def in_flight(self) -> int | None:
        """The step of the save still being written, or None."""
        return self._pending[0] if self._pending and not self._pending[1].done() else None

    def wait(self) -> None:
        """Block until the in-flight save (if any) is published; RunError (every rank) if it failed.
        Ends with a barrier on `group`: rank 0's publication is visible to every rank."""
        if self._pending is None:
            return
        _, published = self._pending
        self._pending = None
        published.result()  # raises the RunError of `checkpoint.failed`
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def close(self, wait: bool = True) -> bool:
        """End of the run: wait for the in-flight save (unless the run ends on a broken process group,
        `wait=False`), then free the host buffers. Returns whether a write is still in flight (abandoned:
        its thread may sit in a collective until comm.checkpoint_timeout_s, so the process must not wait
        for it at exit)."""
        if not wait and self._pending is not None:  # a dead peer fails DCP's gather within moments
            concurrent.futures.wait([self._pending[1]], timeout=ABANDON_AFTER_S)
        abandoned = not wait and self.in_flight() is not None
        try:
            if wait:
                self.wait()
        finally:
            if self._stager is not None and not abandoned:
                self._stager.close()
                self._stager = None
        return abandoned

