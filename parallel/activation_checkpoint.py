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

Mechanism: each region is a `Region` (models/region.py); its `region` slot gets a `Recompute` runner
that calls the runner it held before (eager, or compiled by parallel/compile.py) under
`torch.utils.checkpoint` (non-reentrant), so the module, its parameters and their FQNs are unchanged
(optimizer state and checkpoints key on them) and no `forward` is replaced. FSDP2's hooks run around the
module call, outside the runner: in backward its pre-backward hook unshards the unit before the recompute
reads the weights. Counted on 2 ranks (debug preset): full and selective issue the same FSDP all-gathers
as none (each unit, nested expert units included, twice per micro-batch), so recomputing costs compute,
not weight traffic.

The recompute's context can be entered again: torch's checkpoint recomputes a region once per backward
pass that reads its saved tensors, so a backward split in two (`autograd.grad` for the inputs, then
again for the weights, as zero-bubble pipeline schedules do) recomputes twice, each time restoring the
counters and replaying the same EP tape from its start (tests/ranks/test_activation_checkpoint.py).

Communication inside a recomputed region runs again in backward: the ep dispatch and combine
all-to-alls (under `full`, also the count exchange and its one host sync) and the cp K/V all-gather;
with `parallel.ep_recompute = "keep"` the EP ones do not: the runner hands each call's tape to the
dispatchers whose experts' call the region reruns, which keep what their exchanges received in the
forward and read it back in the recompute (parallel/ep/keep.py). Every rank recomputes the same regions
in the same (reverse layer) order, so the collectives match across ranks.

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
from models.region import Region
from parallel.ep import keep as ep_keep
from parallel.ep.dispatcher import Dispatcher
from parallel.overlap import forward_prefetch_paused

MODES = ("none", "full", "selective")


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    """Wrap the runners of the regions `mode` names, in every block of `model.layers`; in place."""
    if mode not in MODES:
        raise ValueError(f"training.activation_checkpoint={mode!r} must be one of {', '.join(MODES)}")
    if mode == "none":
        return
    for block in model.layers:
        for module in checkpoint_regions(block, mode):
            assert isinstance(module, Region) and not isinstance(module.region, Recompute), type(module)
            module.region = Recompute(module.region, module, block)


def checkpoint_regions(block: nn.Module, mode: str) -> list[nn.Module]:
    """The modules of `block` whose body is recomputed under `mode` ("full" or "selective")."""
    if mode == "full":
        return [block]
    return [block.attention] + [m for m in block.modules() if isinstance(m, GroupedExperts)]


class Recompute:
    """A region's runner (models/region.py): `inner` (the runner the slot held) under non-reentrant
    checkpointing, with the recompute's context (`_as_recompute`) around each recompute."""

    def __init__(self, inner, module: nn.Module, block: nn.Module):
        self.inner, self.module = inner, module
        self.routers = [m for m in module.modules() if isinstance(m, Router)]
        self.recorders = [m for m in module.modules() if isinstance(m, CausalAttention)]  # under cp: the local sdpa
        inside = set(module.modules())
        # the EP dispatchers (parallel/ep/dispatcher.py) whose experts' call the region reruns
        dispatchers = [m.dispatcher for m in block.modules() if isinstance(m, MoE) and m.experts in inside
                       and isinstance(m.dispatcher, Dispatcher)]
        self.dropping = [d for d in dispatchers if d.config.ep_capacity_factor > 0]  # parallel/ep/capacity.py
        self.keepers = [d for d in dispatchers if d.config.keep]  # parallel/ep/keep.py

    def __call__(self, module: nn.Module, *args, **kwargs):
        return checkpoint(self.inner, module, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _contexts(self):
        """(forward context, recompute context) of one checkpointed call: the forward records the EP
        exchanges of `keepers` on a new tape; each entry of the recompute context replays it."""
        forward, replay = ep_keep.contexts(self.keepers)
        return forward, _EachEntry(lambda: self._recompute(replay()))

    @contextlib.contextmanager
    def _recompute(self, replay):
        """One recompute: `_as_recompute` and no forward prefetch by the FSDP units inside the region
        (backward is done with the units they would prefetch; parallel/overlap.py)."""
        restoring = _as_recompute(self.routers, self.dropping, self.recorders, replay)
        with forward_prefetch_paused(self.module), restoring:
            yield


class _EachEntry:
    """A context manager that may be entered again (and nested): each entry enters a new `make()`."""

    def __init__(self, make):
        self.make, self.open = make, []

    def __enter__(self):
        context = self.make()
        self.open.append(context)
        return context.__enter__()

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)


@contextlib.contextmanager
def _as_recompute(routers: list[Router], dropping: list, recorders: list[CausalAttention], replay):
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
