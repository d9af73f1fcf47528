"""Shared fixtures of the sharded-Muon tests: the optimizer config and steps, a toy model (per-head dense
blocks, per-expert and fused gated expert blocks, an AdamW norm) with its seeded weights and gradients and its
one-process ReferenceMuon result, and how a rank's shard is compared with the reference
(tests/ranks/test_sharded_muon.py; tests/ranks/test_meshes.py runs the same toy on the dual meshes)."""

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.boxes import local_box
from models.splits import PER_EXPERT, PER_EXPERT_GATED, per_head_cols, per_head_rows
from optim.config import OptimConfig
from optim.muon_reference import ReferenceMuon

STEPS = 3
CONFIG = OptimConfig(lr=0.02, weight_decay=0.1, momentum=0.9)


def box_of(p):
    return local_box(p.shape, p.device_mesh.shape, p.placements, p.device_mesh.get_coordinate())


def relative_error(got, want, scale):
    return (got - want).abs().max() / scale if got.numel() else torch.tensor(0.0)


def assert_matches_reference(results, expected, label, tol=1e-5):
    for rank, shards in enumerate(results):
        for name, (box, local) in shards.items():
            want = expected[name][tuple(slice(lo, hi) for lo, hi in box)]
            err = relative_error(local, want, expected[name].abs().max())
            assert err <= tol, f"{label}: {name} on rank {rank} box {box}: relative error {err:.2e} > {tol:.2e}"


class Experts(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(n, 12, 16))
        self.w13 = nn.Parameter(torch.zeros(n, 24, 16))  # fused w1/w3: two [12, 16] blocks per expert


class Toy(nn.Module):
    def __init__(self, n_experts):
        super().__init__()
        self.wq = nn.Linear(16, 48, bias=False)  # 6 heads on 4 shard ranks
        self.wo = nn.Linear(48, 16, bias=False)
        self.experts = Experts(n_experts)
        self.norm = nn.Parameter(torch.ones(16))  # AdamW

    def splits(self):
        return {"wq.weight": per_head_rows(6), "wo.weight": per_head_cols(6), "experts.w1": PER_EXPERT,
                "experts.w13": PER_EXPERT_GATED}


def toy_full(name, shape, salt):
    g = torch.Generator().manual_seed(zlib.crc32(repr((name, salt)).encode()))
    return torch.randn(shape, generator=g)


def ep_shard_experts(model, ep_mesh):
    """The toy's expert weights as DTensors Shard(0) on `ep_mesh`, as parallel/ep/direct.py does."""
    for name, weight in list(model.experts.named_parameters()):
        setattr(model.experts, name, nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)])))


def set_toy_grads(model, step):
    """Full-tensor grads sharded like each parameter; the experts get none at step 1 (skipped)."""
    for n, p in model.named_parameters():
        if step == 1 and n == "experts.w1":
            p.grad = None
            continue
        g = toy_full(n, p.shape, step)
        if isinstance(p, DTensor):
            g = DTensor.from_local(g[tuple(slice(lo, hi) for lo, hi in box_of(p))], p.device_mesh, p.placements,
                                   shape=p.shape, stride=p.stride())
        p.grad = g


def toy_reference(n_experts):
    model = Toy(n_experts)
    model.load_state_dict({n: toy_full(n, p.shape, "init") for n, p in model.named_parameters()})
    opt = ReferenceMuon(model.named_parameters(), model.splits(), CONFIG)
    for step in range(STEPS):
        set_toy_grads(model, step)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}
