"""`ParamSpec`s for the planner: from live parameters (the optimizer) or from a model config and a
parallel layout without allocating anything (planning Kimi K2 for 256 ranks in a test or benchmark).

The layout convention is the runtime's (parallel/meshes.py, parallel/fsdp.py):
  dense   mesh (dp_replicate, dp_shard_cp) = arange(world).reshape(dp_replicate, dp_shard * cp),
          placements (Replicate(), Shard(0))
  experts mesh (edp_replicate, edp_shard, ep) = arange(world).reshape(edp_replicate, edp_shard, ep),
          placements (Replicate(), _StridedShard(0, split_factor=ep), Shard(0)) when every edp_shard
          rank gets a local expert (ep > 1; plain Shard(0) when ep == 1), else (Replicate(), Shard(1), Shard(0)).
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from models.boxes import strided_shard
from models.splits import MatrixSplit, muon_splits
from optim.planner.plan import ParamSpec

DENSE_NAMES = ("dp_replicate", "dp_shard_cp")
EXPERT_NAMES = ("edp_replicate", "edp_shard", "ep")


def param_spec(name: str, param: torch.Tensor, split: MatrixSplit) -> ParamSpec:
    """Spec of a live parameter: a DTensor's mesh and placements, or, for a plain tensor, a copy
    replicated on every rank of the default group (one rank when no process group exists)."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        ranks = mesh.mesh.cpu().numpy().astype(np.int64)
        return ParamSpec(name, tuple(param.shape), param.dtype, split, ranks, tuple(mesh.mesh_dim_names or ()),
                         tuple(param.placements))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return ParamSpec(name, tuple(param.shape), param.dtype, split, np.arange(world), ("world",), (Replicate(),))


def model_specs(config, layout, dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    """Specs of every Muon parameter of `Transformer(config)` under `layout` (a
    parallel.layout.Layout: dp_replicate, dp_shard, cp, ep, edp_replicate, edp_shard, world_size,
    expert_inner), built on the meta device (no storage)."""
    from models import Transformer
    from models.experts import GroupedExperts

    with torch.device("meta"):
        model = Transformer(config)
    splits = muon_splits(model)
    experts = {
        f"{prefix}.{n}" for prefix, m in model.named_modules() if isinstance(m, GroupedExperts)
        for n, _ in m.named_parameters(recurse=False)
    }
    from parallel.layout import EXPERT_AXES
    from parallel.meshes import rank_mesh

    world = layout.world_size
    dense_ranks = np.arange(world).reshape(layout.dp_replicate, layout.dp_shard * layout.cp)
    expert_ranks = rank_mesh(layout, EXPERT_AXES)  # follows parallel.expert_inner, like the runtime's mesh
    placements = expert_placements(config.n_routed_experts, layout)
    specs = []
    for name, param in model.named_parameters():
        if name not in splits:
            continue
        if name in experts:
            specs.append(ParamSpec(name, tuple(param.shape), dtype, splits[name], expert_ranks, EXPERT_NAMES,
                                   placements))
        else:
            specs.append(ParamSpec(name, tuple(param.shape), dtype, splits[name], dense_ranks, DENSE_NAMES,
                                   (Replicate(), Shard(0))))
    return specs


def expert_placements(n_experts: int, layout) -> tuple:
    """Placements of a stacked expert weight on the expert mesh (edp_replicate, edp_shard, ep)."""
    if layout.expert_shard_dim(n_experts) == 1:  # the rule parallel/fsdp.py applies
        return (Replicate(), Shard(1), Shard(0))
    if layout.ep == 1:
        return (Replicate(), Shard(0), Shard(0))
    return (Replicate(), strided_shard(0, layout.ep), Shard(0))


def muon_specs(named_params, splits: dict[str, MatrixSplit]) -> list[ParamSpec]:
    """Specs of the parameters that have a split, in `named_params` order."""
    return [param_spec(n, p, splits[n]) for n, p in named_params if n in splits]

