"""FSDP overlap that does not depend on the host running ahead: explicit prefetch and deferred
gradient reduction, on both meshes.

Prefetch (`set_fsdp_prefetch`). FSDP2 issues a unit's all-gather in that unit's pre-forward hook
(implicit prefetch: it overlaps only if the host is ahead of the device, which any host sync
undoes). With explicit prefetch, each unit's pre-forward also issues the all-gathers of the next
`depth` units in forward order, and each unit's pre-backward those of the previous `depth` units
in backward order. The forward order of the units (parallel/fsdp.py) interleaves the two meshes:
    embedding, block 0 (dense mesh), block 0's experts (expert mesh), block 1, ..., norm + output
so a block's dense all-gather also starts its experts' (the largest) all-gather, which then runs
while the block's attention computes. Communication: unchanged bytes, earlier issue; memory: up
to `depth` more units unsharded at a time. During an activation-checkpoint recompute in backward
(parallel/activation_checkpoint.py), the units nested in the recomputed region run their forward
hooks again; `forward_prefetch_paused` clears their forward prefetch there, since the next unit in
forward order has already run its backward (a prefetch would gather it again for nothing and leave
it unsharded).

Deferred reduction (`set_gradient_sync`, per micro-batch). With gradient accumulation over M
micro-batches:
  "every"          reduce-scatter (and HSDP all-reduce) after every micro-batch: least memory
  "replicas_last"  reduce-scatter every micro-batch, the HSDP all-reduce over the replicate axes
                   (dp_replicate, edp_replicate: across nodes) only after the last: the replicate
                   traffic drops M-fold at no memory cost (sharded gradients accumulate)
  "last"           no reduction until the last micro-batch: unsharded fp32 gradients of every
                   unit accumulate locally (memory of the whole unsharded model's gradients per
                   rank), then one reduce-scatter and all-reduce: all gradient traffic drops M-fold
Sums are sums, so every mode gives the same gradients up to fp32 summation order.
"""

import contextlib
import weakref

from torch import nn
from torch.distributed.fsdp import FSDPModule

GRAD_SYNC_MODES = ("every", "replicas_last", "last")

# unit -> weak references to the units it prefetches in forward (weak both ways: no model kept alive)
_FORWARD_PREFETCH: "weakref.WeakKeyDictionary[FSDPModule, list[weakref.ref]]" = weakref.WeakKeyDictionary()


def fsdp_units_in_forward_order(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units of a parallelized Transformer (or pipeline stage), in the order their forwards run."""
    from models.experts import GroupedExperts

    units = [model.tok_embeddings] if model.tok_embeddings is not None else []  # a pipeline stage may lack it
    for block in model.layers:
        units.append(block)
        units.extend(m for m in block.modules() if isinstance(m, GroupedExperts))
    if model.norm is not None:
        units.append(model.norm)  # the [norm, output] group's state is reached through either module
    assert all(isinstance(u, FSDPModule) for u in units), [type(u).__name__ for u in units]
    return units


def set_fsdp_prefetch(model: nn.Module, depth: int) -> None:
    """Explicit forward and backward prefetch of the next `depth` units (0: FSDP2's implicit)."""
    if depth <= 0:
        return
    units = fsdp_units_in_forward_order(model)
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        _FORWARD_PREFETCH[unit] = [weakref.ref(u) for u in units[i + 1:i + 1 + depth]]
        unit.set_modules_to_backward_prefetch(units[max(0, i - depth):i][::-1])


@contextlib.contextmanager
def forward_prefetch_paused(region: nn.Module):
    """Around a recompute in backward: the FSDP units inside `region` (not `region` itself, whose hooks
    do not rerun) prefetch nothing in forward; their lists from `set_fsdp_prefetch` come back after."""
    units = [m for m in region.modules() if m is not region and m in _FORWARD_PREFETCH]
    for unit in units:
        unit.set_modules_to_forward_prefetch([])
    try:
        yield
    finally:
        for unit in units:
            unit.set_modules_to_forward_prefetch([ref() for ref in _FORWARD_PREFETCH[unit]])


def set_gradient_sync(model: nn.Module, mode: str, last_micro_batch: bool) -> None:
    """Before each micro-batch's backward: which gradient collectives run after it (module docstring)."""
    if mode not in GRAD_SYNC_MODES:
        raise ValueError(f"training.grad_sync={mode!r}: expected one of {GRAD_SYNC_MODES}")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(mode != "last" or last_micro_batch, recurse=False)
            module.set_requires_all_reduce(mode == "every" or last_micro_batch, recurse=False)
