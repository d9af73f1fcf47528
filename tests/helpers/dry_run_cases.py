"""Shared fixtures of the dry-run tests: the debug config at W = 64 (ARGS), the 256-GPU configs' dispatch
knobs as one step's flags (STEP), and `_dry_run` (launch/dry_run.py's main in a forked rank, its exit code
on a refusal). tests/entry/test_dry_run.py and tests/ranks/test_recompute_prefetch.py use them."""

import os

from launch import dry_run  # imported once here, not in each forked process

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIG = os.path.join(REPO, "configs", "debug.toml")
ARGS = ["--config", CONFIG, "--world", "64", "--layers", "2", "--seq", "32", "--data.batch_size=64"]
# ep groups across nodes (ep every 8th rank) and FP8 dispatch rows: every term has in-node and cross-node bytes;
# the 256-GPU configs' dispatch knobs (pipelined pieces: stepped unpipelined; EP rows kept for the recompute),
# and the combine's gradient as FP8 rows (the backward's combine bytes)
STEP = ["--parallel.expert_inner=edp_shard", "--parallel.ep_dispatch_dtype=float8_e4m3", "--parallel.ep_overlap_chunks=2",
        "--parallel.ep_combine_grad_dtype=float8_e4m3",
        "--parallel.ep_recompute=keep", "--training.activation_checkpoint=full", "--training.fsdp_prefetch=1",
        "--training.param_dtype=bfloat16"]  # bf16 weights: the routers are FSDP units of their own, gathered in fp32


def _dry_run(rank, world_size, argv):
    try:
        return dry_run.main(argv)
    except SystemExit as e:
        return e.code
