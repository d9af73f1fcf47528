"""What one pipeline rank holds for the memory estimate (planning/memory/pretrain.py): its stages' blocks, as the
runtime splits them (parallel/pp/plan.py), and the micro-batches whose activations it keeps at its peak, read off
torch 2.13's schedules (torch/distributed/pipelining/schedules.py; tests/ranks/test_pp_memory.py walks their
action lists and checks every count below).

A rank keeps a micro-batch's activations of a stage from that stage's forward to its backward (the weight pass
W for the zero-bubble schedules: its input gradient I frees only part, so the estimate keeps all until W). Per
schedule, with pp ranks, M = training.grad_accum micro-batches and pipeline rank r:
  gpipe             every forward before any backward: M.
  1f1b              Schedule1F1B: min(M, pp - r) warm-up forwards, then one backward before each next forward:
                    pp - r (M >= pp is enforced).
  interleaved_1f1b  ScheduleInterleaved1F1B with v stages per rank: w = min((v - 1) m + 2 (pp - 1 - r), M v)
                    warm-up forwards (m = M / rounds micro-batches per round, rounds = max(1, M // pp)), then
                    each step runs a forward BEFORE its backward, so w + 1 chunks are alive at each forward; the
                    k-th forward is of local stage (k // m) mod v, the k-th backward of v - 1 - (k // m) mod v.
                    Every moment of the steady phase is a candidate (the stages may differ in size).
  zbv               ScheduleZBVZeroBubble (stages r and 2pp - 1 - r): 2pp - r - 1 forwards of the first stage and
                    r of the second in warm-up; then F1 (r + 1) before its I, W; then in the steady phase F0
                    (2pp - r) before its I, W: moments (2pp - r - 1, r + 1) and (2pp - r, r).
  dualpipev         ScheduleDualPipeV: 2pp - r - 1 and r + 1 after its warm-up; torch 2.13's OVERLAP_F_B runs
                    the forward of the first stage before the backward of the second: (2pp - r, r + 1).
Without pipeline parallelism the rank holds the whole model and one micro-batch.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Holding:
    """The blocks of each stage a rank runs (`chunks`, in stage order; one chunk: the whole model or one stage),
    whether it holds the embedding and the final norm + head, the micro-batches in flight per chunk at each
    candidate peak moment (`moments`), and whether its weights and gradients stay unsharded for the whole step
    (`gathered`: pipeline parallelism, where FSDP reduces once per step and reshard_after_forward is off)."""

    chunks: tuple[tuple[int, ...], ...]
    embedding: bool
    head: bool
    moments: tuple[tuple[int, ...], ...] = ((1,),)
    gathered: bool = False
    reshard_after_forward: bool = True

    def layers(self) -> list[int]:
        return sorted(i for chunk in self.chunks for i in chunk)


def whole_model(n_layers: int) -> Holding:
    return Holding((tuple(range(n_layers)),), True, True)


def pipeline_holding(n_layers: int, pp_config, pp_rank: int, n_micro_batches: int) -> Holding:
    """What pipeline rank `pp_rank` holds under `pp_config` (parallel/pp/config.py) with `n_micro_batches`."""
    from parallel.pp.plan import n_stages, rank_stages, reshard_after_forward, stage_layers, stages_per_rank

    if pp_config.pp == 1:
        return whole_model(n_layers)
    total = n_stages(pp_config)
    layers = stage_layers(n_layers, total, pp_config.pp_layers)
    mine = rank_stages(pp_rank, pp_config)
    moments = in_flight(pp_config.pp_schedule, pp_config.pp, stages_per_rank(pp_config), n_micro_batches, pp_rank)
    return Holding(tuple(tuple(layers[s]) for s in mine), 0 in mine, total - 1 in mine, moments, gathered=True,
                   reshard_after_forward=reshard_after_forward(pp_config))


def in_flight(schedule: str, pp: int, v: int, m: int, r: int) -> tuple[tuple[int, ...], ...]:
    """Micro-batches kept per local stage (in stage order) at each candidate peak moment (module docstring)."""
    if schedule == "gpipe":
        return ((m,),)
    if schedule == "1f1b":
        return ((min(m, pp - r),),)
    if schedule == "zbv":
        return ((2 * pp - r - 1, r + 1), (2 * pp - r, r))
    if schedule == "dualpipev":
        return ((2 * pp - r, r + 1),)
    if schedule == "interleaved_1f1b":
        return _interleaved(pp, v, m, r)
    raise ValueError(f"parallel.pp_schedule={schedule!r}: no in-flight model")


def _interleaved(pp: int, v: int, m: int, r: int) -> tuple[tuple[int, ...], ...]:
    """ScheduleInterleaved1F1B's counts after each forward (warm-up, then forward-before-backward steps)."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - r), m * v)
    alive = [0] * v
    moments = []
    for k in range(m * v):  # the k-th forward; from the warm-up's end on, the (k - warmup)-th backward after it
        alive[(k // per_round) % v] += 1
        if k >= warmup - 1:
            moments.append(tuple(alive))
        if k >= warmup:
            alive[v - 1 - ((k - warmup) // per_round) % v] -= 1
    return tuple(sorted(set(moments)))
