"""Shared fixtures of the parallel-parity tests: the layouts (CASES), the model of each, the global batch
and each rank's share of it. tests/ranks/test_parallel_parity.py runs CASES on 8 gloo ranks against one process;
tests/ranks/test_mixed_precision.py, test_activation_checkpoint.py, test_recompute_prefetch.py and
test_seeded_init.py reuse the model, the batch and the slicing; `_single` and `_assert_same` are the
activation-checkpointing tests' one-process step and their comparison (1e-6 relative: observed bitwise).
"""

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from benchmarks.lib.memory_peak import track_peak
from models import Transformer, preset
from parallel.activation_checkpoint import apply_activation_checkpoint
from parallel.context_parallel import load_balanced_positions
from parallel.gradients import loss_fn
from parallel.layout import ParallelConfig
from seeded_models import seeded_model

WORLD, BATCH, SEQ = 8, 8, 32
AC_RTOL = 1e-6  # activation checkpointing reruns the same ops: observed bitwise
HEADLINE = ParallelConfig(dp_shard=4, cp=2, ep=8, edp_shard=1)  # CP=2 and EP=8 on 8 ranks


CASES = {  # name: (model preset, overrides, layout, force routing to experts 0 and 1)
    "fsdp8": ("debug", {}, ParallelConfig(dp_shard=8, ep=1), False),
    "hsdp2x4": ("debug", {}, ParallelConfig(dp_replicate=2, dp_shard=4, ep=1), False),
    "headline_cp2_ep8": ("debug", {}, HEADLINE, False),
    "hsdp_cp2_ep4_gqa": (
        "debug_gqa", {}, ParallelConfig(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4), False,
    ),
    "fsdp8_ehsdp_ep2": ("debug", {}, ParallelConfig(dp_shard=8, edp_replicate=2, edp_shard=2, ep=2), False),
    # 4 experts / ep=2 = 2 local experts < edp_shard=4: experts sharded on a matrix dim (Shard(1)).
    "few_local_experts": ("debug", {"n_routed_experts": 4}, ParallelConfig(dp_shard=8, ep=2, edp_shard=4), False),
    # expert FSDP on consecutive ranks, ep strided (parallel.expert_inner="edp_shard"): whole experts, then a matrix dim
    "hsdp_cp2_ep4_edp_shard_inner": (
        "debug", {},
        ParallelConfig(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4, expert_inner="edp_shard"), False,
    ),
    "fsdp8_ehsdp_ep2_edp_shard_inner": (
        "debug", {}, ParallelConfig(dp_shard=8, edp_replicate=2, edp_shard=2, ep=2, expert_inner="edp_shard"),
        False,
    ),
    "few_local_experts_edp_shard_inner": (
        "debug", {"n_routed_experts": 4}, ParallelConfig(dp_shard=8, ep=2, edp_shard=4, expert_inner="edp_shard"),
        False,
    ),
    # every token goes to experts 0 and 1: six experts and six of eight ep ranks get no tokens.
    "empty_experts_cp2_ep8": ("debug", {}, ParallelConfig(dp_shard=4, cp=2, ep=8, edp_shard=1), True),
}


def _model(name: str) -> Transformer:
    preset_name, overrides, _, skew = CASES[name]
    model = seeded_model(preset_name, init="default", **overrides)
    if skew:
        for router in model.routers():
            router.expert_bias[:2] = 10.0  # sigmoid scores are < 1: experts 0 and 1 always win top-2
    return model


def _batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _local_batch(vocab_size, layout, meshes):
    inputs, labels = _batch(vocab_size)
    rows = slice(meshes.dp_rank() * (BATCH // layout.dp), (meshes.dp_rank() + 1) * (BATCH // layout.dp))
    positions = load_balanced_positions(SEQ, layout.cp, meshes.cp_rank())
    return inputs[rows][:, positions], labels[rows][:, positions], positions


def _shard_like(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of `full` under `like`'s mesh and placements (no communication)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _single(mode: str, model_preset="debug", batch=BATCH, seq=SEQ) -> dict:
    torch.manual_seed(0)
    model = Transformer(preset(model_preset))
    model.init_weights()
    apply_activation_checkpoint(model, mode)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    with track_peak(model) as peak:
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], batch * seq)
        loss.backward()
    return {"loss": loss.item(), "grads": {k: p.grad for k, p in model.named_parameters()},
            "counts": [r.tokens_per_expert.clone() for r in model.routers()], "peak": peak()["Total"]}


def _assert_same(got: dict, ref: dict, where: str):
    assert got["loss"] == pytest.approx(ref["loss"], rel=AC_RTOL), where
    for a, b in zip(got["counts"], ref["counts"]):
        assert torch.equal(a, b), f"{where}: router counts {a} != {b} (a recompute counted twice?)"
    for fqn, grad in got["grads"].items():
        scale = ref["grads"][fqn].abs().max() if grad.numel() else 0
        assert (grad - ref["grads"][fqn]).abs().max() <= AC_RTOL * scale if grad.numel() else True, f"{where}: {fqn}"
