"""`parallelize`: apply context, expert and data parallelism to an unchanged Transformer.

Order matters: expert weights must be DTensors on `ep` before FSDP wraps them (FSDP then shards
them further over the expert mesh); the cp attention swap touches no parameters. Parameter
names are unchanged throughout, so optimizers and checkpoints key on the single-process FQNs.
"""

from torch import nn

from parallel.context_parallel import apply_context_parallel
from parallel.expert_parallel import apply_expert_parallel
from parallel.fsdp import apply_fsdp
from parallel.layout import Layout
from parallel.meshes import Meshes


def parallelize(model: nn.Module, meshes: Meshes, layout: Layout) -> nn.Module:
    """Shard `model` in place for `layout` and return it. Collective-free except FSDP's setup."""
    apply_context_parallel(model, meshes.cp)  # attention.sdpa: all-gather K/V over cp
    apply_expert_parallel(model, meshes.ep)  # experts: Shard(0) on ep, all-to-all dispatch/combine
    apply_fsdp(model, meshes, layout)  # experts on the expert mesh, the rest on the dense mesh
    return model
