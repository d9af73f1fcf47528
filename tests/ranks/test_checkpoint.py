"""Checkpoints: exact save/load on real ranks, FSDP2 shards reload under another layout, atomic saves, pruning."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from multirank import run_ranks
from runtime.checkpoint.checkpoint import (MARKER, CheckpointConfig, ModelOptimState, RNGState, checkpoint_step,
                                           complete_checkpoints, latest_checkpoint, load, save)
from runtime.data.config import DataConfig
from runtime.data.loader import Loader
from runtime.errors import RunError


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train_step(model, optimizer, step):
    x = torch.linspace(-1, 1, 12).reshape(3, 4) * (step + 1)  # the same batch on every rank
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _app(model, optimizer, scheduler, loader):
    return {"model_optim": ModelOptimState(model, optimizer), "scheduler": scheduler, "data": loader, "rng": RNGState()}


def _fresh(seed):
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 / (t + 1))
    return model, optimizer, scheduler, Loader(DataConfig(seq_len=8, batch_size=2), seed=0)


def _state(model, optimizer):
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    return params, moments, optimizer.param_groups[0]["lr"]


def _save_after_two_steps(rank, world_size, directory):
    model, optimizer, scheduler, loader = _fresh(seed=0)
    for step in range(2):
        _train_step(model, optimizer, step)
        scheduler.step()
        loader.next_step()
    path = save(2, directory, _app(model, optimizer, scheduler, loader))
    at_save = _state(model, optimizer)
    draws = torch.rand(3)  # what a resumed run must draw next
    _train_step(model, optimizer, 2)
    return path, at_save, draws, _state(model, optimizer)


def _load_and_continue(rank, world_size, directory):
    model, optimizer, scheduler, loader = _fresh(seed=1)  # different init: everything must come from disk
    torch.manual_seed(999)
    load(latest_checkpoint(directory), _app(model, optimizer, scheduler, loader))
    loaded = _state(model, optimizer)
    draws = torch.rand(3)
    _train_step(model, optimizer, 2)
    return loaded, draws, _state(model, optimizer), loader.state_dict(), scheduler.last_epoch


def _assert_same(a, b):
    params_a, moments_a, lr_a = a
    params_b, moments_b, lr_b = b
    assert params_a.keys() == params_b.keys() and all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    assert all(torch.equal(x, y) for x, y in zip(moments_a, moments_b)) and lr_a == lr_b


def test_two_ranks_save_then_load_resumes_exactly(tmp_path):
    directory = str(tmp_path / "checkpoints")
    saved = run_ranks(_save_after_two_steps, 2, directory)
    assert saved[0][0] == os.path.join(directory, "step_2") and os.listdir(directory) == ["step_2"]
    assert os.path.isfile(os.path.join(directory, "step_2", MARKER))
    loaded = run_ranks(_load_and_continue, 2, directory)
    for (_, at_save, draws, after), (got, got_draws, got_after, data_state, sched_epoch) in zip(saved, loaded):
        _assert_same(got, at_save)  # bitwise: the same values are written and read back
        assert torch.equal(got_draws, draws) and data_state == {"step": 2} and sched_epoch == 2
        _assert_same(got_after, after)  # one more step from the loaded state equals the uninterrupted run


def _fsdp_train_and_save(rank, world_size, directory):
    model = _model(seed=0)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer, 0)
    save(1, directory, {"model_optim": ModelOptimState(model, optimizer)})
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return params, [optimizer.state[p]["exp_avg"].full_tensor() for p in model.parameters()]


def _plain_load(rank, world_size, directory):
    model = _model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    load(latest_checkpoint(directory), {"model_optim": ModelOptimState(model, optimizer)})
    return dict(model.state_dict()), [optimizer.state[p]["exp_avg"] for p in model.parameters()]


def test_fsdp2_shards_saved_on_two_ranks_load_into_one_plain_model(tmp_path):
    directory = str(tmp_path / "checkpoints")
    sharded_params, sharded_moments = run_ranks(_fsdp_train_and_save, 2, directory)[0]
    params, moments = run_ranks(_plain_load, 1, directory)[0]
    assert all(torch.equal(params[k], sharded_params[k]) for k in params)
    assert all(torch.equal(a, b) for a, b in zip(moments, sharded_moments))
    reference = _model(seed=0)  # single-process reference of the same step
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    _train_step(reference, reference_optimizer, 0)
    for k, v in reference.state_dict().items():
        # FSDP averages the two ranks' identical gradients in fp32: equal up to rounding of the mean
        torch.testing.assert_close(params[k], v, rtol=1e-6, atol=1e-7)


class _CrashingState:
    """A state whose serialization fails, like a process dying in the middle of a save."""

    def state_dict(self):
        raise RuntimeError("simulated crash during save")

    def load_state_dict(self, state):
        raise AssertionError("never loaded")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the direct dcp.save calls below
def test_incomplete_checkpoints_are_ignored_and_cleaned_up(tmp_path):
    directory = str(tmp_path)
    model, optimizer, scheduler, loader = _fresh(seed=0)
    _train_step(model, optimizer, 0)
    app = {"model_optim": ModelOptimState(model, optimizer), "data": loader}
    save(1, directory, app)
    with pytest.raises(RunError, match="simulated crash during save while writing checkpoint step_2 .* kept"):
        save(2, directory, {**app, "extra": _CrashingState()})
    assert not os.path.exists(os.path.join(directory, "step_2.tmp"))
    dcp.save(app, checkpoint_id=os.path.join(directory, "step_3.tmp"), no_dist=True)  # shards written, never renamed
    open(os.path.join(directory, "step_3.tmp", MARKER), "w").close()
    dcp.save(app, checkpoint_id=os.path.join(directory, "step_4"), no_dist=True)  # data but no marker
    assert latest_checkpoint(directory) == os.path.join(directory, "step_1")
    with pytest.raises(ValueError, match="step_4 is not a complete checkpoint"):
        load(os.path.join(directory, "step_4"), app)
    save(5, directory, app)
    assert sorted(os.listdir(directory)) == ["step_1", "step_4", "step_5"]  # the .tmp leftover is gone
    assert checkpoint_step(latest_checkpoint(directory)) == 5


def test_keep_prunes_the_oldest_complete_checkpoints(tmp_path):
    model, optimizer, scheduler, loader = _fresh(seed=0)
    for step in range(1, 5):
        loader.next_step()
        save(step, str(tmp_path), {"data": loader}, retention=CheckpointConfig(interval=1, keep=2))
    assert [checkpoint_step(p) for p in complete_checkpoints(str(tmp_path))] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    fresh = Loader(DataConfig(seq_len=8, batch_size=2), seed=0)
    load(latest_checkpoint(str(tmp_path)), {"data": fresh})
    assert fresh.state_dict() == {"step": 4}


def test_checkpoint_config_schedule():
    config = CheckpointConfig(interval=3, keep=1)
    assert [s for s in range(10) if config.due(s)] == [3, 6, 9]
    assert not any(CheckpointConfig(interval=0).due(s) for s in range(10))


def test_a_write_a_dead_peer_failed_keeps_the_collective_error_for_the_report(tmp_path):
    """runtime/train.py turns such a RunError into the comm report ("rank N: a peer rank died ...", exit 4)."""
    from runtime.checkpoint.checkpoint import failed

    dead = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2433")
    error = failed(dead, 4, str(tmp_path))
    assert error.__cause__ is dead and "Connection closed by peer" in str(error) and "step_4" in str(error)
    assert failed(RuntimeError("disk on fire"), 4, str(tmp_path)).__cause__ is None
