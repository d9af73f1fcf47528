"""Compiled blocks: `torch.compile(fullgraph=True)` on every transformer block's regions.

Regions (`compile_regions`): a block is compiled whole when no FSDP unit is nested inside it (dense
FFN blocks: one graph). A MoE block holds nested units (the routed experts on the expert mesh, and the
router in its fp32 policy when param_dtype is lower, parallel/fsdp.py `nested_units`); FSDP2's hooks
run eagerly by design (dynamo skips them), so a compiled region must not contain a unit's call. The
MoE block is therefore compiled as its largest unit-free modules, each one graph: attention_norm,
attention, ffn_norm, router, routed experts, shared experts (6 graphs). Selective checkpointing's
regions (attention, routed experts) are boundaries too: a dense block under it compiles as
attention_norm, attention, ffn_norm, feed_forward (4 graphs). The residual adds and the MoE
glue between them (sort by expert, gather, combine) stay eager. Under ep > 1 the routed experts'
call (count exchange, host sync for the split sizes, all-to-alls, grouped matmul on a
data-dependent number of received rows) is not compiled: only the direct EP path composes with
compile, and its experts run eagerly while everything else of the block is compiled.

Document masking (`block_path`): on the CUDA flex path the BlockMask is built once per micro-batch outside
the blocks and carried into them with the documents (models/document_attention.py), so the regions are the
same as without it. On the CPU block path each block's `attention` (projections, RoPE and the block path)
stays eager: the block path reads document ids on the host to pick each query block's key range
(data-dependent shapes: a new graph per document layout), and FlexAttention, whose shapes do not depend on
the documents, has no CPU backward in torch 2.13. The attention's projections are not compiled one by one
around it: every nn.Linear shares one code object, so each weight shape (and eval's no_grad) is a recompile
of it, past dynamo's recompile limit with fullgraph (measured: 2 ranks, debug preset).

Why this FSDP layout (the same units with and without compile): one unit per block (torchtitan
0.3) cannot hold the experts once they live on a different mesh than the dense weights (a unit has
one mesh), and it would move the router into the bf16 all-gather. Keeping the unit boundaries outside
the compiled regions leaves the FSDP units, their all-gathers and their memory exactly as without
compile, so `launch/estimate_memory.py` and `launch/dry_run_bytes.py` stay true unchanged.

Activation checkpointing: the non-reentrant checkpoint runs the compiled body (checkpoint outside,
compile inside: parallel/activation_checkpoint.py wraps the region's runner this file put in its slot).
Its context (routers' counts restored, QK-clip off in the recompute) is Python around the compiled call,
which dynamo cannot trace, and it must stay exact. The recompute runs the same compiled graph, except that
attention records no maxima there: a second graph for the attention regions, compiled in the first
step's backward and reused from then on.

Mechanism: each region is a `Region` (models/region.py); its `region` slot gets a `Compiled` runner that
calls the class's `body` through `torch.compile`, before checkpointing wraps the slot. No `forward` is
replaced and parameter names are unchanged. A graph break raises (fullgraph) with dynamo's message, which
names the op and the source line. What cannot be compiled yet is refused when the layout is validated
(the `training.compile` row of parallel/ep/refusals.py).
"""

import torch
from torch import nn

from models.experts import GroupedExperts
from models.region import Eager, Region
from parallel.activation_checkpoint import checkpoint_regions
from parallel.fsdp import nested_units

BACKENDS = ("inductor", "aot_eager")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"training.compile_backend={backend!r} must be one of {', '.join(BACKENDS)}")


def apply_compile(model: nn.Module, backend: str, boundaries: set[nn.Module] = frozenset(), ep: int = 1,
                  block_path: bool = False) -> None:
    """Compile every region of every block of `model.layers`, in place. `boundaries`: modules no compiled
    region may hold strictly inside (`region_boundaries`); `ep`: the expert-parallel degree (> 1: the
    routed experts stay eager); `block_path`: document masking on the CPU (each block's attention stays eager)."""
    check_backend(backend)
    eager = eager_modules(model, ep, block_path)
    for block in model.layers:
        for module in compile_regions(block, boundaries, eager):
            assert isinstance(module, Region) and isinstance(module.region, Eager), (type(module), module.region)
            module.region = Compiled(type(module).body, backend)


class Compiled:
    """A region's runner (models/region.py): the class's `body` as one torch.compile(fullgraph) graph.
    Dynamo keys its graphs on the code: the blocks of one class and shapes share theirs."""

    def __init__(self, body, backend: str):
        self.graph = torch.compile(body, fullgraph=True, backend=backend)

    def __call__(self, module: nn.Module, *args, **kwargs):
        return self.graph(module, *args, **kwargs)


def region_boundaries(model: nn.Module, param_dtype: torch.dtype, activation_checkpoint: str) -> set[nn.Module]:
    """The FSDP units nested in blocks (parallel/fsdp.py) and the regions activation checkpointing wraps:
    a compiled region may be one of them, never hold one inside (their hooks and contexts run eagerly)."""
    boundaries = {unit for block in model.layers for unit in nested_units(block, param_dtype)}
    if activation_checkpoint != "none":
        boundaries |= {m for block in model.layers for m in checkpoint_regions(block, activation_checkpoint)}
    return boundaries


def eager_modules(model: nn.Module, ep: int = 1, block_path: bool = False) -> set[nn.Module]:
    """Modules that run eagerly: under ep > 1 the routed experts; on the document block path each
    block's attention (module docstring)."""
    eager = {m for m in model.modules() if isinstance(m, GroupedExperts)} if ep > 1 else set()
    return eager | ({block.attention for block in model.layers} if block_path else set())


def compile_regions(block: nn.Module, boundaries: set[nn.Module],
                    eager: set[nn.Module] = frozenset()) -> list[nn.Module]:
    """The largest submodules of `block` (the block itself if it can) with no module of `boundaries`
    strictly below them and none of `eager` in them, in forward order."""
    if block in eager:
        return []
    if not any(m in boundaries or m in eager for m in list(block.modules())[1:]):
        return [block]
    return [region for child in block.children() for region in compile_regions(child, boundaries, eager)]
