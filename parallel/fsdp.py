"""FSDP2 (`fully_shard`) on two meshes: routed experts on the expert mesh, everything else dense.

Placements after `apply_fsdp` (what the optimizer sees; every parameter is a DTensor):
  dense weights   mesh ("dp_replicate", "dp_shard_cp"), placements (Replicate(), Shard(0)):
                    rows split over dp_shard x cp (torch.chunk sizes, last shards may be short
                    or empty), replicated over dp_replicate
  expert weights  mesh ("edp_replicate", "edp_shard", "ep"), placements
                    (Replicate(), Shard(0), Shard(0))                          if ep == 1
                    (Replicate(), _StridedShard(0, split_factor=ep), Shard(0))  if ep > 1
                    (Replicate(), Shard(1), Shard(0))                          if E/ep < edp_shard
    With Shard(0)/_StridedShard, rank (r, s, e) holds whole experts: ep splits first, then
    edp_shard splits each ep rank's L = E/ep experts, i.e. experts e*L + s*L/edp_shard + [0, L/edp_shard)
    (torch.chunk sizes when edp_shard does not divide L). With Shard(1), rank (r, s, e) holds all
    L experts of ep rank e, rows [s*n/edp_shard, (s+1)*n/edp_shard) of each expert matrix
    (n = moe_inter_dim for w1/w3, dim for w2; validated divisible).
Gradients arrive in the same placements, SUMMED over the data-parallel ranks (not averaged; see
parallel/gradients.py for the loss convention that makes the sum the single-process gradient).

Wrapping units: one per expert group (GroupedExperts, expert mesh), one per TransformerBlock
(the rest of the block, dense mesh), the embedding, the final norm with the output head, and the
root. Under pipeline parallelism each stage is sharded on its own meshes (its stage's ranks) and is
its own root, holding the embedding or the head only if it is the first or the last stage. `fully_shard` keeps parameter names (FQNs) unchanged.

Mixed precision (FSDP2 `MixedPrecisionPolicy`, the same on both meshes): sharded parameters, their
gradients and the optimizer state stay fp32; each unit all-gathers its weights cast to
`param_dtype` and its forward runs on them (floating-point inputs are cast to `param_dtype` at the
unit's entry), so the model itself never casts weights; gradients are cast to `reduce_dtype` for the
reduce-scatter / all-reduce and land fp32 on the shards. Routers are their own unit with an fp32
policy when `param_dtype` is lower: routing decisions are sensitive to rounding. With everything
fp32 no policy is set, which is exactly the fp32 path (no casts anywhere).
"""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from models.experts import GroupedExperts
from models.moe import Router
from parallel.layout import Layout
from parallel.meshes import Meshes


def apply_fsdp(model: nn.Module, meshes: Meshes, layout: Layout, *, param_dtype: torch.dtype = torch.float32,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True) -> None:
    """Shard `model` in place (after `apply_expert_parallel`, so expert weights are already DTensors on ep).
    `model`: a Transformer, or one pipeline stage of it (parallel/pp/part.py: the embedding, the norm and
    the head only where the stage holds them; the stage is then its own root unit).
    `reshard_after_forward` (parallel.reshard_after_forward): False keeps each unit's gathered weights from
    its forward to its backward (no second all-gather; the memory of the unsharded weights meanwhile)."""
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    router_policy = mixed_precision_policy(torch.float32, reduce_dtype)
    expert_dim = layout.expert_shard_dim(model.config.n_routed_experts)
    dense = {"mesh": meshes.dense_fsdp, "mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    for block in model.layers:
        for module in nested_units(block, param_dtype):
            if isinstance(module, GroupedExperts):
                _shard_experts(module, meshes, expert_dim, policy, reshard_after_forward)
            else:
                fully_shard(module, **{**dense, "mp_policy": router_policy})
        fully_shard(block, **dense)  # skips the units above
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **dense)
    if model.output is not None:
        fully_shard([model.norm, model.output], **dense)
    fully_shard(model, **dense)
    _sum_gradients(model)


def nested_units(block: nn.Module, param_dtype: torch.dtype) -> list[nn.Module]:
    """The FSDP units `apply_fsdp` makes inside `block`: every GroupedExperts, and every Router when
    param_dtype is lower than fp32 (parallel/compile.py keeps compiled regions free of them)."""
    return [m for m in block.modules() if isinstance(m, GroupedExperts)
            or (isinstance(m, Router) and param_dtype != torch.float32)]


def mixed_precision_policy(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The FSDP2 policy; the default (no casts) when both are the parameters' own fp32. FSDP2 reduces
    in param_dtype when reduce_dtype is None, so reduce_dtype is explicit whenever param_dtype is set."""
    if param_dtype == reduce_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                reduce_dtype=reduce_dtype)


def _shard_experts(experts: GroupedExperts, meshes: Meshes, dim: int, policy: MixedPrecisionPolicy,
                   reshard_after_forward: bool = True) -> None:
    # Shard(1) = a matrix dim (F for w1/w3, D for w2) when there are fewer local experts than
    # edp_shard ranks: Shard(0) would leave ranks with empty shards (and padding traffic).
    placement_fn = None if dim == 0 else (lambda param: Shard(1))
    fully_shard(experts, mesh=meshes.expert_fsdp, shard_placement_fn=placement_fn, mp_policy=policy,
                reshard_after_forward=reshard_after_forward)


def _sum_gradients(model: nn.Module) -> None:
    """Reduce-scatter and all-reduce gradients with SUM on both meshes (FSDP averages by default,
    which is wrong for experts under ep > 1 and for dense weights under cp > 1). Forcing SUM-only
    collectives avoids PREMUL_SUM, which gloo lacks; with factor 1 no extra division runs."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
