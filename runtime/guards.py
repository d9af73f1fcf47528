"""What the training loop checks once per step to stop cleanly: preemption and divergence.

Preemption: SLURM (and most schedulers) send SIGTERM, then SIGKILL after a grace period. The handler
only sets a flag; the training step sums it over ranks together with the loss (the step's existing
all-reduce and host readback, runtime/train.py), so every rank learns whether ANY rank got the signal
and all save the same checkpoint and stop together, although the signal reaches them at slightly
different times.

Divergence: a step with a non-finite loss or gradient norm is skipped (no update). The run stops with
Diverged (exit status 3), its last checkpoint kept, instead of burning compute on a dead model, when
  1. `limit` (training.max_nonfinite_steps, default 10; 0 turns 1 and 2 off) consecutive steps were skipped;
  2. at least `limit` steps of this launch were skipped and they are more than `fraction`
     (training.max_nonfinite_fraction, default 0.25) of the steps this launch took: a run that keeps
     skipping every other step never makes a streak, but learns from only part of its data;
  3. its last step is reached and none of this launch's steps was finite (always on: a run that only
     skipped steps must not exit 0 as if it had trained; no final checkpoint is written then).
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
    """Counts this launch's skipped (non-finite) steps; raises Diverged by the rules of the module docstring."""

    def __init__(self, limit: int, fraction: float = 1.0):
        self.limit, self.fraction = limit, fraction
        self.streak = self.steps = self.skipped = 0

    def record(self, step: int, finite: bool, last: bool = False) -> None:
        """After step `step` (0-based); `last`: it was the run's final step."""
        self.streak = 0 if finite else self.streak + 1
        self.steps += 1
        self.skipped += not finite
        if self.limit and self.streak >= self.limit:
            raise Diverged(f"diverged: steps {step - self.streak + 1}..{step} all had a non-finite loss or gradient "
                           f"norm (training.max_nonfinite_steps={self.limit}); lower optim.lr or fix the data, then "
                           f"relaunch: the run resumes from the last good checkpoint")
        if self.limit and self.skipped >= self.limit and self.skipped > self.fraction * self.steps:
            raise Diverged(f"diverged: {self.skipped} of the {self.steps} steps up to step {step} had a non-finite loss "
                           f"or gradient norm, more than training.max_nonfinite_fraction={self.fraction}; lower optim.lr "
                           f"or fix the data, then relaunch: the run resumes from the last good checkpoint")
        if last and self.skipped == self.steps:
            raise Diverged(f"diverged: all {self.steps} steps up to the last, step {step}, had a non-finite loss or "
                           f"gradient norm: nothing was trained and no final checkpoint was written; lower optim.lr "
                           f"or fix the data or weights, then relaunch")
