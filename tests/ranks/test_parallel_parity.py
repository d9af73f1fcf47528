"""One training step on 8 gloo ranks equals the single-process step, for every layout in CASES.

The reference (one process, fp32, whole global batch) runs in the pytest process. One forked
8-rank world then runs every case in turn (forking once keeps the file fast) and compares its
local shards against the reference sliced by the same DTensor placements (`distribute_tensor`
of the reference, no communication): gradients before clipping and parameters after one
torch.optim.AdamW step. The parent asserts on the per-case errors.

Tolerances: both sides compute the same fp32 math in a different reduction order (batch split
across ranks, gradients summed by reduce-scatter/all-reduce, attention over all-gathered keys), so
they differ by a few fp32 ulps of the summed values: observed <= 1e-6 relative to each gradient's
largest entry (<= 1e-7 absolute), and <= 5e-7 relative on the loss and the norm. We allow 2e-5 and
1e-5: far below any real bug (a wrong scale is a factor >= 2, a missing or misrouted token changes
gradients by > 1e-3 relative). Parameters: AdamW's first step moves each entry by
lr * c*g / (|c*g| + eps) (c = clip factor < 1), so a gradient error dg moves it by at most
lr * dg / eps = 1e-2 * 1e-7 / 1e-3 = 1e-6 (eps=1e-3 keeps this bound tight; with eps=1e-8 the
step is ~lr*sign(g) and amplifies ulp noise of tiny gradients), on top of the ~1e-7 ulp of
weights near 1 (norm scales).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multirank import run_ranks
from parallel.gradients import clip_grad_norm_, global_loss, loss_fn
from parallel.layout import DENSE_AXES, EXPERT_AXES
from parallel.meshes import build_meshes, rank_mesh
from parallel.parallelize import parallelize

from parity_cases import BATCH, CASES, SEQ, WORLD, _batch, _local_batch, _model, _shard_like

LR, EPS, MAX_NORM = 1e-2, 1e-3, 1.0  # MAX_NORM < the gradient norm (~8): clipping is active
GRAD_RTOL, PARAM_ATOL, NORM_RTOL = 2e-5, 1e-6, 1e-5


def _reference(name: str) -> dict:
    model = _model(name)
    inputs, labels = _batch(model.config.vocab_size)
    loss = loss_fn(model(inputs), labels, BATCH * SEQ)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False).step()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"loss": loss.item(), "norm": norm.item(), "grads": grads, "params": params,
            "state_keys": list(model.state_dict())}


def _max_errors(named, reference, attr):
    """{fqn: (max |local - reference shard|, max |reference|)} for p.<attr> (grad or the param)."""
    out = {}
    for fqn, p in named:
        mine = getattr(p, attr) if attr else p
        expected = _shard_like(reference[fqn], mine)
        out[fqn] = (_max_abs(mine.to_local() - expected), _max_abs(reference[fqn]))
    return out


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0  # a rank's shard may be empty (e.g. 4 rows on 8 ranks)


def _adamw_on_shards(model: nn.Module) -> None:
    """torch.optim.AdamW on the local shards (elementwise, so equal to stepping the whole tensors;
    avoids seconds of DTensor dispatch per step on 8 ranks sharing 2 cores)."""
    shards = []
    with torch.no_grad():
        for p in model.parameters():
            shard = p.to_local()  # shares storage with the DTensor parameter
            shard.grad = p.grad.to_local()
            shards.append(shard)
    torch.optim.AdamW(shards, lr=LR, eps=EPS, foreach=False).step()


def _groups(meshes) -> dict:
    meshes_by_axis = {a: meshes.dense[a] for a in DENSE_AXES} | {a: meshes.expert[a] for a in EXPERT_AXES}
    out = {a: dist.get_process_group_ranks(m.get_group()) for a, m in meshes_by_axis.items()}
    out["dp_shard_cp"] = dist.get_process_group_ranks(meshes.dense_fsdp.get_group("dp_shard_cp"))
    return out


def _run_case(name, reference):
    _, _, config, _ = CASES[name]
    model = _model(name)
    layout = config.resolve(dist.get_world_size())
    layout.validate(model.config, SEQ, BATCH)
    meshes = build_meshes(layout, "cpu")
    parallelize(model, meshes, layout)
    inputs, labels, positions = _local_batch(model.config.vocab_size, layout, meshes)
    loss = loss_fn(model(inputs, positions_S=positions), labels, BATCH * SEQ)
    loss.backward()
    named = list(model.named_parameters())
    result = {
        "loss": global_loss(loss).item(),
        "state_keys": list(model.state_dict()),
        "no_grad": [k for k, p in named if p.grad is None],
        "tokens_per_expert": sum(r.tokens_per_expert for r in model.routers()),
        "placements": {k: (p.device_mesh.mesh_dim_names, p.placements) for k, p in named},
        "mesh_ranks": {k: p.device_mesh.mesh.tolist() for k, p in named},
        "groups": _groups(meshes),
    }
    if result["no_grad"]:
        return result
    result["grad_err"] = _max_errors(named, reference["grads"], "grad")
    result["norm"] = clip_grad_norm_(model.parameters(), MAX_NORM).item()
    _adamw_on_shards(model)
    result["param_err"] = _max_errors(named, reference["params"], None)
    return result


def _run_all(rank, world_size, references):
    return {name: _run_case(name, references[name]) for name in CASES}


def _references() -> dict:
    """The single-process step of each case, computed once per distinct model (one thread: on 2
    busy cores torch's default 2 threads make this ~10x slower)."""
    threads, by_model, out = torch.get_num_threads(), {}, {}
    torch.set_num_threads(1)
    try:
        for name, (preset_name, overrides, _, skew) in CASES.items():
            key = (preset_name, tuple(sorted(overrides.items())), skew)
            if key not in by_model:
                by_model[key] = _reference(name)
            out[name] = by_model[key]
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def results():
    references = _references()
    per_rank = run_ranks(_run_all, WORLD, references, timeout=300)
    return references, per_rank


@pytest.mark.parametrize("name", list(CASES))
def test_step_matches_single_process(results, name):
    references, per_rank = results
    ref = references[name]
    for rank, by_case in enumerate(per_rank):
        got = by_case[name]
        assert got["state_keys"] == ref["state_keys"], "parameter and buffer names must not change"
        assert got["no_grad"] == [], f"rank {rank}: parameters without a gradient: {got['no_grad']}"
        assert got["loss"] == pytest.approx(ref["loss"], rel=NORM_RTOL), f"rank {rank} loss"
        assert got["norm"] == pytest.approx(ref["norm"], rel=NORM_RTOL), f"rank {rank} grad norm"
        for fqn, (err, scale) in got["grad_err"].items():
            assert err <= GRAD_RTOL * scale, f"rank {rank} grad {fqn}: max error {err:.3g}, max |grad| {scale:.3g}"
        for fqn, (err, _) in got["param_err"].items():
            assert err <= PARAM_ATOL, f"rank {rank} param {fqn} after AdamW: max error {err:.3g}"


def test_expert_and_dense_placements(results):
    _, per_rank = results
    place = per_rank[0]
    w13, wo = "layers.1.feed_forward.experts.w13", "layers.1.attention.wo.weight"
    for name in CASES:
        mesh, placements = place[name]["placements"][wo]
        assert (mesh, [str(p) for p in placements]) == (("dp_replicate", "dp_shard_cp"), ["R", "S(0)"])
        mesh, placements = place[name]["placements"][w13]
        assert mesh == ("edp_replicate", "edp_shard", "ep")
        assert str(placements[0]) == "R" and str(placements[2]) == "S(0)"  # replicate, then experts over ep
    assert repr(place["few_local_experts"]["placements"][w13][1][1]) == "Shard(dim=1)"
    assert repr(place["fsdp8"]["placements"][w13][1][1]) == "Shard(dim=0)"
    # ep=2 splits the experts first, then edp_shard splits each ep rank's experts: whole experts per rank
    assert repr(place["fsdp8_ehsdp_ep2"]["placements"][w13][1][1]) == "_StridedShard(dim=0, sf=2)"


def test_expert_weights_live_on_the_numbered_expert_mesh(results):
    """The expert DTensors' rank tensor is the layout's documented numbering (parallel/meshes.py), for
    both values of parallel.expert_inner; the dense weights' mesh does not depend on it."""
    _, per_rank = results
    w13, wo = "layers.1.feed_forward.experts.w13", "layers.1.attention.wo.weight"
    for name, (_, _, config, _) in CASES.items():
        layout = config.resolve(WORLD)
        got = per_rank[0][name]["mesh_ranks"]
        assert got[w13] == rank_mesh(layout, EXPERT_AXES).tolist(), name
        assert got[wo] == torch.arange(WORLD).reshape(layout.dp_replicate, layout.dense_shard).tolist(), name
    assert per_rank[0]["hsdp_cp2_ep4_edp_shard_inner"]["groups"]["edp_shard"] == [0, 1]
    assert per_rank[0]["hsdp_cp2_ep4_edp_shard_inner"]["groups"]["ep"] == [0, 2, 4, 6]


def test_unrouted_experts_still_get_gradients(results):
    """The skewed case really leaves experts 2..7 without tokens on every rank (and its step
    test above passed: their zero gradients were reduced like any other)."""
    _, per_rank = results
    for by_case in per_rank:
        counts = by_case["empty_experts_cp2_ep8"]["tokens_per_expert"]
        assert counts[:2].sum() > 0 and counts[2:].sum() == 0


def test_ep_and_cp_overlap_on_the_same_ranks(results):
    """Headline layout: each ep all-to-all group contains both cp halves of a sequence, so cp=2 and
    ep=8 share 8 ranks instead of needing 16."""
    _, per_rank = results
    for rank, by_case in enumerate(per_rank):
        groups = by_case["headline_cp2_ep8"]["groups"]
        assert len(groups["cp"]) == 2 and rank in groups["cp"]
        assert groups["ep"] == list(range(8))
        assert set(groups["cp"]) <= set(groups["ep"])


def test_dense_fsdp_groups_narrower_than_expert_sharding(results):
    """HSDP layout dp_replicate=2 x dp_shard=4 | edp_shard=8: dense weights are sharded within 4
    ranks (a node) and replicated across 2, expert weights are sharded over all 8."""
    _, per_rank = results
    for rank, by_case in enumerate(per_rank):
        groups = by_case["hsdp2x4"]["groups"]
        assert groups["dp_shard_cp"] == [r for r in range(8) if r // 4 == rank // 4]
        assert groups["dp_replicate"] == [rank % 4, rank % 4 + 4]
        assert groups["edp_shard"] == list(range(8))
        assert set(groups["dp_shard_cp"]) < set(groups["edp_shard"])
