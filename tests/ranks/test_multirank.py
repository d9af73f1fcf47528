"""The multi-rank harness: results come back per rank, the first failing rank is named, hangs time out."""

import time

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), dist.get_world_size()


def test_all_reduce_on_8_ranks_matches_single_process_sum():
    results = run_ranks(_all_reduce_rank, 8)
    expected = float(sum(range(8)))  # the single-process reference
    assert results == [(expected, 8)] * 8


def _rank_3_fails(rank, world_size):
    if rank == 3:
        raise RuntimeError("deliberate failure on rank 3")
    dist.barrier()  # the peers then fail or hang in the barrier; rank 3 must be the one reported


def test_first_failing_rank_is_reported():
    with pytest.raises(AssertionError, match=r"rank 3 failed first[\s\S]*deliberate failure on rank 3"):
        run_ranks(_rank_3_fails, 8, timeout=60)


def _rank_1_hangs(rank, world_size):
    if rank == 1:
        time.sleep(600)


def test_hanging_rank_is_named_and_killed():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] hung"):
        run_ranks(_rank_1_hangs, 2, timeout=3)
    assert time.monotonic() - start < 30


def _entry_point_like(rank, world_size):
    dist.init_process_group("gloo")  # reads the torchrun variables, as launch/pretrain.py does
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_torchrun_style_ranks_initialize_their_own_group():
    assert run_ranks(_entry_point_like, 4, as_torchrun=True) == [4.0] * 4
