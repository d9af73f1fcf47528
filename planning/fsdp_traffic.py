"""The whole-step projection's network model (benchmarks/step_projection.py): bytes one rank sends per
step over NVLink and the network, for FSDP's all-gathers, reduce-scatters and HSDP all-reduces of each
unit, and the mesh groups of a layout. A module of its own so that launch/dry_run.py can compare the
collectives it counts with these terms without importing the projection script."""

import math
from dataclasses import dataclass

import torch

from planning.wire import wire_bytes

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Link:
    """Bytes one rank sends per step over NVLink (intra) and the network (inter)."""
    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other):
        return Link(self.intra + other.intra, self.inter + other.inter)

    def scale(self, k: float) -> "Link":
        return Link(self.intra * k, self.inter * k)

    @property
    def total(self) -> float:
        return self.intra + self.inter


def peers(size: int, stride: int, gpus_per_node: int | None = None) -> tuple[int, int]:
    """(peers on my node, peers elsewhere) in a group of `size` ranks spaced `stride` apart (rank 0's
    group; mesh groups are translates of it). Nodes of GPUS_PER_NODE ranks unless given."""
    gpus_per_node = gpus_per_node or GPUS_PER_NODE
    same = sum(1 for i in range(1, size) if (i * stride) // gpus_per_node == 0)
    return same, size - 1 - same


def on_wire(kind: str, passed_bytes: float, size: int, stride: int) -> Link:
    """Bytes rank 0 sends for one collective of `kind` in its group of `size` ranks `stride` apart,
    passing `passed_bytes` in: planning/wire.py, the conversion the dry run applies to the
    collectives it counts (launch/dry_run.py)."""
    return Link(*wire_bytes(kind, passed_bytes, [i * stride for i in range(size)], 0, GPUS_PER_NODE))


def all_gather(shard_bytes: float, size: int, stride: int) -> Link:
    return on_wire("all_gather", shard_bytes, size, stride)


def all_reduce(nbytes: float, size: int, stride: int) -> Link:
    return on_wire("all_reduce", nbytes, size, stride)


# -- the layout's groups: (size, stride) of rank 0's group, in the runtime's numbering (parallel/meshes.py)

def groups(layout) -> dict:
    from parallel.layout import DENSE_AXES, EXPERT_AXES
    from parallel.meshes import strides

    dense, expert = strides(layout, DENSE_AXES), strides(layout, EXPERT_AXES)
    out = {a: (getattr(layout, a), dense[a]) for a in DENSE_AXES}
    out |= {a: (getattr(layout, a), expert[a]) for a in EXPERT_AXES}
    out["dp_shard_cp"] = (layout.dp_shard * layout.cp, 1)  # dp_shard and cp flattened: consecutive ranks
    return out


# -- FSDP units of the meta model, as parallel/fsdp.py wraps them

def fsdp_units(model) -> list[tuple[str, list[torch.Size]]]:
    """[(mesh "dense"|"expert"|"router", parameter shapes)] per FSDP unit, in forward order. A router is a
    dense-mesh unit of its own, gathered in fp32 whatever param_dtype (parallel/fsdp.py; with fp32 params
    it stays in its block's unit: the same bytes)."""
    from models.experts import GroupedExperts
    from models.moe import Router

    units = [("dense", [p.shape for p in model.tok_embeddings.parameters()])]
    for block in model.layers:
        own_unit = set()
        for m in block.modules():
            if isinstance(m, (GroupedExperts, Router)):
                units.append(("expert" if isinstance(m, GroupedExperts) else "router", [p.shape for p in m.parameters()]))
                own_unit |= {id(p) for p in m.parameters()}
        units.append(("dense", [p.shape for p in block.parameters() if id(p) not in own_unit]))
    units.append(("dense", [p.shape for p in model.norm.parameters()] + [p.shape for p in model.output.parameters()]))
    return units


def _shard_numel(shape, shard_dim: int, size: int) -> int:
    """Elements of one padded FSDP2 shard: ceil(dim / size) rows of the sharded dim."""
    return math.ceil(shape[shard_dim] / size) * math.prod(shape) // max(1, shape[shard_dim])


def unit_shard_numel(mesh: str, shapes, layout, n_experts: int) -> int:
    """Elements of this rank's (padded) shard of one unit."""
    if mesh != "expert":
        return sum(_shard_numel(s, 0, layout.dp_shard * layout.cp) for s in shapes)
    local = [(s[0] // layout.ep, *s[1:]) for s in shapes]  # the ep rank's experts
    dim = layout.expert_shard_dim(n_experts)
    return sum(_shard_numel(s, dim, layout.edp_shard) for s in local)


def fsdp_traffic(units, layout, config, micro_batches: int, param_bytes: int, grad_bytes: int,
                 grad_sync: str = "every") -> dict:
    """{"dense"|"expert": {"all_gather", "reduce_scatter", "all_reduce": Link}} per rank per step.
    grad_sync (parallel/overlap.py): reduce-scatter every micro-batch unless "last"; the HSDP
    all-reduce every micro-batch only with "every"."""
    times = {"all_gather": micro_batches, "reduce_scatter": 1 if grad_sync == "last" else micro_batches,
             "all_reduce": micro_batches if grad_sync == "every" else 1}
    g = groups(layout)
    shard_axis = {"dense": g["dp_shard_cp"], "expert": g["edp_shard"]}
    replicate_axis = {"dense": g["dp_replicate"], "expert": g["edp_replicate"]}
    out = {m: {"all_gather": Link(), "reduce_scatter": Link(), "all_reduce": Link()} for m in ("dense", "expert")}
    for unit, shapes in units:
        shard = unit_shard_numel(unit, shapes, layout, config.n_routed_experts)
        mesh, gathered_bytes = ("dense", 4) if unit == "router" else (unit, param_bytes)  # routers: fp32
        size, stride = shard_axis[mesh]
        per_mb = {"all_gather": all_gather(shard * gathered_bytes, size, stride).scale(2),  # forward + backward
                  "reduce_scatter": on_wire("reduce_scatter", shard * size * grad_bytes, size, stride),
                  "all_reduce": all_reduce(shard * grad_bytes, *replicate_axis[mesh])}
        for k, v in per_mb.items():
            out[mesh][k] = out[mesh][k] + v.scale(times[k])
    return out

