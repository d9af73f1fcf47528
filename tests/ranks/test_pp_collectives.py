"""Trap 4 of issue 53: the step's collectives across pipeline stages, each on 4 gloo ranks (pp 2 x 2 ranks per
stage) against the one-process value, with the world-wide form each replaces shown wrong:
- the gradient norm: DTensor gradients on each stage's mesh (the world-wide count asserts: the mesh does not
  span the world) and plain tensors held by every rank of a stage (counted over the world: off by 1/sqrt(pp));
- the expert-bias update: stages holding 1 and 2 routers (an all-reduce of [routers, E] over the world would
  pair different layers, or different sizes);
- QK-clip's maxima: each stage's layers in their own rows, one MAX over the world.
"""

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from models import preset
from models.moe import Router
from multirank import run_ranks
from optim.qk_clip import step_max_logits
from parallel.gradients import grad_norm
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.pp.part import Blocks
from runtime.train import update_expert_bias

LAYOUT = ParallelConfig(pp=2, dp_shard=2, ep=1, edp_shard=2)
GRADS = {0: [torch.arange(12.0).reshape(4, 3)], 1: [torch.linspace(-2, 3, 10).reshape(5, 2), torch.ones(3)]}


def _norm(rank, world):
    meshes = build_meshes(LAYOUT.resolve(world), "cpu")
    stage, pp_rank = meshes.stage.get_group(), meshes.pp_rank()
    sharded = []
    for full in GRADS[pp_rank]:  # each stage's gradients, sharded over its own 2 ranks
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), meshes.dense_fsdp, [Replicate(), Shard(0)]))
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        sharded.append(p)
    plain = []
    for full in GRADS[pp_rank]:
        p = torch.nn.Parameter(torch.zeros_like(full))
        p.grad = full.clone()
        plain.append(p)
    try:
        grad_norm(sharded)  # replicas counted over the world
        world_wide = "no error"
    except AssertionError as e:
        world_wide = str(e)
    return {"dtensor": grad_norm(sharded, stage_group=stage).item(), "dtensor_world": world_wide,
            "plain": grad_norm(plain, stage_group=stage).item(), "plain_world": grad_norm(plain).item()}


def test_grad_norm_sums_over_the_stage_then_the_stages():
    expected = math.sqrt(sum(g.square().sum().item() for grads in GRADS.values() for g in grads))
    for got in run_ranks(_norm, 4):
        assert got["dtensor"] == pytest.approx(expected, rel=1e-6)
        assert got["plain"] == pytest.approx(expected, rel=1e-6)
        assert "does not span the 4 ranks" in got["dtensor_world"]
        assert got["plain_world"] == pytest.approx(expected / math.sqrt(2), rel=1e-6)  # the trap: 1/sqrt(pp)


class _Routers(torch.nn.Module):
    """A stage's routers, `routers()` as the model's."""

    def __init__(self, n):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Router(preset("debug")) for _ in range(n))

    def routers(self):
        return list(self.blocks)


def _bias(rank, world):
    meshes = build_meshes(LAYOUT.resolve(world), "cpu")
    pp_rank, local = meshes.pp_rank(), meshes.stage.get_group()
    model = _Routers(1 if pp_rank == 0 else 2)
    for i, router in enumerate(model.routers()):  # this rank's token counts of layer (pp_rank, i)
        router.tokens_per_expert.copy_(torch.arange(8.0).roll(rank + 3 * i + 5 * pp_rank))
    update_expert_bias(model, local)
    return [r.expert_bias.clone() for r in model.routers()]


def test_expert_bias_sums_each_layers_counts_over_its_stage():
    per_rank = run_ranks(_bias, 4)
    for rank, biases in enumerate(per_rank):
        pp_rank = rank // 2
        for i, bias in enumerate(biases):
            counts = sum(torch.arange(8.0).roll(r + 3 * i + 5 * pp_rank) for r in (2 * pp_rank, 2 * pp_rank + 1))
            assert torch.equal(bias, 1e-3 * torch.sign(counts.mean() - counts)), (rank, i)


class _Attention(torch.nn.Module):
    def __init__(self, max_H):
        super().__init__()
        self.n_heads, self.sdpa = len(max_H), torch.nn.Module()
        self.sdpa.max_logit_H = max_H


class _Block(torch.nn.Module):
    def __init__(self, max_H):
        super().__init__()
        self.attention = _Attention(max_H)


class _Stage(torch.nn.Module):
    """Blocks under their whole-model index, as a pipeline stage holds them (parallel/pp/part.py)."""

    def __init__(self, maxima: dict):
        super().__init__()
        self.config = preset("debug", n_layers=3)
        self.layers = Blocks({index: _Block(max_H) for index, max_H in maxima.items()})


def _max_logits(rank, world):
    meshes = build_meshes(LAYOUT.resolve(world), "cpu")
    layers = {0: [0], 1: [1, 2]}[meshes.pp_rank()]
    return step_max_logits(_Stage({i: torch.full((4,), float(10 * i + rank)) for i in layers}))


def test_max_logits_are_per_layer_across_stages():
    """Layer 0 lives on ranks 0-1, layers 1 and 2 on ranks 2-3: each row is the max over its own stage's ranks."""
    expected = torch.tensor([[1.0] * 4, [13.0] * 4, [23.0] * 4])
    for got in run_ranks(_max_logits, 4):
        assert torch.equal(got, expected), got
