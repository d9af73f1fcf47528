"""Activation checkpointing: chosen modules save only their inputs and rerun their forward in backward.

Modes (`training.activation_checkpoint`):
  none       nothing is recomputed.
  full       every TransformerBlock: each block saves its input only; in backward the whole block
             (norms, attention, router, expert dispatch, experts, combine, shared experts) reruns.
  selective  in every block, the attention (`block.attention`: projections, RoPE, SDPA, and under
             cp the K/V all-gather) and the routed experts (every GroupedExperts: under ep the
             dispatch all-to-all, grouped matmuls and combine all-to-all; the count exchange runs
             in the MoE layer before the experts' forward, so it is not repeated). Saved as
             usual: block inputs, norm outputs, router outputs and the sort order, the shared
             experts and dense FFNs. `launch/estimate_memory.py` measures what each mode keeps.

Mechanism: the module's `forward` is wrapped in `torch.utils.checkpoint` (non-reentrant), so the
module, its parameters and their FQNs are unchanged (optimizer state and checkpoints key on them).
FSDP2's hooks run around the module call, outside the wrapper: in backward its pre-backward hook
unshards the unit before the recompute reads the weights. Counted on 2 ranks (debug preset): full
and selective issue the same FSDP all-gathers as none (each unit, nested expert units included,
twice per micro-batch), so recomputing costs compute, not weight traffic.

Communication inside a recomputed region runs again in backward: the ep dispatch and combine
all-to-alls (under `full`, also the count exchange and its one host sync) and the cp K/V all-gather;
with `parallel.ep_recompute = "keep"` the EP ones do not (the forward keeps what they received,
parallel/ep/keep.py). Every rank recomputes the same regions in
the same (reverse layer) order, so the collectives match across ranks.

Router statistics: recomputing a router would add the micro-batch's top-k counts to
`tokens_per_expert` a second time; the recompute restores every router of the region afterwards (and
the drop counters of the EP dispatchers whose experts' call it reruns, parallel/ep/capacity.py).
QK-clip maxima (optim/qk_clip.py): the original forward recorded them; the recompute of the same
logits records nothing (it would cost one more Q K^T per layer for the same maxima).
"""

import contextlib

from torch import nn
from torch.utils.checkpoint import checkpoint

from models.attention import CausalAttention
from models.experts import GroupedExperts
from models.moe import MoE, Router
from parallel.ep import keep as ep_keep
from parallel.ep.dispatcher import Dispatcher
from parallel.overlap import forward_prefetch_paused

MODES = ("none", "full", "selective")


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    """Wrap the forwards of the regions `mode` names, in every block of `model.layers`; in place."""
    if mode not in MODES:
        raise ValueError(f"training.activation_checkpoint={mode!r} must be one of {', '.join(MODES)}")
    if mode == "none":
        return
    for block in model.layers:
        for module in checkpoint_regions(block, mode):
            _checkpoint_forward(module, block)


def checkpoint_regions(block: nn.Module, mode: str) -> list[nn.Module]:
    """The modules of `block` whose forward is recomputed under `mode` ("full" or "selective")."""
    if mode == "full":
        return [block]
    return [block.attention] + [m for m in block.modules() if isinstance(m, GroupedExperts)]


def _checkpoint_forward(module: nn.Module, block: nn.Module) -> None:
    inner = module.forward
    routers = [m for m in module.modules() if isinstance(m, Router)]
    recorders = [m for m in module.modules() if isinstance(m, CausalAttention)]  # under cp: the local sdpa
    inside = set(module.modules())
    # the EP dispatchers (parallel/ep/dispatcher.py) whose experts' call the region reruns
    dispatchers = [m.dispatcher for m in block.modules() if isinstance(m, MoE) and m.experts in inside
                   and isinstance(m.dispatcher, Dispatcher)]
    dropping = [d for d in dispatchers if d.config.capacity_factor > 0]  # parallel/ep/capacity.py
    keep = any(d.config.keep for d in dispatchers)  # parallel/ep/keep.py

    def context_fn():
        forward_context, replay = ep_keep.contexts(keep)
        return forward_context, _recompute(module, _as_recompute(routers, dropping, recorders, replay))

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = forward


@contextlib.contextmanager
def _recompute(module: nn.Module, restoring):
    """The recompute of `module`: `restoring` (`_as_recompute`) and no forward prefetch by the FSDP
    units inside `module` (backward is done with the units they would prefetch; parallel/overlap.py)."""
    with forward_prefetch_paused(module), restoring:
        yield


@contextlib.contextmanager
def _as_recompute(routers: list[Router], dropping: list[nn.Module], recorders: list[CausalAttention], replay):
    """Around a recompute: leave the routers' token counts (and EP drop counts) as the original forward
    left them (read when the recompute starts: the drop counters exist from the first forward on),
    record no QK-clip maxima (the original forward recorded the same logits), and inside `replay`
    (parallel/ep/keep.py: the EP exchanges read back from the forward, or nothing)."""
    counters = [r.tokens_per_expert for r in routers] + [d.drop_counts for d in dropping
                                                         if d.drop_counts is not None]
    saved = [counter.clone() for counter in counters]
    recording = [recorder.record_max_logits for recorder in recorders]
    for recorder in recorders:
        recorder.record_max_logits = False
    try:
        with replay:
            yield
    finally:
        for counter, value in zip(counters, saved):
            counter.copy_(value)
        for recorder, flag in zip(recorders, recording):
            recorder.record_max_logits = flag
