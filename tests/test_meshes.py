"""The real meshes on 8 gloo ranks follow the documented rank -> coordinate mapping.

`build_meshes` views one world mesh twice (dense and expert); the pure functions in
parallel/meshes.py (`coordinates`, `group_ranks`) are the documented mapping, also used at start-up
by `describe`. Here every process group of every axis is checked against them, on every rank.
"""

import torch.distributed as dist

from multirank import run_ranks
from parallel.layout import DENSE_AXES, EXPERT_AXES, ParallelConfig
from parallel.meshes import build_meshes, coordinates, group_ranks

LAYOUTS = [
    ParallelConfig(dp_shard=4, cp=2, ep=8, edp_shard=1),
    ParallelConfig(dp_replicate=2, dp_shard=2, cp=2, edp_replicate=2, edp_shard=2, ep=2),
    ParallelConfig(dp_replicate=2, dp_shard=4, ep=4, edp_shard=2),
]


def _ranks(mesh, axis=None):
    return dist.get_process_group_ranks(mesh.get_group(axis))


def _mesh_facts(rank, world_size):
    out = []
    for config in LAYOUTS:
        meshes = build_meshes(config.resolve(world_size), "cpu")
        groups = {a: _ranks(meshes.dense, a) for a in DENSE_AXES} | {a: _ranks(meshes.expert, a) for a in EXPERT_AXES}
        groups["dp_shard_cp"] = _ranks(meshes.dense_fsdp, "dp_shard_cp")
        groups["dense_fsdp.dp_replicate"] = _ranks(meshes.dense_fsdp, "dp_replicate")
        groups["expert_fsdp.edp_shard"] = _ranks(meshes.expert_fsdp, "edp_shard")
        groups["ep_mesh"] = _ranks(meshes.ep)
        groups["cp_mesh"] = _ranks(meshes.cp)
        coords = (tuple(meshes.dense.get_coordinate()), tuple(meshes.expert.get_coordinate()))
        out.append((groups, coords, meshes.dp_rank(), meshes.cp_rank()))
    return out


def test_meshes_follow_the_documented_rank_mapping():
    per_rank = run_ranks(_mesh_facts, 8)
    for i, config in enumerate(LAYOUTS):
        layout = config.resolve(8)
        for rank in range(8):
            groups, (dense_coord, expert_coord), dp_rank, cp_rank = per_rank[rank][i]
            expect = {a: group_ranks(layout, DENSE_AXES, (a,), rank) for a in DENSE_AXES}
            expect |= {a: group_ranks(layout, EXPERT_AXES, (a,), rank) for a in EXPERT_AXES}
            expect["dp_shard_cp"] = group_ranks(layout, DENSE_AXES, ("dp_shard", "cp"), rank)
            expect["dense_fsdp.dp_replicate"] = expect["dp_replicate"]
            expect["expert_fsdp.edp_shard"] = expect["edp_shard"]
            expect["ep_mesh"], expect["cp_mesh"] = expect["ep"], expect["cp"]
            assert groups == expect, f"{config} rank {rank}"
            assert dense_coord == coordinates(layout, DENSE_AXES, rank)
            assert expert_coord == coordinates(layout, EXPERT_AXES, rank)
            r, s, c = dense_coord
            assert (dp_rank, cp_rank) == (r * layout.dp_shard + s, c)
