"""The `[profile]` section: a `torch.profiler` trace and host-sync counts of chosen steps, under the run dir.

For the steps `config.steps` (0-based optimizer steps of the run: a resumed run traces those still ahead
of it, so a restart after the traced steps does not overwrite their trace with other steps):
  <run_dir>/<config.dir>/rank<R>.json        Chrome trace (CPU, and CUDA kernels on a GPU)
  <run_dir>/<config.dir>/syncs_rank<R>.json  host syncs per step: total, by kind, by call site
                                             (runtime/syncs.py), and rank 0 prints one line per step
"""

import contextlib
import json
import os

import torch

from runtime.syncs import count_syncs, mark_optimizer_host_state


class _NoProfiler:
    def step(self) -> None:
        pass

    @contextlib.contextmanager
    def count_syncs(self):
        yield None


class _StepProfiler:
    """Wraps the torch profiler; `count_syncs()` around a training step counts its host syncs when
    the step is one of the profiled ones."""

    def __init__(self, prof, steps, start, trace_dir: str, rank: int, optimizer, device_type: str):
        self.prof, self.steps, self.rank = prof, set(steps), rank
        self.path = os.path.join(trace_dir, f"syncs_rank{rank}.json")
        self.optimizer, self.device_type = optimizer, device_type
        self.index, self.counts = start, {}

    def step(self) -> None:
        self.prof.step()
        self.index += 1

    @contextlib.contextmanager
    def count_syncs(self):
        if self.index not in self.steps:
            yield None
            return
        if self.optimizer is not None:
            mark_optimizer_host_state(self.optimizer)  # AdamW step counters live on the host
        with count_syncs(self.device_type) as counts:
            yield counts
        self.counts[self.index] = counts.as_dict()
        if self.rank == 0:
            kinds = ", ".join(f"{k} {v}" for k, v in counts.by_kind.items()) or "none"
            print(f"profile: step {self.index}: {counts.total} host syncs ({kinds}); sites in {self.path}", flush=True)
        with open(self.path, "w") as f:
            json.dump({str(k): v for k, v in self.counts.items()}, f, indent=1)


@contextlib.contextmanager
def maybe_profile(config, run_dir: str, rank: int, optimizer=None, device_type: str = "cpu", start: int = 0):
    """Yield an object with `.step()` (call once per optimizer step) and `.count_syncs()` (a context
    around the step). With `config.enabled`, the steps `config.steps` at or after `start` (the step
    this process begins at) are traced and their host syncs counted (module docstring); `optimizer`'s
    CPU scalar state is declared host-resident."""
    steps = [s for s in config.steps if s >= start]
    if config.enabled and not steps and rank == 0:
        print(f"profile: profile.steps={','.join(map(str, config.steps))} are before step {start}, where this "
              f"run resumed: nothing traced", flush=True)
    if not steps or not config.enabled:
        yield _NoProfiler()
        return
    trace_dir = os.path.join(run_dir, config.dir)
    os.makedirs(trace_dir, exist_ok=True)

    def export(prof):
        prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=steps[0] - start, warmup=0, active=len(steps), repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=export) as prof:
        yield _StepProfiler(prof, steps, start, trace_dir, rank, optimizer, device_type)
