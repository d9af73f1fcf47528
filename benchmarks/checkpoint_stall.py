"""Training stall per checkpoint, sync vs async (runtime/checkpoint/checkpointer.py), on CPU.

    python benchmarks/checkpoint_stall.py [--params-m 50] [--saves 4] [--interval 5] [--repeats 3] [--json OUT]

One process trains an MLP of `--params-m` million fp32 parameters with AdamW (checkpoint = weights + two
moments: 12 bytes per parameter) and saves every `--interval` steps through the runtime's Checkpointer,
as runtime/train.py does (state dict gathering, DCP write, fsync, marker, rename). Each repeat runs the
same steps three ways, in turn: no checkpoint, sync, async. The stall per checkpoint of a mode is

    (sum of step times + save calls - steps x median step time without saves) / saves

with the median step of the same repeat's no-checkpoint run, so it counts everything the loop waits for: the save call (sync: the whole write; async: the copy to
host memory), a wait for a previous write, and the slowdown of the steps that overlap a background
write (on this 2-core machine the writer thread competes with training for the cores). The final
save's remaining write (`close`) is reported apart: a long run pays it once. Medians over repeats.

`--idle-step-s S` replaces the CPU step by the host idling S seconds and then touching every
parameter: the host's view of a GPU step, where the cores are free for the background writer. With
CPU-compute steps on a machine with few cores, the writer competes with training for the cores, so
that stall is an upper bound for a GPU node.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
from torch import nn  # noqa: E402

from runtime.checkpoint.checkpoint import CheckpointConfig, ModelOptimState  # noqa: E402
from runtime.checkpoint.checkpointer import Checkpointer  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402

WIDTH = 2048


def build(params_m: float):
    torch.manual_seed(0)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, optimizer, x_BD, idle_s: float = 0.0):
    """One training step on the CPU, or (`idle_s` > 0) a stand-in for a GPU step: the host waits
    `idle_s` while the "device" computes, then the update touches every parameter as a GPU step would."""
    if idle_s > 0:
        time.sleep(idle_s)
        with torch.no_grad():
            torch._foreach_add_(list(model.parameters()), 1e-6)
        return
    model(x_BD).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(mode: str | None, model, optimizer, steps: int, interval: int, directory: str, idle_s: float) -> dict:
    """Loop wall time (s), save-call times, and the final wait, for `mode` (None: no checkpoint)."""
    shutil.rmtree(directory, ignore_errors=True)
    config = CheckpointConfig(interval=interval, keep=1, mode=mode or "sync")
    checkpointer = Checkpointer(config, directory) if mode else None
    app_state = {"train": ModelOptimState(model, [optimizer])}
    x_BD = torch.randn(32, WIDTH)
    calls, step_times = [], []
    for done in range(1, steps + 1):
        t = time.perf_counter()
        step(model, optimizer, x_BD, idle_s)
        step_times.append(time.perf_counter() - t)
        if checkpointer and config.due(done):
            t = time.perf_counter()
            checkpointer.save(done, app_state, {})
            calls.append(time.perf_counter() - t)
    t = time.perf_counter()
    if checkpointer:
        checkpointer.close()
    return {"step_s": step_times, "save_call_s": calls, "final_wait_s": time.perf_counter() - t}


@user_errors
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=50.0)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-step-s", type=float, default=0.0,
                        help="> 0: each step is the host waiting this long (a GPU step's host view) instead of CPU compute")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    check_outputs([("--json", args.json)])
    model, optimizer = build(args.params_m)
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.saves * args.interval
    step(model, optimizer, torch.randn(32, WIDTH))  # AdamW state exists before any timing
    results = {m: [] for m in ("none", "sync", "async")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECKPOINT_BENCH_DIR")) as tmp:
        for _ in range(args.repeats):
            for mode in results:
                results[mode].append(run(None if mode == "none" else mode, model, optimizer, steps, args.interval,
                                         os.path.join(tmp, mode), args.idle_step_s))
    stalls = {"sync": [], "async": []}
    for i, none in enumerate(results["none"]):  # each repeat against its own no-checkpoint run
        base = statistics.median(none["step_s"])
        for mode in stalls:
            r = results[mode][i]
            stalls[mode].append((sum(r["step_s"]) + sum(r["save_call_s"]) - steps * base) / args.saves)
    out = {"params": n_params, "checkpoint_bytes": 12 * n_params, "steps": steps, "saves": args.saves,
           "step_kind": f"host idle {args.idle_step_s} s (GPU stand-in)" if args.idle_step_s > 0 else "CPU compute",
           "step_s": statistics.median(t for r in results["none"] for t in r["step_s"]), "repeats": args.repeats}
    for mode in ("sync", "async"):
        out[mode] = {"stall_per_checkpoint_s": statistics.median(stalls[mode]),
                     "save_call_s": statistics.median(c for r in results[mode] for c in r["save_call_s"]),
                     "final_wait_s": statistics.median(r["final_wait_s"] for r in results[mode])}
    out["async_over_sync_stall"] = out["async"]["stall_per_checkpoint_s"] / out["sync"]["stall_per_checkpoint_s"]
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
