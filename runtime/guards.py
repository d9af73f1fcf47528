"""What the training loop checks once per step to stop cleanly: preemption and divergence.

Preemption: SLURM (and most schedulers) send SIGTERM, then SIGKILL after a grace period. The handler
only sets a flag; the training step sums it over ranks together with the loss (the step's existing
all-reduce and host readback, runtime/train.py), so every rank learns whether ANY rank got the signal
and all save the same checkpoint and stop together, although the signal reaches them at slightly
different times.

Divergence: a step with a non-finite loss or gradient norm is skipped (no update); after
`limit` consecutive such steps the run stops instead of burning compute on a dead model.
"""

import signal
import threading

from runtime.errors import Diverged


class Preemption:
    """Context manager: SIGTERM sets `signalled` while inside (this rank's view; the step agrees it)."""

    def __init__(self):
        self.signalled, self._previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum, frame):
        self.signalled = True


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
