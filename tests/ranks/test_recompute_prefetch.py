"""Explicit FSDP prefetch (parallel/overlap.py) with full activation checkpointing: the recompute in
backward reruns the forward hooks of the FSDP units inside each block (its GroupedExperts); their
forward prefetch would all-gather the next unit in forward order (the next block, or norm + output),
whose backward is already done: gathered again for nothing and left unsharded. The recompute pauses
forward prefetch (`forward_prefetch_paused`). Counted per unit on 2 gloo ranks, debug preset, 2
micro-batches: each unit is gathered twice per micro-batch (forward, backward), as without
checkpointing (before the fix: the last block and norm + output 3 times); losses and gradients equal
the one-process reference in fp32 (1e-6 relative, as tests/ranks/test_activation_checkpoint.py). And the
dry run (W = 64, tests/entry/test_dry_run.py's step) with both knobs: its dense all-gather bytes equal the
projection's (benchmarks/step_projection.py: forward + backward per unit), which has no re-gather term.
"""

import collections
import json
from unittest import mock

from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from dry_run_cases import ARGS, STEP, _dry_run
from multirank import run_ranks
from parallel.gradients import global_loss, loss_fn
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.overlap import set_fsdp_prefetch
from parallel.parallelize import parallelize
from parity_cases import BATCH, SEQ, _assert_same, _local_batch, _model, _single

RUNS = (("none", 1), ("full", 1), ("full", 2))  # (training.activation_checkpoint, parallel.fsdp_prefetch)


def _gathers_with_prefetch(rank, world_size) -> dict:
    """2 ranks (dense and expert FSDP over both), 2 micro-batches: all-gathers per unit, per (mode, prefetch)."""
    out = {}
    for mode, depth in RUNS:
        model = _model("fsdp8")
        layout = ParallelConfig(dp_shard=2, ep=1).resolve(world_size, activation_checkpoint=mode)
        meshes = build_meshes(layout, "cpu")
        parallelize(model, meshes, layout)
        set_fsdp_prefetch(model, depth)
        inputs, labels, _ = _local_batch(model.config.vocab_size, layout, meshes)
        gathers, losses = collections.Counter(), []
        with mock.patch.object(FSDPParamGroup, "unshard", _counting_unshard(gathers)):
            for x, y in zip(inputs.chunk(2), labels.chunk(2)):
                loss = loss_fn(model(x), y, BATCH * SEQ)
                loss.backward()
                losses.append(global_loss(loss).item())
        out[mode, depth] = {"gathers": dict(gathers), "loss": sum(losses),
                     "grads": {k: p.grad.full_tensor() for k, p in model.named_parameters()}}
    return out


def _counting_unshard(gathers: collections.Counter):
    """FSDPParamGroup.unshard (private FSDP2, torch 2.13.0: the one call that issues a unit's all-gather),
    adding 1 to gathers[unit fqn] when it starts one (not when the unit is already gathered or pending)."""
    unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        pending = group._all_gather_result is not None or group.is_unsharded
        unshard(group, *args, **kwargs)
        gathers[group._module_fqn] += not pending and group._all_gather_result is not None

    return counted


def test_recompute_gathers_nothing_more_with_prefetch():
    """Full checkpointing + fsdp_prefetch 1 or 2: the recompute must not prefetch the next units in
    forward order (backward is done with them): each unit gathered twice per micro-batch, as without
    checkpointing; same loss and gradients as one process."""
    per_rank = run_ranks(_gathers_with_prefetch, 2, timeout=120)
    ref = _single("none")
    for rank, by_run in enumerate(per_rank):
        none = by_run["none", 1]["gathers"]
        assert len(none) == 7 and set(none.values()) == {4}, none  # 2 micro-batches x (forward + backward)
        for (mode, depth), got in by_run.items():
            assert got["gathers"] == none, f"rank {rank}: all-gathers per unit, {mode} + prefetch {depth}: {got['gathers']} != without checkpointing {none}"
            _assert_same(dict(got, counts=[]), ref, f"rank {rank}, {mode}, fsdp_prefetch={depth}")


def test_dry_run_dense_all_gather_equals_the_projection(tmp_path):
    """Before the fix: 10 dense all-gathers counted instead of 8, 1,013,796 bytes on the wire against 810,936."""
    out = tmp_path / "dry.json"
    argv = [*ARGS, *STEP, "--training.fsdp_prefetch=1", "--training.activation_checkpoint=full", "--ranks", "0",
            "--json", str(out)]
    run_ranks(_dry_run, 1, argv, timeout=300, as_torchrun=True)
    result = json.load(open(out))
    terms = {(c["source"], c["kind"], c["mesh"].split(" = ")[0]): c for c in result["projection_comparison"]}
    dense = terms["fsdp", "all_gather", "dense.dp_shard"]
    assert dense["counted"] == dense["projected"] and sum(dense["counted"]) > 0, dense
    assert all(c["equal"] for c in result["projection_comparison"]), result["projection_comparison"]
