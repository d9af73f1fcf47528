"""The dry run's collectives: counted on every dispatched call, converted to bytes on the wire, and
compared with the whole-step projection's terms for the same materialized model, to the byte.

`CollectiveLog` (a dispatch mode) sees every c10d and functional collective of the step and books it
by (kind, mesh, source): kind all_gather | reduce_scatter | all_reduce | all_to_all (others keep their
op name, no wire bytes), mesh the axes of its group, source who issued it (fsdp, ep, optimizer, other:
the innermost caller found on the Python stack). Per row: `bytes` this rank passes in (its shard for an
all-gather, its whole input otherwise) and `wire_intra_bytes` / `wire_inter_bytes` it sends to peers on
its node and elsewhere, by planning/wire.py, the conversion the projection uses.

`compare` puts the counted FSDP and EP rows next to the whole-step projection's FSDP terms (planning/fsdp_traffic.py)
(`fsdp_units` + `fsdp_traffic` of the materialized model, rank 0's groups) and
planning/ep_traffic.py's per-layer EP term (`layer_stages` + `layer_link_bytes`) evaluated on the
routing this rank's routers produced in the step, with the dry run's symmetric-traffic assumption made
concrete: ep peer p routes like this rank with the experts of p and of this rank swapped, so p sends
this rank exactly what this rank sends p (under the fake backend the EP dispatcher mirrors the counts:
parallel/ep/dispatcher.py).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from planning import recording

SOURCES = (("/torch/distributed/fsdp/", "fsdp"), ("/parallel/ep/", "ep"),
           ("/optim/", "optimizer"))


MATMULS = recording.MATMULS | {torch.ops.aten._grouped_mm}  # op packets (planning/recording.py's, + grouped)


def fp32_matmul(func, args, kwargs):
    """`func` (a matmul's default overload: no out= tensor) on bf16 CPU tensors, computed in fp32 and returned in the dtype it would return:
    CPUs without bf16 matrix units run bf16 GEMMs far slower (K2's output head's weight gradient, 64 tokens:
    72 s in bf16, 10 s this way, measured), and the dry run counts bytes and memory, not values."""
    up = lambda a: a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a  # noqa: E731
    return func(*map(up, args), **{k: up(v) for k, v in kwargs.items()}).to(torch.bfloat16)


class CollectiveLog(TorchDispatchMode):
    """Every collective dispatched (module docstring) -> rows {kind, op, mesh, source, bytes, count,
    wire_intra_bytes, wire_inter_bytes}; `memory`: the live-storage count of every op. Matmuls of bf16
    CPU tensors run in fp32 (`fp32_matmul`)."""

    def __init__(self, names: dict, ranks_per_node: int, legal=None):
        super().__init__()
        self.names, self.ranks_per_node, self.legal = names, ranks_per_node, legal or (lambda func, args: args)
        self.rows, self.memory = {}, recording.LiveMemory()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = recording.decode(func, args)
        if call is not None:
            self._add(call)
            args = self.legal(func, args)
        kwargs = kwargs or {}
        if func.overloadpacket in MATMULS and func is func.overloadpacket.default and "out_dtype" not in kwargs \
                and args[0].dtype == torch.bfloat16 and args[0].device.type == "cpu":
            out = fp32_matmul(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self.memory.track(args, out)
        return out

    def _add(self, call: recording.Collective):
        label = self.names.get(call.group.group_name, f"group {call.group.group_name}")
        key = (call.kind, label, _source())
        row = self.rows.setdefault(key, {"kind": call.kind, "op": call.op.rstrip("_"), "mesh": label,
                                         "source": key[2], "bytes": 0, "count": 0, "wire_intra_bytes": 0,
                                         "wire_inter_bytes": 0})
        intra, inter = call.links(self.ranks_per_node)
        row["bytes"] += call.passed
        row["count"] += 1
        row["wire_intra_bytes"] += intra
        row["wire_inter_bytes"] += inter

    def table(self) -> list[dict]:
        return sorted(self.rows.values(), key=lambda r: (r["mesh"], r["kind"], r["source"]))


def _source() -> str:
    """Who issued the collective: the innermost caller whose file matches SOURCES, else "other"."""
    frame = sys._getframe(3)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for pattern, source in SOURCES:
            if pattern in path:
                return source
        frame = frame.f_back
    return "other"


class RoutingLog:
    """experts_TK of every Router call inside a forward of `model` (not the reruns of activation
    checkpointing, which run in the backward: their all-to-alls the projection counts by itself)."""

    def __init__(self, model):
        from models.moe import Router

        self.routings, self._in_forward = [], False
        model.register_forward_pre_hook(lambda *_: setattr(self, "_in_forward", True))
        model.register_forward_hook(lambda *_: setattr(self, "_in_forward", False))
        for module in model.modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._record)

    def _record(self, module, args, out):
        if self._in_forward:
            self.routings.append(out[1].detach().clone())


def symmetric_routing(experts_TK: torch.Tensor, me: int, n_ranks: int, local: int) -> list[torch.Tensor]:
    """experts_TK of each ep index under the dry run's assumption: index p routes like `me` with the
    experts of p and `me` swapped, so p sends `me` as many copies per expert as `me` sends p."""
    rank_TK = experts_TK // local
    out = []
    for p in range(n_ranks):
        shift = (p - me) * local
        others_TK = torch.where(rank_TK == p, experts_TK - shift, experts_TK)
        out.append(torch.where(rank_TK == me, experts_TK + shift, others_TK))
    return out


def projected_terms(job, layout, meshes, names: dict, routings: list) -> dict:
    """{(kind, mesh label, source): [intra, inter]}: the projection's FSDP terms of `job`'s model (the
    materialized one) and its per-layer EP term on `routings`, for this rank."""
    from planning import ep_traffic, fsdp_traffic
    from models import Transformer
    from parallel.ep.plan import Placement
    from runtime.train import DTYPES

    t = job.training
    param_bytes, grad_bytes = DTYPES[t.param_dtype].itemsize, DTYPES[t.reduce_dtype].itemsize
    with torch.device("meta"):
        units = fsdp_traffic.fsdp_units(Transformer(job.model))
    fsdp = fsdp_traffic.fsdp_traffic(units, layout, job.model, t.grad_accum, param_bytes, grad_bytes, t.grad_sync)
    label = lambda mesh, axis: names.get(getattr(meshes, mesh).get_group(axis).group_name)  # noqa: E731
    group = {("dense", "all_gather"): label("dense_fsdp", "dp_shard_cp"),
             ("dense", "reduce_scatter"): label("dense_fsdp", "dp_shard_cp"),
             ("dense", "all_reduce"): label("dense_fsdp", "dp_replicate"),
             ("expert", "all_gather"): label("expert_fsdp", "edp_shard"),
             ("expert", "reduce_scatter"): label("expert_fsdp", "edp_shard"),
             ("expert", "all_reduce"): label("expert_fsdp", "edp_replicate")}
    out = {}
    for (mesh, kind), mesh_label in group.items():
        link = fsdp[mesh][kind]
        row = out.setdefault((kind, mesh_label, "fsdp"), [0.0, 0.0])
        row[0], row[1] = row[0] + link.intra, row[1] + link.inter
    if layout.ep > 1:
        ep_group = meshes.expert.get_group("ep")
        ranks, me = dist.get_process_group_ranks(ep_group), dist.get_rank(ep_group)
        placement = Placement(job.model.n_routed_experts, tuple(ranks), layout.ep_config.ranks_per_node)
        row = out.setdefault(("all_to_all", names.get(ep_group.group_name), "ep"), [0, 0])
        for routing in routings:
            routing = symmetric_routing(routing, me, layout.ep, placement.local_experts)
            stages = ep_traffic.layer_stages(job.model, layout, routing, param_bytes, placement)
            intra, inter = ep_traffic.layer_link_bytes(stages, placement, me, t.activation_checkpoint, layout)
            row[0], row[1] = row[0] + intra, row[1] + inter
    return out


def compare(rows: list[dict], projected: dict) -> list[dict]:
    """[{kind, mesh, source, counted: [intra, inter], projected: [intra, inter], equal}] per projected term:
    the counted rows of the same kind, mesh and source against the projection's."""
    out = []
    for (kind, mesh, source), (p_intra, p_inter) in sorted(projected.items()):
        mine = [r for r in rows if (r["kind"], r["mesh"], r["source"]) == (kind, mesh, source)]
        counted = [sum(r["wire_intra_bytes"] for r in mine), sum(r["wire_inter_bytes"] for r in mine)]
        equal = abs(counted[0] - p_intra) < 0.5 and abs(counted[1] - p_inter) < 0.5
        out.append({"kind": kind, "mesh": mesh, "source": source, "counted": counted,
                    "projected": [p_intra, p_inter], "equal": equal})
    return out
