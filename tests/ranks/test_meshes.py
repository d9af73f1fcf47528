"""The real meshes on 8 gloo ranks follow the documented rank -> coordinate mapping.

`build_meshes` views one world mesh twice (dense and expert); the pure functions in
parallel/meshes.py (`coordinates`, `group_ranks`) are the documented mapping, also used at start-up
by `describe`. Here every process group of every axis is checked against them, on every rank, for
both expert numberings (`parallel.expert_inner`). With edp_shard innermost, the rest of the runtime
must follow: training through the entry point against one process and resuming across numberings
(DCP), the sharded Muon against ReferenceMuon, and launch/estimate_memory.py's per-rank boxes against
the real shards.
"""

import shutil

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import muon_cases as sm
from entry_point import run_ok
from models import Transformer, preset
from multirank import run_ranks
from models.boxes import dtensor_box
from optim.sharded.muon import ShardedMuon
from parallel.parallelize import parallelize
from parallel.layout import DENSE_AXES, EXPERT_AXES, ParallelConfig
from parallel.meshes import build_meshes, coordinates, group_ranks, rank_mesh

LAYOUTS = [
    ParallelConfig(dp_shard=4, cp=2, ep=8, edp_shard=1),
    ParallelConfig(dp_replicate=2, dp_shard=2, cp=2, edp_replicate=2, edp_shard=2, ep=2),
    ParallelConfig(dp_replicate=2, dp_shard=4, ep=4, edp_shard=2),
    ParallelConfig(dp_replicate=2, dp_shard=4, ep=4, edp_shard=2, expert_inner="edp_shard"),
    ParallelConfig(dp_shard=4, cp=2, edp_replicate=2, edp_shard=2, ep=2, expert_inner="edp_shard"),
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
        groups["expert_fsdp.edp_replicate"] = _ranks(meshes.expert_fsdp, "edp_replicate")
        groups["expert_mesh"] = meshes.expert.mesh.tolist()
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
            expect["expert_fsdp.edp_replicate"] = expect["edp_replicate"]
            expect["expert_mesh"] = rank_mesh(layout, EXPERT_AXES).tolist()
            expect["ep_mesh"], expect["cp_mesh"] = expect["ep"], expect["cp"]
            assert groups == expect, f"{config} rank {rank}"
            assert dense_coord == coordinates(layout, DENSE_AXES, rank)
            assert expert_coord == coordinates(layout, EXPERT_AXES, rank)
            r, s, c = dense_coord
            assert (dp_rank, cp_rank) == (r * layout.dp_shard + s, c)


# -- the whole runtime on the expert mesh numbered with edp_shard innermost

STEPS = ["--training.steps=4", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
         "--checkpoint.interval=1", "--checkpoint.keep=0"]  # debug model, Muon, the bundled corpus
LAYOUT = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=4", "--parallel.edp_shard=2"]
ORDER = {inner: f"--parallel.expert_inner={inner}" for inner in ("ep", "edp_shard")}


def _losses(records, steps):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if r["step"] in steps]


def _assert_close(got, want):
    for (step, loss, norm), (step_want, loss_want, norm_want) in zip(got, want, strict=True):
        # fp32, the same math in another reduction order (tests/entry/test_pretrain.py: ~1e-6 per step, amplified by
        # Newton-Schulz and the optimizer steps to ~1e-5 at most); a wrong expert or group is off by > 1e-2.
        assert step == step_want and loss == pytest.approx(loss_want, rel=1e-4), (got, want)
        assert norm == pytest.approx(norm_want, rel=1e-3), (got, want)


def _resumed_from(capfd) -> list[str]:
    """Rank 0's resume lines since the last call (a checkpoint that fails to load would say so and fall
    back to an older one, whose losses would match just as well: the line names the one loaded)."""
    return [line for line in capfd.readouterr().out.splitlines() if "resumed from" in line or "does not load" in line]


def test_edp_shard_inner_trains_like_one_process_and_resumes_under_either_order(tmp_path, capfd):
    """8 ranks, dense dp_shard=4 x cp=2, experts edp_shard=2 x ep=4 numbered with edp_shard innermost
    (edp_shard groups [0 1] [2 3] ..., ep groups [0 2 4 6] [1 3 5 7]): the losses and gradient norms of
    4 Muon steps equal the single-process run's. Its step_2 checkpoint resumes with ep innermost, and
    that run's step_3 checkpoint resumes with edp_shard innermost again: DCP reshards between the orders."""
    single = run_ok(tmp_path / "single", 1, STEPS)
    run = tmp_path / "run"
    inner = run_ok(run, 8, STEPS + LAYOUT + [ORDER["edp_shard"]])
    _assert_close(_losses(inner, range(4)), _losses(single, range(4)))
    for step in (3, 4):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    _resumed_from(capfd)
    resumed = run_ok(run, 8, STEPS + LAYOUT + [ORDER["ep"]])  # from step_2, written with edp_shard inner
    assert _resumed_from(capfd) == [f"resumed from {run / 'checkpoints' / 'step_2'}"]
    _assert_close(_losses(resumed, (2, 3)), _losses(inner, (2, 3)))
    shutil.rmtree(run / "checkpoints" / "step_4")
    again = run_ok(run, 8, STEPS + LAYOUT + [ORDER["edp_shard"]])  # from step_3, written with ep inner
    assert _resumed_from(capfd) == [f"resumed from {run / 'checkpoints' / 'step_3'}"]
    _assert_close(_losses(again, (3,)), _losses(inner, (3,)))


# -- the sharded Muon on the expert mesh numbered with edp_shard innermost

MUON_LAYOUTS = {  # name: (layout, experts of the toy model)
    "whole_experts": (ParallelConfig(dp_replicate=2, dp_shard=4, edp_shard=2, ep=4, expert_inner="edp_shard"), 8),
    "matrix_dim": (ParallelConfig(dp_shard=8, edp_shard=4, ep=2, expert_inner="edp_shard"), 6),  # 3 local < 4
}


def _muon_steps(rank, world_size):
    """tests/ranks/test_sharded_muon.py's toy (per-head dense blocks, per-expert blocks, an AdamW norm) sharded on
    build_meshes' meshes, as parallel/fsdp.py shards a Transformer, then STEPS ShardedMuon steps."""
    out = {}
    for name, (config, n_experts) in MUON_LAYOUTS.items():
        layout = config.resolve(world_size)
        meshes = build_meshes(layout, "cpu")
        model = sm.Toy(n_experts)
        model.load_state_dict({n: sm.toy_full(n, p.shape, "init") for n, p in model.named_parameters()})
        sm.ep_shard_experts(model, meshes.ep)
        matrix_dim = layout.expert_shard_dim(n_experts) == 1
        placement_fn = (lambda p: Shard(1)) if matrix_dim else None
        fully_shard(model.experts, mesh=meshes.expert_fsdp, shard_placement_fn=placement_fn)
        fully_shard(model, mesh=meshes.dense_fsdp)
        optimizer = ShardedMuon(model.named_parameters(), model.splits(), sm.CONFIG, bucket_mb=0.002)
        for step in range(sm.STEPS):
            sm.set_toy_grads(model, step)
            optimizer.step()
        shards = {n: (sm.box_of(p), p.to_local().clone()) for n, p in model.named_parameters()}
        out[name] = shards, model.experts.w1.device_mesh.mesh.tolist()
    return out


def test_sharded_muon_on_the_edp_shard_inner_expert_mesh_equals_the_reference():
    """The planner takes the experts' rank mesh from their DTensors: with edp_shard innermost the same
    blocks have other holders, and the update still equals ReferenceMuon on full tensors (fp32, 1e-5:
    tests/ranks/test_sharded_muon.py's tolerance, observed <= 1.4e-7)."""
    results = run_ranks(_muon_steps, 8)
    for name, (config, n_experts) in MUON_LAYOUTS.items():
        assert results[0][name][1] == rank_mesh(config.resolve(8), EXPERT_AXES).tolist()
        sm.assert_matches_reference([r[name][0] for r in results], sm.toy_reference(n_experts), name)


# -- launch/estimate_memory.py's per-rank boxes (no process group) against the real shards

BOX_LAYOUTS = [
    ParallelConfig(dp_shard=8, ep=2, edp_shard=4, expert_inner="edp_shard"),  # experts on a matrix dim
    ParallelConfig(dp_replicate=2, dp_shard=4, edp_replicate=2, edp_shard=2, ep=2, expert_inner="edp_shard"),
    ParallelConfig(dp_replicate=2, dp_shard=4, edp_replicate=2, edp_shard=2, ep=2),
]
BOX_MODEL = preset("debug", n_routed_experts=4)


def _real_boxes(rank, world_size):
    out = []
    for config in BOX_LAYOUTS:
        layout = config.resolve(world_size)
        model = Transformer(BOX_MODEL)
        parallelize(model, build_meshes(layout, "cpu"), layout)
        out.append({n: tuple(dtensor_box(p)) for n, p in model.named_parameters()})
    return out


def test_memory_estimate_boxes_follow_the_expert_numbering():
    """The estimate derives every rank's shard from the layout alone. With edp_shard innermost most ranks
    hold other expert rows than the ep-innermost numbering would give them (ranks 1-6 of the first layout)."""
    from planning.memory.pretrain import rank_boxes

    real = run_ranks(_real_boxes, 8)
    for i, config in enumerate(BOX_LAYOUTS):
        for rank in range(8):
            boxes = rank_boxes(BOX_MODEL, config.resolve(8), rank)
            estimated = {fqn: tuple((o, o + n) for o, n in zip(offset, shape)) for fqn, _, shape, offset, _ in boxes}
            assert estimated == real[rank][i], (config, rank)
