"""One micro-batch's backward paired with the next micro-batch's forward (`parallel.ep_pair_micro_batches`):
each one's EP all-to-alls in flight while the other computes.

Why: per MoE layer a forward has more all-to-all time than compute (K2 at 256 GPUs: 16.5 against 8.05 ms,
docs/expert_parallel.md), and a backward (the recompute plus twice the forward's FLOPs) has less; the
halves of one micro-batch (parallel/ep_interleave.py) cannot hide the forward's. DeepSeek-V3's DualPipe
and Megatron's 1F1B all-to-all overlap pair a forward chunk with another micro-batch's backward chunk.

How (`forward_backward`): F(0) runs as usual; then for each micro-batch m, its backward B(m) runs on this
thread and the forward F(m+1) runs in a second thread, the two strictly taking turns (one runs, the other
waits on a semaphore; never both), so every rank issues the same collectives in the same order:
  - B hands F the turn at each gradient all-to-all wait (parallel/ep_overlap.py `_Start.backward`: the
    gradient's all-to-all is in flight), and waits for it after F hands the turn back;
  - F hands it back at each of its forward all-to-all waits (`_Wait.forward`: its dispatch or combine is
    in flight), so B's gradient compute runs while F's all-to-all crosses;
  - B goes down the blocks, F up: before F enters a block (or any FSDP unit) that B has not finished or
    will reach before F can finish it, F gives the turn back without running (`_enter`): F enters block
    x only if x is above B's current block b or below the next MoE block under b. Where they cross, one
    or two blocks run unpaired;
  - FSDP2 (torch 2.13) marks a unit PRE_BACKWARD from its backward until the backward's end and would
    treat F's forward of a unit B has finished as a recompute (no reshard, no hooks for F's backward);
    `_enter` sets such units, every parameter group POST_BACKWARD, back to IDLE first (private state);
  - F finishes inside B before FSDP's end-of-backward callback (queued from a hook on B's loss, before
    FSDP's), so that callback finds every unit of F's forward resharded.
Only the order changes: each micro-batch meets the same operations; fp32 losses and gradients equal the
unpaired path's (tests/test_ep_pairing.py). F runs in a thread because torch's notion of "inside a
backward" (and FSDP's reshard after forward, which reads it) is per thread. On a GPU both threads queue on
the same stream and NCCL overlaps; on CPU gloo runs the all-to-alls on its own threads.
"""

import contextlib
import threading
import weakref

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from models.moe import MoE
from parallel import _torch_private

_FORWARD = threading.local()  # .pair in F's thread: the Pairing it hands the turn back to
_BACKWARD = None  # the Pairing whose forward B hands the turn to, while B runs
_PAIRED = weakref.WeakSet()  # the models `apply_pairing` prepared (runtime/train.py asks `paired`)


class _Aborted(Exception):
    """Raised in F's thread at its next turn when the pairing is closed before F finished."""


def apply_pairing(model: nn.Module) -> None:
    """Number the blocks (embedding -1, blocks 0..n-1, norm/output n) for the crossing rule, and put `_enter`
    ahead of FSDP's pre-forward hook of every unit. After fully_shard; the MoE blocks' dispatchers know
    their block index (parallel/ep/dispatcher.py), which the gradient waits hand to `backward_turn`."""
    _torch_private.check_fsdp_unit_states("ep_pair_micro_batches", model.layers[0])
    n = len(model.layers)
    _PAIRED.add(model)
    positions = {model: -1, model.tok_embeddings: -1, model.norm: n, model.output: n}
    positions.update({block: i for i, block in enumerate(model.layers)})
    for module, x in positions.items():
        units = [m for m in module.modules() if isinstance(m, FSDPModule)] if module is not model else [model]
        module.register_forward_pre_hook(lambda *_, x=x, units=units: _enter(x, units), prepend=True)


def paired(model: nn.Module) -> bool:
    """Whether `apply_pairing` prepared `model` (parallel.ep_pair_micro_batches)."""
    return model in _PAIRED


def moe_blocks(model: nn.Module) -> list[int]:
    return [i for i, b in enumerate(model.layers) if isinstance(b.feed_forward, MoE)]


def forward_backward(micro_batches: list, loss_of, before_backward, model: nn.Module, device) -> torch.Tensor:
    """Sum of `loss_of(micro_batch)` (detached) over the micro-batches, each backward paired with the next
    forward (module docstring); `before_backward(i)` runs before micro-batch i's backward."""
    global _BACKWARD
    total = torch.zeros((), device=device)
    loss = loss_of(micro_batches[0])
    for i in range(len(micro_batches)):
        before_backward(i)
        pair = None
        if i + 1 < len(micro_batches):
            pair = Pairing(lambda mb=micro_batches[i + 1]: loss_of(mb), moe_blocks(model), device)
            loss.register_hook(pair.finish_at_end)
        _BACKWARD = pair
        try:
            loss.backward()
        finally:
            _BACKWARD = None
            if pair is not None:
                pair.close()
        total += loss.detach()
        loss = pair.result if pair is not None else None
    return total


class Pairing:
    """F (`forward()`) in a thread of its own, run a turn at a time by B's `advance()`."""

    def __init__(self, forward, moe_blocks: list[int], device: torch.device):
        self.moe_blocks, self.block = moe_blocks, None  # block: where B waits now (None: B finished)
        self.result = self.error = None
        self.done = self.aborted = False
        self._to_f, self._to_b = threading.Semaphore(0), threading.Semaphore(0)
        # torch function and dispatch modes are per thread: F runs under the caller's (counters: runtime/syncs.py)
        modes = _torch_private.current_modes()
        self._thread = threading.Thread(target=self._run, args=(forward, device, modes), daemon=True)
        self._thread.start()

    def _run(self, forward, device, modes):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _FORWARD.pair = self
        self._to_f.acquire()
        try:
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                if not self.aborted:
                    self.result = forward()
        except _Aborted:
            pass
        except BaseException as e:  # handed to B at its next turn
            self.error = e
        finally:
            self.done = True
            _FORWARD.pair = None
            self._to_b.release()

    def advance(self, block) -> None:
        """B (waiting in `block`, None once finished): let F run until it hands the turn back."""
        self.block = block
        if self.done:
            return
        self._to_f.release()
        self._to_b.acquire()
        if self.error is not None:
            raise self.error

    def hand_back(self) -> None:
        """F: give B the turn; returns when B hands it over again."""
        self._to_b.release()
        self._to_f.acquire()
        if self.aborted:
            raise _Aborted

    def may_enter(self, x: int) -> bool:
        """Whether F may run block x now: B has finished it, or F can finish it before B arrives (B's next
        segment reaches down to the next MoE block under b, F needs B's next 4 waits to finish x)."""
        b = self.block
        if b is None:
            return True
        below = [m for m in self.moe_blocks if m < b]
        return x > b or x < (below[-1] if below else -1)

    def finish_at_end(self, grad):
        """Hook on B's loss: queue F's completion at the end of B, ahead of FSDP's end-of-backward callback."""
        _torch_private.queue_backward_callback(self._finish)
        return grad

    def _finish(self) -> None:
        while not self.done:
            self.advance(None)

    def close(self) -> None:
        """After B: F is finished; else (B raised) stop F at its next turn."""
        if not self.done:
            self.aborted = True
            self._to_f.release()
        self._thread.join()


def _enter(x: int, units: list) -> None:
    """Pre-forward of an FSDP unit at position x (before FSDP's): in F's thread, wait for B to leave the way,
    then return units B has finished to IDLE (module docstring)."""
    pair = getattr(_FORWARD, "pair", None)
    if pair is None:
        return
    while not pair.may_enter(x):
        pair.hand_back()
    for unit in units:
        _torch_private.reset_finished_unit(unit)


def forward_turn() -> None:
    """At a forward all-to-all wait (parallel/ep_overlap.py `_Wait.forward`): in F's thread, hand B the turn."""
    pair = getattr(_FORWARD, "pair", None)
    if pair is not None:
        pair.hand_back()


def backward_turn(block) -> None:
    """At a gradient all-to-all wait (`_Start.backward`): hand F the turn, if a forward is paired with B."""
    if _BACKWARD is not None and getattr(_FORWARD, "pair", None) is None:
        _BACKWARD.advance(block)
