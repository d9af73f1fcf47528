"""`parallelize`: apply context, expert and data parallelism to an unchanged Transformer.

Order matters: expert weights must be DTensors on `ep` before FSDP wraps them (FSDP then shards
them further over the expert mesh); the cp attention swap touches no parameters; each MoE layer gets
its EP dispatcher before activation checkpointing wraps the blocks, so their communication is recomputed
too. Parameter names are unchanged throughout, so optimizers and checkpoints key on the single-process FQNs.
"""

import torch
from torch import nn

from models.document_attention import flex_path
from parallel.activation_checkpoint import apply_activation_checkpoint
from parallel.compile import apply_compile, region_boundaries
from parallel.compile_refusal import check_compile
from parallel.context_parallel import apply_context_parallel
from parallel.ep.config import EPConfig
from parallel.ep.direct import check_fp8_device
from parallel.ep.dispatcher import apply_expert_parallel
from parallel.fsdp import apply_fsdp
from parallel.layout import Layout, check_recompute
from parallel.meshes import Meshes
from parallel.pp.plan import reshard_after_forward


def parallelize(model: nn.Module, meshes: Meshes, layout: Layout, *, param_dtype: torch.dtype = torch.float32,
                reduce_dtype: torch.dtype = torch.float32, activation_checkpoint: str = "none",
                compile_backend: str | None = None, document_mask: bool = False) -> nn.Module:
    """Shard `model` in place for `layout` and return it. Collective-free except FSDP's setup.
    `model`: a Transformer or one pipeline stage of it (parallel/pp/part.py), on this rank's stage meshes.
    `compile_backend` (None: eager): compile each block's regions with it (parallel/compile.py);
    `document_mask` (data.document_mask): off the flex path its attention stays eager there."""
    check_recompute(layout, activation_checkpoint)
    ep = EPConfig.from_layout(layout)
    _check_fp8(ep, meshes.ep.device_type)
    if compile_backend is not None:
        check_compile(layout)
    apply_context_parallel(model, meshes.cp)  # attention.kv_source, .sdpa: compact K/V all-gather over cp
    apply_expert_parallel(model, meshes.ep, ep)  # experts: Shard(0) on ep; a dispatcher per MoE
    if compile_backend is not None:  # before checkpointing, which wraps the compiled forwards
        boundaries = region_boundaries(model, param_dtype, activation_checkpoint)
        block_path = document_mask and not flex_path(meshes.dense.device_type)
        apply_compile(model, compile_backend, boundaries, layout.ep, block_path)
    apply_activation_checkpoint(model, activation_checkpoint)  # recompute in backward: none | full | selective
    apply_fsdp(model, meshes, layout, param_dtype=param_dtype, reduce_dtype=reduce_dtype,  # both meshes
               reshard_after_forward=reshard_after_forward(layout))
    return model


def _check_fp8(ep: EPConfig, device_type: str) -> None:
    for key, on in (("ep_dispatch_dtype", ep.dispatch_fp8), ("ep_combine_grad_dtype", ep.combine_grad_fp8)):
        if on:
            check_fp8_device(device_type, key)
