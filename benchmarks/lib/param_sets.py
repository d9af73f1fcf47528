"""The parameters the optimizer-step benchmark steps: real models, sharded by the runtime's own code.

Two sets, both built as a Transformer and sharded with `parallel.parallelize` for the world size
(dense dp_shard = W, experts edp_shard = W: FSDP2 `fully_shard` on both meshes, as in training):
  debug       the `debug` preset (tiny: timings there are mostly per-call overhead).
  kimi_slice  Kimi K2 shapes scaled down 16x in every width (dim 7168 -> 448, expert hidden
              2048 -> 128, per-head widths 128/64 -> 8/4, q_lora 1536 -> 96, kv_lora 512 -> 32),
              8 heads, 2 MoE layers of 16 routed experts + 1 shared expert, no dense layer: 17.3 GFLOP
              of NS per step, 99% of it in the 2048:7168-shaped expert matrices (99.8% in Kimi K2),
              every Muon block kind present (per head rows, per head cols, per expert, whole).
Only Muon parameters (those with a declared split) are benchmarked; AdamW is the same for every
method and is left out. Gradients are fixed: seeded per parameter name, identical on every rank.
"""

import zlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from models import Transformer, preset
from models.splits import MatrixSplit, muon_splits
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize

SHAPE_SETS = ("debug", "kimi_slice")
KIMI_SLICE = dict(
    vocab_size=256, dim=448, n_layers=2, n_dense_layers=0, n_heads=8, q_lora_rank=96, kv_lora_rank=32,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, inter_dim=1152, moe_inter_dim=128,
    n_routed_experts=16, n_shared_experts=1, n_activated_experts=2, max_seq_len=64,
)


@dataclass
class ParamSet:
    name: str
    params: dict[str, DTensor]  # fqn -> sharded parameter (a detached DTensor, never stepped itself)
    grads: dict[str, DTensor]  # fqn -> fixed gradient, same placements
    splits: dict[str, MatrixSplit]
    meshes: object  # parallel.meshes.Meshes the parameters live on


def model_config(name: str):
    if name == "debug":
        return preset("debug")
    if name == "kimi_slice":
        return preset("kimi_k2_1t", **KIMI_SLICE)
    raise ValueError(f"unknown shape set {name!r}; expected one of {SHAPE_SETS}")


def build_param_set(name: str, world_size: int, device_type: str = "cpu", seed: int = 0) -> ParamSet:
    """Collective (FSDP setup): every rank builds the same model and keeps its shards."""
    config = model_config(name)
    layout = ParallelConfig().resolve(world_size)
    meshes = build_meshes(layout, device_type)
    torch.manual_seed(seed)  # same initial weights on every rank (the model initializes itself)
    device = meshes.world.device_type
    model = parallelize(Transformer(config).to(device), meshes, layout)
    splits = muon_splits(model)
    params = {fqn: p.detach() for fqn, p in model.named_parameters() if fqn in splits}
    grads = {fqn: local_slice(fixed_gradient(fqn, p.shape, seed).to(p.device), p) for fqn, p in params.items()}
    return ParamSet(name, params, grads, {fqn: splits[fqn] for fqn in params}, meshes)


def fixed_gradient(fqn: str, shape, seed: int) -> torch.Tensor:
    """The full gradient of one parameter, the same on every rank (seeded by its name)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
    return torch.randn(shape, generator=gen)


def local_slice(full: torch.Tensor, like: DTensor) -> DTensor:
    """`full` (identical on every rank) as a DTensor with `like`'s mesh and placements.

    Replicate -> any Shard (including FSDP2's strided shards) is a local slice: no communication."""
    replicated = DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    out = replicated.redistribute(like.device_mesh, like.placements)
    assert out.to_local().shape == like.to_local().shape, (full.shape, like.placements)
    return DTensor.from_local(out.to_local().contiguous(), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def clone_params(param_set: ParamSet) -> dict[str, torch.nn.Parameter]:
    """Fresh parameters with the set's values and fixed gradients (each method steps its own copy)."""
    out = {}
    for fqn, p in param_set.params.items():
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = param_set.grads[fqn]
        out[fqn] = q
    return out
