"""What the training loop checks once per step to stop cleanly: preemption and divergence.

Preemption: SLURM (and most schedulers) send SIGTERM, then SIGKILL after a grace period. The handler
only sets a flag; at the end of the step every rank learns whether ANY rank got the signal (one MAX
all-reduce of an int), so all ranks save the same checkpoint and stop together, even though the
signal reaches them at slightly different times.

Divergence: a step with a non-finite loss or gradient norm is skipped (no update); after
`limit` consecutive such steps the run stops instead of burning compute on a dead model.
"""

import signal
import threading

import torch
import torch.distributed as dist

from runtime.errors import Diverged


class Preemption:
    """Context manager: SIGTERM sets a flag while inside; `requested()` is the flag agreed over ranks."""

    def __init__(self, device: torch.device):
        self.device, self.signalled, self._previous = device, False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum, frame):
        self.signalled = True

    def requested(self) -> bool:
        """Whether any rank got SIGTERM; collective (communication: one int, MAX over all ranks)."""
        flag = torch.tensor([int(self.signalled)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class DivergenceGuard:
    """Counts consecutive non-finite steps; raises Diverged when `limit` (> 0) is reached."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def record(self, step: int, finite: bool) -> None:
        self.streak = 0 if finite else self.streak + 1
        if self.limit and self.streak >= self.limit:
            raise Diverged(f"diverged: steps {step - self.streak + 1}..{step} all had a non-finite loss or gradient "
                           f"norm (training.max_nonfinite_steps={self.limit}); lower optim.lr or fix the data, then "
                           f"relaunch: the run resumes from the last good checkpoint")
