"""Optional `torch.profiler` trace of chosen steps (the `[profile]` section), written under the run dir."""

import contextlib
import os

import torch


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(config, run_dir: str, rank: int):
    """Yield an object with `.step()`, called once per optimizer step. With `config.enabled`, steps
    `config.steps` (0-based, counted from the first step this process runs) are traced to
    `<run_dir>/<config.dir>/rank<R>.json` (Chrome trace format)."""
    if not config.enabled:
        yield _NoProfiler()
        return
    first, count = min(config.steps), len(config.steps)
    trace_dir = os.path.join(run_dir, config.dir)
    os.makedirs(trace_dir, exist_ok=True)

    def export(prof):
        prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=first, warmup=0, active=count, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=export) as prof:
        yield prof
