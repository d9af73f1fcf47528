"""Sharded Muon: one optimizer for every parameter of a model sharded on two meshes.

Muon for the parameters the model declares as matrices (`muon_splits`), per head / per expert /
whole; AdamW for the rest; the same numbers as `ReferenceMuon` on full tensors (see
tests/ranks/test_sharded_muon.py). Parameters are DTensors (FSDP2 on the dense or the expert mesh, any
Replicate / Shard / _StridedShard placements) or, for a single process, plain tensors; nothing is
configured per parameter.

Construction plans once (optim/planner/plan.py, pure) and derives this rank's buckets
(optim/sharded/schedule.py). Under pipeline parallelism each stage plans over its own ranks only
(`group`): its parameters live on meshes of those ranks, so owners, buckets and every collective stay
inside the stage, and the plan numbers them 0..S-1 (stage rank = global rank - the stage's first rank).
Process groups no mesh provides are created by every rank of the world for every stage's plan, in one
order (`_process_groups`), so no rank waits in `dist.new_group` for a stage that plans other groups. State is created eagerly and rank-symmetric: "momentum_buffer" for
every Muon parameter, "step"/"exp_avg"/"exp_avg_sq" for every AdamW parameter, as DTensors in the
parameter's own layout, so `torch.distributed.checkpoint` saves and loads it and an expert that got
no tokens still has state. A parameter whose grad is None is skipped (torch semantics), but its
pieces still travel, so every rank issues the same collectives; FSDP2 gives either all or none of
a parameter's shards a grad.
"""

import dataclasses

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from optim.adamw import adamw_multi_tensor, init_adamw_state
from optim.config import OptimConfig
from optim.muon_reference import param_groups, partition_params, step_groups
from optim.newton_schulz import lr_scale
from optim.planner.plan import PlanOptions, make_plan
from optim.planner.specs import param_spec
from optim.sharded.pipeline import BucketPipeline
from optim.sharded.schedule import collectives, group_keys, rank_schedule


def plan_options(config: OptimConfig, device, *, bucket_mb: float, replica_split: str, ranks_per_node: int,
                 prefer_holders: bool = True) -> PlanOptions:
    """The planner's options for `config` on `device` (what the optimizer plans with; the memory
    estimate plans the same way)."""
    return PlanOptions(bucket_mb=bucket_mb, replica_split=replica_split, ns_dtype=config.ns_torch_dtype(device),
                       ns_steps=config.ns_steps, ns_method=config.ns_method, ranks_per_node=ranks_per_node,
                       prefer_holders=prefer_holders)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedMuon(torch.optim.Optimizer):
    """Param groups as in `ReferenceMuon` (group["kind"] "muon" / "adamw", both with "lr").

    Options: bucket_mb (NS input each rank owns per bucket), replica_split ("auto" | "on" | "off":
    split the NS work across HSDP replicas, all-gathering results over the replica axis),
    overlap (False: one bucket at a time, for benchmarks), ranks_per_node (cost model and stats),
    record_events (keep `events`, the (event, bucket) order of the last step, for tests),
    split_params (names of parameters to split across replicas, overriding replica_split; tests),
    prefer_holders (a block held in pieces goes to its least loaded holder while that stays under
    the mean load: expert pieces stay inside their edp_shard group, on NVLink when it is inside a
    node; Kimi K2 at 256 GPUs projects 0.295 s with it against 0.471 s without, narrow layout, and
    0.456 against 0.472 s wide; False: any rank, by load alone),
    group (the ranks to plan over, default the world: under pipeline parallelism this rank's stage) and
    pp_group (the pipeline group: one rank of every stage, to create every stage's process groups alike).
    """

    def __init__(
        self,
        named_params,
        splits,
        config: OptimConfig,
        *,
        bucket_mb: float = 256.0,
        replica_split: str = "auto",
        overlap: bool = True,
        ranks_per_node: int = 8,
        record_events: bool = False,
        split_params: set[str] | None = None,
        prefer_holders: bool = True,
        group=None,
        pp_group=None,
    ):
        if isinstance(named_params, nn.Module):
            named_params = named_params.named_parameters()
        muon, adamw = partition_params(named_params, splits, config)
        super().__init__(param_groups(muon, adamw, config), defaults={})
        self.overlap = overlap
        self.events = [] if record_events else None
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        self._pp_group = pp_group
        specs = [_in_group(param_spec(n, p, splits[n]), members) for n, p in muon]
        device = _local(muon[0][1]).device if muon else torch.device("cpu")
        ns_dtype = config.ns_torch_dtype(device)  # plan, all-to-all and NS in this dtype
        options = plan_options(config, device, bucket_mb=bucket_mb, replica_split=replica_split,
                               ranks_per_node=ranks_per_node, prefer_holders=prefer_holders)
        self.plan = make_plan(specs, world, options, split=split_params)
        _check_local_shapes(self.plan, [p for _, p in muon], rank)
        self._scales = [lr_scale(*lp.block_shape, config.lr_adjust) for lp in self.plan.params]
        listed = collectives(self.plan)
        groups = _process_groups(self.plan, listed, [p for _, p in muon], rank, world, group, members, pp_group)
        local_shapes = [tuple(_local(p).shape) for _, p in muon]
        self._pipeline = BucketPipeline(
            self.plan, rank_schedule(self.plan, rank, listed), groups, local_shapes=local_shapes, device=device,
            ns_dtype=ns_dtype, steps=config.ns_steps, coefficients=config.coefficients, method=config.ns_method,
            tf32=config.ns_tf32, events=self.events,
        )
        for group in self.param_groups:
            for p in group["params"]:
                if group["kind"] == "muon":
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                else:
                    self.state[p].update(init_adamw_state(p))

    def stage_plans(self) -> list[tuple[float, str]] | None:
        """Under pipeline parallelism: (estimated step seconds, description) of every stage's plan, in stage
        order (collective over the pp group); None without it."""
        if self._pp_group is None:
            return None
        mine = (self.plan.stats.est_seconds if self.plan.params else 0.0,
                self.plan.describe() if self.plan.params else "no Muon parameter")
        plans = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(plans, mine, group=self._pp_group)
        return plans

    @torch.no_grad()
    def step(self, closure=None):
        """One step. Flow (communication only in b and d; see optim/sharded/pipeline.py):
        a. momentum on local shards: buf = mu buf + g; p *= 1 - lr wd (multi-tensor ops);
        b. per bucket: u = g + mu buf (Nesterov) at the bucket's local pieces, written in the NS
           dtype straight into the bucket's send buffer (u is never materialized whole: the step's
           extra memory is a few buckets), one uneven all_to_all_single per group (async);
        c. owners assemble full blocks, one batched orthogonalize per shape group and bucket;
        d. all-to-all back (async; bucket k+1 launched before bucket k computes); with replica
           split, the results reach the other replicas by an all-to-all into equal chunks and an
           all-gather of the chunks over the replica axis (a ring on NCCL);
        e. apply p[piece] -= lr * lr_scale(block) * O[piece] to the local shards;
        then AdamW on the local shards of the other parameters (torch's multi-tensor AdamW).
        """
        if self.events is not None:
            self.events.clear()
        return step_groups(self, closure)

    def _muon_step(self, group):
        params, lr, mu = group["params"], group["lr"], group["momentum"]
        live = [i for i, p in enumerate(params) if p.grad is not None]
        for i in live:
            _check_grad(params[i])
        local = [_local(p) for p in params]
        grads = [_local(p.grad) if p.grad is not None else None for p in params]
        bufs = [_local(self.state[p]["momentum_buffer"]) for p in params]
        if live:  # a. momentum and weight decay on the local shards, one multi-tensor op each
            torch._foreach_mul_([bufs[i] for i in live], mu)
            torch._foreach_add_([bufs[i] for i in live], [grads[i] for i in live])
            torch._foreach_mul_([local[i] for i in live], 1 - lr * group["weight_decay"])

        # flat views of the local shards (written in place: views; only read: copies if not contiguous)
        flat_p = [t.view(-1) for t in local]
        flat_g = [t.reshape(-1) if t is not None else None for t in grads]
        flat_b = [t.reshape(-1) for t in bufs]

        def direction(pi, where, g, out):  # u = g + mu * buf at `where` into out, never all of u at once
            if grads[pi] is None:
                return False
            buf, grad = _at(flat_b[pi], where, g), _at(flat_g[pi], where, g)
            if group["nesterov"]:
                torch.add(grad, buf, alpha=mu, out=out)  # computed in fp32, rounded once to out's dtype
            else:
                out.copy_(buf)
            return True

        def apply(pi, where, g, values):  # e. p[where] -= lr * lr_scale(block) * O[where]
            if grads[pi] is None:
                return
            p, alpha = flat_p[pi], -lr * self._scales[pi]
            if g is None:
                _at(p, where, None).add_(values, alpha=alpha)  # values in the NS dtype, promoted in the kernel
            else:
                p.view(-1, g).index_add_(0, where, values.to(p.dtype), alpha=alpha)

        self._pipeline.run(direction, apply, self.overlap)  # b-d

    def _adamw_step(self, group):
        live = [p for p in group["params"] if p.grad is not None]
        for p in live:
            _check_grad(p)
        states = [{"step": self.state[p]["step"], "exp_avg": _local(self.state[p]["exp_avg"]),
                   "exp_avg_sq": _local(self.state[p]["exp_avg_sq"])} for p in live]
        adamw_multi_tensor([_local(p) for p in live], [_local(p.grad) for p in live], states, lr=group["lr"],
                           betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])


def _at(flat: torch.Tensor, where, g: int | None) -> torch.Tensor:
    """A slice of a flat shard (g None; the shard itself when the slice is all of it: no op to
    dispatch), or the rows `where` of it viewed as [-1, g] (gathered)."""
    if g is None:
        return flat if where.start == 0 and where.stop == len(flat) else flat[where]
    return flat.view(-1, g).index_select(0, where)


def _check_grad(p):
    if isinstance(p, DTensor) and (not isinstance(p.grad, DTensor) or p.grad.placements != p.placements):
        got = p.grad.placements if isinstance(p.grad, DTensor) else type(p.grad).__name__
        raise ValueError(f"gradient placements {got} differ from the parameter's {p.placements}")


def _check_local_shapes(plan, params, rank):
    """The planner's box of this rank must be the shard torch actually gave it."""
    for lp, p in zip(plan.params, params):
        where = np.argwhere(lp.groups == rank)
        if len(where) == 0:
            continue
        box = lp.boxes[where[0][1]]
        expected = tuple(int(hi - lo) for lo, hi in box)
        if tuple(_local(p).shape) != expected:
            raise ValueError(
                f"{lp.spec.name}: local shard {tuple(_local(p).shape)} on rank {rank}, but placements "
                f"{lp.spec.placements} on mesh {lp.groups.shape} predict {expected} (box {box.tolist()})"
            )


def _process_groups(plan, listed, params, rank, world, group=None, members=None, pp_group=None) -> dict:
    """Group (sorted ranks of the plan) -> process group, for every group this rank communicates in.

    A group equal to one axis of a parameter's mesh reuses that mesh's group; the whole world (or stage:
    `group`) reuses that group; any other (e.g. edp_shard x ep together) is created with new_group, which
    every rank of the world calls for every such group in sorted order (a collective call). Under
    pipeline parallelism stages plan different groups: the global ranks of each stage's are gathered over
    the pp group first, so every rank creates the union, in one order. `members`: the global rank of each
    plan rank."""
    keys, _, _ = group_keys(plan)
    members = list(range(world)) if members is None else members
    used = sorted({g for in_bucket in listed for _, g in in_bucket})
    out, created = {}, []
    for g in used:
        key = keys[g]
        source = _mesh_axis(plan, params, key)
        if key == tuple(range(world)):
            out[key] = dist.group.WORLD if group is None else group
        elif source is not None:
            pi, axis = source
            if rank in key:
                out[key] = params[pi].device_mesh.get_group(axis)
        else:
            created.append(key)
    globally = [tuple(members[r] for r in key) for key in created]
    for ranks in (_every_stage(globally, pp_group) if pp_group is not None else globally):
        new = dist.new_group(list(ranks))
        local = tuple(members.index(r) for r in ranks if r in members)
        if len(local) == len(ranks) and rank in local:
            out[local] = new
    return out


def _every_stage(keys, pp_group=None) -> list[tuple[int, ...]]:
    """The union, sorted, of the groups (global ranks) every stage creates (gathered over the pp group)."""
    mine = sorted(keys)
    every = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, mine, group=pp_group)
    return sorted({tuple(k) for stage in every for k in stage})


def _in_group(spec, members: list[int]):
    """`spec` with its mesh's ranks numbered inside `members` (a plain tensor: held by all of them)."""
    if spec.mesh_dim_names == ("world",):
        return dataclasses.replace(spec, mesh_ranks=np.arange(len(members)))
    index = {r: i for i, r in enumerate(members)}
    return dataclasses.replace(spec, mesh_ranks=np.vectorize(index.__getitem__)(spec.mesh_ranks))


def _mesh_axis(plan, params, key):
    """(param index, mesh axis) of a DTensor mesh axis whose groups include `key`, else None."""
    seen = set()
    for pi, (lp, p) in enumerate(zip(plan.params, params)):
        ranks = lp.spec.mesh_ranks
        if not isinstance(p, DTensor) or (ranks.shape, ranks.tobytes()) in seen:
            continue
        seen.add((ranks.shape, ranks.tobytes()))
        for axis in range(ranks.ndim):
            rows = np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis])
            if any(tuple(sorted(r.tolist())) == key for r in rows):
                return pi, axis
    return None
