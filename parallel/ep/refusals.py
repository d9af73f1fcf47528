"""The one table of refused EP knob combinations (docs/expert_parallel.md "Refused combinations" is
checked against it by tests/unit/test_ep_refusals.py).

Each row names the keys it reads, says in one line what it refuses (`rule`, the docs' row) and makes
the one-line ValueError (`message`, naming every key and value involved). `check` runs the rows in
order, once, from `Layout.validate` (parallel/layout.py): the layout carries the EP knobs
(`layout.ep_config`, parallel/ep/config.py), activation checkpointing and compile, and validate passes
the model and the batch, so every setting is known. The batch alone may be unknown (None: post-training
rollouts are packed by tokens); a row that reads it is then skipped. Ranges of single knobs (a negative
capacity, an unknown dtype) are `EPConfig.check`'s.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from parallel.ep.config import EPConfig


@dataclass(frozen=True)
class Refusal:
    keys: tuple[str, ...]  # the settings it reads, dotted
    rule: str  # what it refuses, one line (the docs' table)
    when: Callable[[SimpleNamespace], bool]
    message: Callable[[SimpleNamespace], str]

    def applies(self, s) -> bool:
        """Every setting the row reads is known (not None)."""
        return all(getattr(s, key.split(".")[1]) is not None for key in self.keys)


KNOBS = tuple(EPConfig().knobs())  # the dispatch knobs (parallel/ep/config.py): ep_dedup, ep_capacity_factor, ...


def _on(s) -> list[str]:
    """The dispatch knobs that are on, as `parallel.key=value`."""
    return [f"parallel.{key}={getattr(s, key)!r}" for key in s.ep_config.on()]


def _local_batch(s) -> int:
    return s.batch_size // max(1, s.grad_accum * s.dp)


def _copies_per_expert(s) -> int:
    """Token copies each routed expert receives per micro-batch under balanced routing (from ep ranks)."""
    tokens = _local_batch(s) * s.seq_len // max(1, s.cp)
    return tokens * s.n_activated_experts * s.ep // max(1, s.n_routed_experts)


REFUSALS = (
    Refusal(("parallel.ep", *(f"parallel.{k}" for k in KNOBS)), "any EP knob on with ep = 1 (no dispatch)",
            lambda s: s.ep == 1 and bool(_on(s)),
            lambda s: f"{_on(s)[0]} has no effect with parallel.ep=1 (no dispatch)"),
    Refusal(("parallel.ep_dedup", "parallel.ranks_per_node"), "ep_dedup where ranks_per_node does not divide the world",
            lambda s: s.ep_dedup and s.world_size % s.ranks_per_node,
            lambda s: f"parallel.ep_dedup: parallel.ranks_per_node={s.ranks_per_node} does not divide the world size "
                      f"{s.world_size}"),
    Refusal(("parallel.ep_dedup", "parallel.ep_capacity_factor"), "ep_dedup with a fixed capacity",
            lambda s: s.ep_dedup and s.ep_capacity_factor > 0,
            lambda s: f"parallel.ep_dedup with parallel.ep_capacity_factor={s.ep_capacity_factor}: not combined yet (the "
                      f"node hop needs host split sizes); choose one"),
    Refusal(("parallel.ep_overlap_chunks", "parallel.ep_capacity_factor"), "pieces with a fixed capacity",
            lambda s: s.ep_overlap_chunks > 1 and s.ep_capacity_factor > 0,
            lambda s: f"parallel.ep_overlap_chunks={s.ep_overlap_chunks} with parallel.ep_capacity_factor="
                      f"{s.ep_capacity_factor}: not combined yet (the overlap needs host split sizes); choose one"),
    Refusal(("parallel.ep_recompute", "training.activation_checkpoint"), "ep_recompute = \"keep\" with nothing recomputed",
            lambda s: s.ep_recompute == "keep" and s.activation_checkpoint == "none",
            lambda s: "parallel.ep_recompute='keep' has no effect with training.activation_checkpoint='none' (nothing is "
                      "recomputed); use 'full' or 'selective', or ep_recompute='resend'"),
    Refusal(("training.compile", *(f"parallel.{k}" for k in KNOBS)),
            "training.compile = true with any EP knob on (only the direct EP path compiles yet)",
            lambda s: s.compile == "true" and bool(_on(s)),
            lambda s: f"training.compile=true with {', '.join(_on(s))}: only the direct EP path compiles yet; "
                      f"set training.compile=false or leave these knobs at their defaults"),
    Refusal(("parallel.ep_overlap_chunks", "parallel.ep", "parallel.cp", "data.batch_size", "data.seq_len",
             "training.grad_accum", "model.n_activated_experts", "model.n_routed_experts"),
            "more pieces than the token copies an expert receives per micro-batch (empty grouped matmuls)",
            lambda s: s.ep_overlap_chunks > 1 and s.ep_overlap_chunks > _copies_per_expert(s),
            lambda s: f"parallel.ep_overlap_chunks={s.ep_overlap_chunks} is more than the {_copies_per_expert(s)} "
                      f"token copies each expert receives per micro-batch ({_local_batch(s)} sequence(s) x "
                      f"data.seq_len={s.seq_len} / cp={s.cp} x top-k {s.n_activated_experts} x ep={s.ep} / "
                      f"{s.n_routed_experts} experts): a piece would average under one row per expert; use at most "
                      f"that many"),
)


def check(layout, model_config, seq_len: int | None, batch_size: int | None, grad_accum: int = 1) -> None:
    """ValueError (one line) for the first refused combination of `layout` (its EP knobs, activation
    checkpointing and compile) with the model and the batch (`seq_len`, `batch_size`: None when unknown)."""
    s = SimpleNamespace(world_size=layout.world_size, dp=layout.dp, cp=layout.cp, ep=layout.ep,
                        ep_config=layout.ep_config, **vars(layout.ep_config),
                        activation_checkpoint=layout.activation_checkpoint, compile=layout.compile,
                        seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                        n_activated_experts=model_config.n_activated_experts,
                        n_routed_experts=model_config.n_routed_experts)
    for refusal in REFUSALS:
        if refusal.applies(s) and refusal.when(s):
            raise ValueError(refusal.message(s))


def docs_rows() -> list[str]:
    """The docs' table rows, one per refusal, in order."""
    return [f"| {', '.join(f'`{k}`' for k in r.keys)} | {r.rule} |" for r in REFUSALS]
