"""The one table of refused EP knob combinations (docs/expert_parallel.md "Refused combinations" is
checked against it by tests/unit/test_ep_refusals.py).

Each row names the keys it reads, says in one line what it refuses (`rule`, the docs' row) and makes
the one-line ValueError (`message`, naming every key and value involved). `check` runs the rows in
order on a resolved Layout plus whatever other settings the caller knows; a row that reads a setting
the caller did not pass is skipped (parallel/layout.py checks the layout alone; parallel/parallelize.py
and runtime/config.py add training.activation_checkpoint; runtime/config.py the batch). Ranges of single knobs (a negative capacity, an unknown dtype) are parallel/layout.py's.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

EP_SWITCHES = {  # knob: is it on (a knob that is on needs ep > 1)
    "ep_dedup": lambda s: s.ep_dedup, "ep_capacity_factor": lambda s: s.ep_capacity_factor > 0,
    "ep_overlap_chunks": lambda s: s.ep_overlap_chunks > 1,
    "ep_dispatch_dtype": lambda s: s.ep_dispatch_dtype != "compute", "ep_recompute": lambda s: s.ep_recompute == "keep",
    "ep_combine_grad_dtype": lambda s: s.ep_combine_grad_dtype != "compute",
}


@dataclass(frozen=True)
class Refusal:
    keys: tuple[str, ...]  # the settings it reads, dotted
    rule: str  # what it refuses, one line (the docs' table)
    when: Callable[[SimpleNamespace], bool]
    message: Callable[[SimpleNamespace], str]

    def needs(self) -> set[str]:
        """Settings beyond the layout's (`parallel.*`) it reads: the caller must pass them."""
        return {k.split(".")[1] for k in self.keys if not k.startswith("parallel.")}


def _on(s) -> str:
    return next(k for k, on in EP_SWITCHES.items() if on(s))


def _local_batch(s) -> int:
    return s.batch_size // max(1, s.grad_accum * s.dp)


def _copies_per_expert(s) -> int:
    """Token copies each routed expert receives per micro-batch under balanced routing (from ep ranks)."""
    tokens = _local_batch(s) * s.seq_len // max(1, s.cp)
    return tokens * s.n_activated_experts * s.ep // max(1, s.n_routed_experts)


REFUSALS = (
    Refusal(("parallel.ep", *(f"parallel.{k}" for k in EP_SWITCHES)), "any EP knob on with ep = 1 (no dispatch)",
            lambda s: s.ep == 1 and any(on(s) for on in EP_SWITCHES.values()),
            lambda s: f"parallel.{_on(s)}={getattr(s, _on(s))!r} has no effect with parallel.ep=1 (no dispatch)"),
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
    Refusal(("parallel.ep_overlap_chunks", "parallel.ep", "parallel.cp", "data.batch_size", "data.seq_len",
             "training.grad_accum", "model.n_activated_experts", "model.n_routed_experts"),
            "more pieces than the token copies an expert receives per micro-batch (empty grouped matmuls)",
            lambda s: s.ep_overlap_chunks > 1 and s.ep_overlap_chunks > _copies_per_expert(s),
            lambda s: f"parallel.ep_overlap_chunks={s.ep_overlap_chunks} is more than the {_copies_per_expert(s)} "
                      f"token copies each expert receives per micro-batch ({_local_batch(s)} sequence(s) x "
                      f"data.seq_len={s.seq_len} / cp={s.cp} x top-k {s.n_activated_experts} x ep={s.ep} / "
                      f"{s.n_routed_experts} experts): a piece would average under one row per expert; use at most "
                      f"that many"),
    Refusal(("parallel.ep_recompute", "training.activation_checkpoint"), "ep_recompute = \"keep\" with nothing recomputed",
            lambda s: s.ep_recompute == "keep" and s.activation_checkpoint == "none",
            lambda s: "parallel.ep_recompute='keep' has no effect with training.activation_checkpoint='none' (nothing is "
                      "recomputed); use 'full' or 'selective', or ep_recompute='resend'"),
)


def check(layout, **settings) -> None:
    """ValueError (one line) for the first refused combination of `layout`'s EP knobs with `settings`
    (activation_checkpoint, batch_size, seq_len, grad_accum, ...: those known)."""
    s = SimpleNamespace(**{k: getattr(layout, k) for k in vars(layout)}, dp=layout.dp, **settings)
    for refusal in REFUSALS:
        if refusal.needs() <= settings.keys() and refusal.when(s):
            raise ValueError(refusal.message(s))


def docs_rows() -> list[str]:
    """The docs' table rows, one per refusal, in order."""
    return [f"| {', '.join(f'`{k}`' for k in r.keys)} | {r.rule} |" for r in REFUSALS]
