"""Run a real entry point (`launch/pretrain.py main`, or another `main(argv)` such as launch/posttrain.py's)
on forked torchrun-style ranks and read its metrics."""

import json
import os

from launch.pretrain import main
from multirank import run_ranks


def _main(rank, world_size, argv, entry):
    return entry(argv)


def run_pretrain(run_dir, world_size, argv, timeout=300, entry=main):
    """(exit codes per rank, metrics records) of `entry(argv + --run.dir)` on `world_size` ranks."""
    codes = run_ranks(_main, world_size, [*argv, f"--run.dir={run_dir}"], entry, as_torchrun=True, timeout=timeout)
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return codes, records


def run_ok(run_dir, world_size, argv, timeout=300, entry=main):
    """The metrics records of a run that must succeed on every rank."""
    codes, records = run_pretrain(run_dir, world_size, argv, timeout, entry)
    assert codes == [0] * world_size, codes
    return records
