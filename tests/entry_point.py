"""Run the real entry point (`launch/pretrain.py main`) on forked torchrun-style ranks and read its metrics."""

import json
import os

from launch.pretrain import main
from multirank import run_ranks


def _main(rank, world_size, argv):
    return main(argv)


def run_pretrain(run_dir, world_size, argv, timeout=300):
    """(exit codes per rank, metrics records) of `main(argv + --run.dir)` on `world_size` ranks."""
    codes = run_ranks(_main, world_size, [*argv, f"--run.dir={run_dir}"], as_torchrun=True, timeout=timeout)
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return codes, records


def run_ok(run_dir, world_size, argv, timeout=300):
    """The metrics records of a run that must succeed on every rank."""
    codes, records = run_pretrain(run_dir, world_size, argv, timeout)
    assert codes == [0] * world_size, codes
    return records
