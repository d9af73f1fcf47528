"""`parallelize`: apply context, expert and data parallelism to an unchanged Transformer.

Order matters: expert weights must be DTensors on `ep` before FSDP wraps them (FSDP then shards
them further over the expert mesh); the cp attention swap touches no parameters; each MoE layer gets
its EP dispatcher before activation checkpointing fills the regions' slots, so their communication is
recomputed too; compile fills a region's slot before checkpointing wraps it (models/region.py).
Parameter names are unchanged throughout, so optimizers and checkpoints key on the single-process FQNs.

The layout says everything applied here but the precisions: the degrees, the EP knobs
(`layout.ep_config`), activation checkpointing and compile, all checked once when it was validated
(`Layout.validate`, with the EP refusal table); nothing here refuses a setting again.
"""

import torch
from torch import nn

from models.document_attention import flex_path
from parallel.activation_checkpoint import apply_activation_checkpoint
from parallel.compile import apply_compile, region_boundaries
from parallel.context_parallel import apply_context_parallel
from parallel.ep.config import EPConfig
from parallel.ep.direct import check_fp8_device
from parallel.ep.dispatcher import apply_expert_parallel
from parallel.fsdp import apply_fsdp
from parallel.layout import Layout
from parallel.meshes import Meshes
from parallel.pp.plan import reshard_after_forward


def parallelize(model: nn.Module, meshes: Meshes, layout: Layout, *, param_dtype: torch.dtype = torch.float32,
                reduce_dtype: torch.dtype = torch.float32, document_mask: bool = False) -> nn.Module:
    """Shard `model` in place for `layout` and return it. Collective-free except FSDP's setup.
    `model`: a Transformer or one pipeline stage of it (parallel/pp/part.py), on this rank's stage meshes.
    `document_mask` (data.document_mask): off the flex path, each block's attention stays eager when compiled."""
    _check_fp8(layout.ep_config, meshes.ep.device_type)
    apply_context_parallel(model, meshes.cp)  # attention.kv_source, .sdpa: compact K/V all-gather over cp
    apply_expert_parallel(model, meshes.ep, layout.ep_config)  # experts: Shard(0) on ep; a dispatcher per MoE
    backend = layout.compile_backend_used(meshes.dense.device_type)
    if backend is not None:  # regions' slots: compiled, before checkpointing wraps them
        boundaries = region_boundaries(model, param_dtype, layout.activation_checkpoint)
        block_path = document_mask and not flex_path(meshes.dense.device_type)
        apply_compile(model, backend, boundaries, layout.ep, block_path)
    apply_activation_checkpoint(model, layout.activation_checkpoint)  # regions' slots: recomputed in backward
    apply_fsdp(model, meshes, layout, param_dtype=param_dtype, reduce_dtype=reduce_dtype,  # both meshes
               reshard_after_forward=reshard_after_forward(layout.pp_config))
    return model


def _check_fp8(ep: EPConfig, device_type: str) -> None:
    """The device can convert to float8 (a property of the machine, not of the settings: checked here)."""
    for key, on in (("ep_dispatch_dtype", ep.dispatch_fp8), ("ep_combine_grad_dtype", ep.combine_grad_fp8)):
        if on:
            check_fp8_device(device_type, key)
