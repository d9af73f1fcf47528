"""FSDP2 mixed precision (training.param_dtype / reduce_dtype) on the headline 8-rank layout
against a single-process model run in bf16 by hand.

Reference (the outside definition, no FSDP): a copy of the fp32 model with every parameter cast to
bf16 except the routers' gates (the policy keeps routers fp32), buffers fp32, then a plain forward
and backward. The 8-rank run uses the dense dp_shard=4 x cp=2 | ep=8 layout with
param_dtype=bfloat16, reduce_dtype=float32.

Tolerance: the yardstick is how far the bf16 reference is from the fp32 one (same weights, same
batch). The 8-rank bf16 run rounds the same fp32 values to bf16 in other places and orders (per-rank
partial weight gradients, cp attention over gathered keys, grouped matmuls over other token groups,
fp32 reduce-scatter sums), so it is a second, independent bf16 rounding of the same computation:
its distance to the bf16 reference is at most the sum of both distances to fp32, about 2x the
yardstick. Measured: loss 3.9e-4 apart against a 4.5e-4 yardstick. A wrong cast, a missed reduction
or a wrong scale is far outside that. The gradient norm's yardstick is the distance of the gradient
vectors, ||g_bf16 - g_fp32|| (0.054, norm 4.9), not the difference of their norms, which cancels
(3.7e-4 with the flash attention kernel, 7.9e-4 with the math one) and bounds nothing; the triangle
inequality gives | ||g_8|| - ||g_bf16|| | <= ||g_8 - g_fp32|| + ||g_bf16 - g_fp32|| (measured: 2.0e-3
apart). Per-parameter gradients are not compared: bf16 rounding
flips some tokens' top-k choice (the bf16 reference itself routes differently from fp32 in the
last layer), which moves single experts' gradients by 10-20% in either bf16 run; the global
gradient norm averages that out and is compared instead.
"""

import pytest
import torch

from models import Router
from multirank import run_ranks
from parallel.fsdp import mixed_precision_policy
from parallel.gradients import global_loss, loss_fn
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize
from parity_cases import BATCH, HEADLINE, SEQ, WORLD, _batch, _local_batch, _model
from torch.distributed.fsdp import MixedPrecisionPolicy


def _bf16_copy(model):
    model = model.to(torch.bfloat16)  # the caller's model is a fresh copy
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # gate weight and buffers back to fp32, like the router's own fp32 unit
    for name, buf in model.named_buffers():
        buf.data = buf.data.float()
    return model


def _step_single(bf16: bool) -> dict:
    model = _model("headline_cp2_ep8")
    if bf16:
        model = _bf16_copy(model)
    inputs, labels = _batch(model.config.vocab_size)
    loss = loss_fn(model(inputs), labels, BATCH * SEQ)
    loss.backward()
    return {"loss": loss.item(), "norm": _norm(p.grad.float() for p in model.parameters()),
            "grads": [p.grad.float() for p in model.parameters()]}


def _norm(tensors) -> float:
    return torch.stack([t.norm() for t in tensors]).norm().item()


def _step_headline(rank, world_size):
    model = _model("headline_cp2_ep8")
    layout = HEADLINE.resolve(world_size)
    meshes = build_meshes(layout, "cpu")
    parallelize(model, meshes, layout, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen = {}
    experts, router = model.layers[1].feed_forward.experts, model.layers[1].feed_forward.router
    experts.register_forward_pre_hook(lambda m, args: seen.update(expert_w=m.w13.dtype, expert_x=args[0].dtype))
    router.register_forward_pre_hook(lambda m, args: seen.update(router_w=m.gate.weight.dtype))
    inputs, labels, positions = _local_batch(model.config.vocab_size, layout, meshes)
    logits = model(inputs, positions_S=positions)
    seen["logits"] = logits.dtype
    loss = loss_fn(logits, labels, BATCH * SEQ)
    loss.backward()
    return {"loss": global_loss(loss).item(), "seen": seen,
            "shard_dtypes": {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()},
            "norm": _norm(p.grad.full_tensor() for p in model.parameters())}  # all-gathers: small model


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = _step_single(False), _step_single(True)
    finally:
        torch.set_num_threads(threads)
    return fp32, bf16, run_ranks(_step_headline, WORLD, timeout=300)


def test_bf16_headline_matches_single_process_bf16_within_the_bf16_yardstick(runs):
    fp32, bf16, per_rank = runs
    yardsticks = {"loss": abs(bf16["loss"] - fp32["loss"]),
                  "norm": _norm(a - b for a, b in zip(bf16["grads"], fp32["grads"]))}
    for key, yardstick in yardsticks.items():
        assert yardstick > 0  # bf16 really ran in the reference
        for rank, got in enumerate(per_rank):
            assert abs(got[key] - bf16[key]) <= 2 * yardstick, (key, rank, got[key], bf16[key], fp32[key])


def test_bf16_policy_casts_weights_not_master_state(runs):
    _, _, per_rank = runs
    for got in per_rank:
        assert got["seen"] == {"expert_w": torch.bfloat16, "expert_x": torch.bfloat16,
                               "router_w": torch.float32, "logits": torch.bfloat16}
        assert got["shard_dtypes"] == {torch.float32}  # sharded weights and reduced gradients stay fp32


def test_fp32_is_the_policy_free_path():
    """param_dtype = reduce_dtype = float32 sets FSDP's default policy (no cast anywhere), and routers
    get no unit of their own: the fp32 path is the one that ran before mixed precision existed."""
    assert mixed_precision_policy(torch.float32, torch.float32) == MixedPrecisionPolicy()
    policy = mixed_precision_policy(torch.bfloat16, torch.float32)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)  # not bf16 reductions
