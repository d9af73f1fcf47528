"""ShardedMuon on 8 gloo ranks against ReferenceMuon on full tensors, for every dense and expert
layout, awkward shapes, replica split on/off/mixed (per parameter), real FSDP2, DCP save/load, and
the bucket overlap.

All equivalence cases run inside ONE run_ranks call (forking 8 ranks costs ~1 s; each case then
costs a few collectives); ranks return their local shards and the parent compares them with the
reference it computes once per case on full tensors.
"""

import dataclasses
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from models.splits import PER_EXPERT, PER_EXPERT_GATED, WHOLE, per_head_cols, per_head_rows
from multirank import run_ranks
from models.boxes import local_box, placement_kind, strided_shard
from optim.muon_reference import ReferenceMuon
from optim.sharded.muon import ShardedMuon
from muon_cases import (CONFIG, STEPS, Toy, assert_matches_reference, box_of, ep_shard_experts, relative_error,
                        set_toy_grads, toy_full, toy_reference)

WORLD = 8
DENSE_AXES, EXPERT_AXES = ("dp_replicate", "dp_shard_cp"), ("edp_replicate", "edp_shard", "ep")
# Dense params: 6 heads of 8 rows (48 rows: no head boundary matches 4- or 8-way shards), 6 heads
# along cols (every head cut across all ranks), a whole [3, 16] (empty shards on most ranks), mixed
# shapes in one bucket; AdamW: a norm and an embedding with empty shards.
DENSE = {"wq": ((48, 16), per_head_rows(6)), "wo": ((16, 48), per_head_cols(6)), "gate": ((3, 16), WHOLE),
         "wkv": ((20, 12), per_head_rows(5)), "w_big": ((40, 24), WHOLE), "norm": ((16,), None),
         "embed": ((10, 16), None)}


def expert_params(n_experts, block=(12, 16)):
    """w1 [E, r, c], w2 [E, c, r] (default 12 x 16) and a fused w13 [E, 2r, c] cut into two blocks per
    expert (its w1 and w3): one shape group with w2 transposed."""
    r, c = block
    return {"w1": ((n_experts, r, c), PER_EXPERT), "w2": ((n_experts, c, r), PER_EXPERT),
            "w13": ((n_experts, 2 * r, c), PER_EXPERT_GATED)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple[int, ...]  # 2-D dense (dp_replicate, dp_shard*cp) or 3-D expert (edp_replicate, edp_shard, ep)
    n_experts: int = 0  # 0: a dense case
    expert_dim: int = 0  # tensor dim FSDP shards experts on over edp_shard
    replica_split: str = "off"
    bucket_mb: float = 1.0
    overlap: bool = True
    ns_dtype: str = "float32"
    split: frozenset | None = None  # a mixed plan: exactly these params split across replicas
    ns_method: str = "standard"
    expert_block: tuple[int, int] = (12, 16)
    prefer_holders: bool = True  # the optimizer's default; False: owners by load alone (other plans here)

    def config(self):
        return dataclasses.replace(CONFIG, ns_dtype=self.ns_dtype, ns_method=self.ns_method)

    def params(self):
        return expert_params(self.n_experts, self.expert_block) if self.n_experts else DENSE

    def placements(self):
        if not self.n_experts:
            return (Replicate(), Shard(0))
        if self.expert_dim == 1:
            return (Replicate(), Shard(1), Shard(0))
        return (Replicate(), strided_shard(0, self.mesh[2]), Shard(0))


CASES = [
    Case("dense dp_shard=8 (and dp_shard=4 x cp=2: the same 8-rank FSDP mesh)", (1, 8), bucket_mb=0.0004),
    Case("dense dp_shard=8, synchronous buckets", (1, 8), bucket_mb=0.0004, overlap=False),
    Case("dense dp_shard=8, owners by load alone", (1, 8), bucket_mb=0.0004, prefer_holders=False),
    Case("dense dp_replicate=2 x dp_shard=4 (and x dp_shard=2 x cp=2)", (2, 4)),
    Case("dense dp_replicate=2 x dp_shard=4, replica split", (2, 4), replica_split="on", bucket_mb=0.0004),
    # 4 replicas: each segment spreads over the chunks of other members before the all-gather
    Case("dense dp_replicate=4 x dp_shard=2, replica split", (4, 2), replica_split="on", bucket_mb=0.0004),
    Case("dense dp_replicate=4 x dp_shard=2, mixed split, Gram NS", (4, 2), ns_method="gram", bucket_mb=0.001,
         split=frozenset({"wq", "w_big"})),
    Case("expert ep=8", (1, 1, 8), n_experts=8),
    Case("expert edp_shard=2 x ep=4, 6 experts (an ep rank without experts)", (1, 2, 4), n_experts=6, bucket_mb=0.001),
    Case("expert edp_replicate=2 x edp_shard=2 x ep=2", (2, 2, 2), n_experts=6),
    Case("expert edp_replicate=2 x edp_shard=2 x ep=2, replica split", (2, 2, 2), n_experts=6, replica_split="on"),
    # mixed plans: split and non-split params share buckets and replica groups
    Case("dense dp_replicate=2 x dp_shard=4, mixed split", (2, 4), bucket_mb=0.0004,
         split=frozenset({"wq", "gate", "w_big"})),
    Case("expert edp_replicate=2 x edp_shard=2 x ep=2, mixed split", (2, 2, 2), n_experts=6, bucket_mb=0.0004,
         split=frozenset({"w1"})),
    Case("expert 2 local experts < edp_shard=4: Shard(1)", (1, 4, 2), n_experts=4, expert_dim=1),
    # w13 [4, 10, 16] in torch.chunk rows of 3: rank 1's rows [3, 6) hold the end of w1 and the start of w3
    Case("expert Shard(1), a shard across w13's w1/w3 boundary", (1, 4, 2), n_experts=4, expert_dim=1,
         expert_block=(5, 16)),
    Case("dense dp_replicate=2 x dp_shard=4, bf16 Newton-Schulz", (2, 4), ns_dtype="bfloat16"),
    Case("expert edp_shard=2 x ep=4, bf16 Newton-Schulz", (1, 2, 4), n_experts=6, ns_dtype="bfloat16"),
    # Gram NS (the reference runs the same method): gate 3 x 16 and wkv heads 4 x 12 take the Gram
    # path (aspect > 2), the others stay standard; 6 x 20 experts (aspect 3.3) are all Gram
    Case("dense dp_replicate=2 x dp_shard=4, Gram NS, replica split", (2, 4), replica_split="on", ns_method="gram"),
    Case("expert edp_shard=2 x ep=4, Gram NS", (1, 2, 4), n_experts=6, ns_method="gram", expert_block=(6, 20),
         bucket_mb=0.001),
    Case("expert edp_replicate=2 x edp_shard=2 x ep=2, Gram NS in bf16", (2, 2, 2), n_experts=6, ns_method="gram",
         expert_block=(6, 20), ns_dtype="bfloat16"),
]


def full_tensor(case, name, shape, salt):
    g = torch.Generator().manual_seed(zlib.crc32(repr((case.name, name, salt)).encode()))
    return torch.randn(shape, generator=g)


def shard(full, mesh, placements):
    """DTensor with `placements`: DTensor's own distribute_tensor for plain Shard placements; for
    _StridedShard (distribute_tensor does not support it) the torch.chunk box FSDP2 gives (checked
    against real fully_shard in test_real_fully_shard_layouts_and_equivalence)."""
    if all(placement_kind(p)[0] != "strided" for p in placements):
        return distribute_tensor(full, mesh, placements)
    box = local_box(full.shape, mesh.shape, placements, mesh.get_coordinate())
    local = full[tuple(slice(lo, hi) for lo, hi in box)].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _run_cases(rank, world, cases):
    meshes, out = {}, {}
    for case in cases:
        axes = EXPERT_AXES if case.n_experts else DENSE_AXES
        if case.mesh not in meshes:
            meshes[case.mesh] = init_device_mesh("cpu", case.mesh, mesh_dim_names=axes)
        mesh = meshes[case.mesh]
        full = {n: full_tensor(case, n, shape, "init") for n, (shape, _) in case.params().items()}
        params = {n: nn.Parameter(shard(t, mesh, case.placements())) for n, t in full.items()}
        for n, p in params.items():  # the box function agrees with what DTensor holds
            assert torch.equal(p.to_local(), full[n][tuple(slice(lo, hi) for lo, hi in box_of(p))]), n
        splits = {n: s for n, (_, s) in case.params().items() if s is not None}
        opt = ShardedMuon(params.items(), splits, case.config(), bucket_mb=case.bucket_mb,
                          replica_split=case.replica_split, overlap=case.overlap, record_events=True,
                          split_params=case.split or None, prefer_holders=case.prefer_holders)
        if case.split:
            assert opt.plan.replica_split == "mixed"
            assert {p.spec.name for p in opt.plan.params if p.split} == case.split
            assert any(b.gathers for b in opt._pipeline.buckets)
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = shard(full_tensor(case, n, p.shape, step), mesh, case.placements())
            opt.step()
        batches = [(sum(ix.own_batches), len(ix.batches)) for ix in opt._pipeline.index]
        out[case.name] = ({n: (box_of(p), p.to_local().clone()) for n, p in params.items()}, list(opt.events), batches)
    return out


def reference(case):
    full = {n: nn.Parameter(full_tensor(case, n, shape, "init")) for n, (shape, _) in case.params().items()}
    splits = {n: s for n, (_, s) in case.params().items() if s is not None}
    opt = ReferenceMuon(full.items(), splits, case.config())
    for step in range(STEPS):
        for n, p in full.items():
            p.grad = full_tensor(case, n, p.shape, step)
        opt.step()
    return {n: p.detach() for n, p in full.items()}


def tolerance(case, expected):
    """fp32: the sharded owners batch other sets of blocks than the reference and store tall blocks
    transposed, which only changes the matmul summation order: observed <= 1.4e-7 relative, so 1e-5.

    bf16: on CPUs with AMX-bf16 a bf16 batched matmul rounds the last bit differently with the batch
    size (exact with one block per call on both sides), so the sharded result equals the reference
    only to bf16 rounding. The yardstick is what bf16 rounding does to the same case: the reference's
    bf16-vs-fp32 difference (measured 1.44e-4 on 'expert edp_shard=2 x ep=4'; the sharded run differs
    by 0 without AMX and by 4.97e-5 = 0.35 of it with AMX). Two bf16 roundings of the same update,
    each about a yardstick from fp32, can lie up to twice that apart: the bound is 2 yardsticks. A
    wrong block is off by O(1)."""
    if case.ns_dtype == "float32":
        return 1e-5
    fp32 = reference(dataclasses.replace(case, ns_dtype="float32"))
    yardstick = max(relative_error(expected[n], fp32[n], fp32[n].abs().max()) for n in fp32).item()
    assert 1e-5 < yardstick < 1e-2, yardstick  # bf16 really rounded, and the update is still the same
    return 2 * yardstick


def test_equivalence_all_layouts_on_8_ranks():
    results = run_ranks(_run_cases, WORLD, CASES, timeout=300)
    for case in CASES:
        per_rank = [r[case.name][0] for r in results]
        expected = reference(case)
        assert_matches_reference(per_rank, expected, case.name, tolerance(case, expected))
        name = "w1" if case.n_experts else "wq"
        assert not torch.equal(expected[name], full_tensor(case, name, expected[name].shape, "init"))
    check_overlap([r[CASES[0].name][1] for r in results], overlap=True)
    check_overlap([r[CASES[1].name][1] for r in results], overlap=False)
    # both kinds of batch ran: of own copies only (orthogonalized before the pieces arrive) and not
    own, total = (sum(n[i] for r in results for c in r.values() for n in c[2]) for i in (0, 1))
    assert 0 < own < total, (own, total)


def check_overlap(events_per_rank, overlap):
    """Event order of the last step: with overlap, bucket k+1's all-to-all is issued before bucket k's
    NS ends, and bucket k's return is waited (then applied) only after bucket k+1's NS."""
    for events in events_per_rank:
        at = {e: i for i, e in enumerate(events)}
        K = 1 + max(k for _, k in events)
        assert K >= 3  # the tiny buckets really make several
        for k in range(K - 1):
            if overlap:
                assert at[("launch", k + 1)] < at[("ns_end", k)]
                assert at[("ns_end", k + 1)] < at[("applied", k)]
            else:
                assert at[("applied", k)] < at[("launch", k + 1)]


# ---------------------------------------------------------------- real FSDP2


def _fsdp_toy(rank, world, expert_mesh_shape, n_experts):
    dense = init_device_mesh("cpu", (2, 4), mesh_dim_names=DENSE_AXES)
    expert = init_device_mesh("cpu", expert_mesh_shape, mesh_dim_names=EXPERT_AXES)
    model = Toy(n_experts)
    full = {n: toy_full(n, p.shape, "init") for n, p in model.named_parameters()}
    model.load_state_dict(full)
    ep_shard_experts(model, expert["ep"])
    fully_shard(model.experts, mesh=expert["edp_replicate", "edp_shard"])
    fully_shard(model, mesh=dense)
    return model, full


def _real_fsdp(rank, world, expert_mesh_shape, n_experts, replica_split):
    model, full = _fsdp_toy(rank, world, expert_mesh_shape, n_experts)
    layouts = {}
    for n, p in model.named_parameters():  # our boxes are the shards FSDP2 really holds
        box = box_of(p)
        assert torch.equal(p.to_local(), full[n][tuple(slice(lo, hi) for lo, hi in box)]), (n, box)
        layouts[n] = tuple(p.placements)
    opt = ShardedMuon(model.named_parameters(), model.splits(), CONFIG, bucket_mb=0.002, replica_split=replica_split)
    for step in range(STEPS):
        set_toy_grads(model, step)
        opt.step()
    return {n: (box_of(p), p.to_local().clone()) for n, p in model.named_parameters()}, layouts


@pytest.mark.parametrize("mesh_shape, n_experts, replica_split", [((2, 2, 2), 6, "on"), ((1, 4, 2), 6, "auto")])
def test_real_fully_shard_layouts_and_equivalence(mesh_shape, n_experts, replica_split):
    """Dense params on the (2, 4) HSDP mesh and experts on the expert mesh, in ONE optimizer."""
    results = run_ranks(_real_fsdp, WORLD, mesh_shape, n_experts, replica_split)
    assert "_StridedShard" in str(results[0][1]["experts.w1"])  # FSDP2's ep-then-edp_shard mark
    assert results[0][1]["wq.weight"] == (Replicate(), Shard(0))
    assert_matches_reference([r[0] for r in results], toy_reference(n_experts), f"fully_shard {mesh_shape}")


# ---------------------------------------------------------------- checkpoint


def _checkpoint_resume(rank, world, path):
    """2 steps, DCP save, a 3rd step; then a fresh model and optimizer load the checkpoint and take
    the same 3rd step: the shards must be identical."""
    model, _ = _fsdp_toy(rank, world, (1, 2, 4), 6)
    opt = ShardedMuon(model.named_parameters(), model.splits(), CONFIG, bucket_mb=0.002, replica_split="on")
    for step in range(2):
        set_toy_grads(model, step)  # step 1: the experts get no grad, their momentum must still be saved
        opt.step()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_toy_grads(model, 2)
    opt.step()
    fresh, _ = _fsdp_toy(rank, world, (1, 2, 4), 6)
    fresh_opt = ShardedMuon(fresh.named_parameters(), fresh.splits(), CONFIG, bucket_mb=0.002, replica_split="on")
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    set_toy_grads(fresh, 2)
    fresh_opt.step()
    resumed = dict(fresh.named_parameters())
    assert len(fresh_opt.state) == len(resumed)  # momentum for the Muon params, AdamW state for norm
    return all(torch.equal(p.to_local(), resumed[n].to_local()) for n, p in model.named_parameters())


def test_dcp_save_load_resumes_identically(tmp_path):
    assert run_ranks(_checkpoint_resume, WORLD, str(tmp_path / "ckpt")) == [True] * WORLD


def test_ops_per_step_do_not_grow_with_pieces():
    # one process, plain tensors: every block is a piece held and owned here. Per-head rows of a
    # [512, 128] parameter: 64 heads of [8, 128] or 8 heads of [64, 128]; the step issues the same ops
    # (per parameter, shape group and bucket), where a per-piece schedule would issue 8x more.
    from benchmarks.lib.counters import count_step

    ops = {}
    for heads in (8, 64):
        p = nn.Parameter(torch.randn(512, 128))
        opt = ShardedMuon([("w", p)], {"w": per_head_rows(heads)}, CONFIG)
        p.grad = torch.randn(512, 128)
        opt.step()
        with count_step() as counts:
            opt.step()
        ops[heads] = counts.ops
    assert ops[8] == ops[64], ops


def test_box_runs_are_the_boxes_elements_in_order():
    # the index maps' building block against numpy's own indexing of an arange
    import numpy as np

    from optim.sharded.index import _local_runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        shape = tuple(int(n) for n in rng.integers(1, 6, size=rng.integers(1, 4)))
        box = tuple(slice(int(lo), int(rng.integers(lo + 1, n + 1))) for n in shape
                    for lo in [rng.integers(0, n)])
        starts, length = _local_runs(shape, box)
        got = (starts[:, None] + np.arange(length)[None, :]).ravel()
        assert np.array_equal(got, np.arange(int(np.prod(shape))).reshape(shape)[box].ravel()), (shape, box)
