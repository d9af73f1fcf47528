"""Pipeline parallelism's plan: which ranks form a stage, which layers each stage holds, which stages a
rank runs, and what each schedule refuses. Pure (no torch): the config checks it before torch loads.

Ranks. pp is the OUTERMOST axis of the world mesh: pipeline rank p holds the S = world / pp consecutive
ranks [p*S, (p+1)*S), so a stage spans as few nodes as it can. Inside each stage the dense and expert
meshes are exactly those of pp = 1 on S ranks (parallel/meshes.py):
    world = pp x (dp_replicate x dp_shard x cp) = pp x (edp_replicate x edp_shard x ep).
The rank at coordinate c of stage p is p*S + c; the ranks {p*S + c} of one c form its pipeline group
(activations and their gradients travel there, point to point).

Stages. The model is cut into V = pp x stages_per_rank consecutive stages, in units: the embedding, each
block, the final norm with the output head. `parallel.pp_layers` gives the blocks of each stage (V
numbers); by default the n_layers + 2 units spread evenly, the embedding and the head each weighing a
block, the extra units going to the middle stages first (the end stages also hold the embedding's or the
logits' activations). Rank placement: "loop" (1f1b, gpipe, interleaved_1f1b): stage v on pipeline rank
v % pp; "v" (zbv, dualpipev): ranks 0..pp-1 then back, so pipeline rank p holds stages p and 2pp-1-p
(the first and the last stage on rank 0).

Refusals (one line each, `check_pipeline`): too few micro-batches (training.grad_accum: >= pp for 1f1b,
gpipe and interleaved_1f1b, >= 2pp for the V schedules, and interleaved_1f1b's rounds), stages per rank
the schedule does not run, pp_layers that do not sum to n_layers or leave a stage empty,
reshard_after_forward=true or activation checkpointing or compile with a zero-bubble schedule.
"""

V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank in a V; their backward is split (zero bubble)
ZERO_BUBBLE = V_SCHEDULES  # input and weight gradients computed apart (torch.autograd.grad per weight group)


def stages_per_rank(c) -> int:
    """The stages each rank runs (`c`: a PipelineConfig, parallel/pp/config.py): parallel.pp_stages_per_rank,
    or the schedule's (1 for 1f1b and gpipe, else 2)."""
    if c.pp == 1:
        return 1
    if c.pp_stages_per_rank != -1:
        return c.pp_stages_per_rank
    return 1 if c.pp_schedule in ("1f1b", "gpipe") else 2


def n_stages(c) -> int:
    return c.pp * stages_per_rank(c)


def reshard_after_forward(c) -> bool:
    """FSDP's reshard_after_forward: the key, or "auto": True without pipeline parallelism, False with it
    (each stage's weights stay gathered from a micro-batch's forward to its backward, as torchtitan does)."""
    if c.reshard_after_forward == "auto":
        return c.pp == 1
    return c.reshard_after_forward == "true"


def compiles_auto(c) -> bool:
    """Whether training.compile = "auto" may compile under `c`: not with a zero-bubble schedule, whose torch
    implementation refuses compiled stages."""
    return c.pp == 1 or c.pp_schedule not in ZERO_BUBBLE


def stage_layers(n_layers: int, stages: int, pp_layers: tuple[int, ...] = ()) -> list[range]:
    """The blocks of each of `stages` stages, in order (`pp_layers`, or the even spread of the docstring)."""
    if pp_layers:
        counts = list(pp_layers)
    else:
        units, extra = divmod(n_layers + 2, stages)
        order = _middle_first(stages)
        counts = [units + (s in order[:extra]) - (s == 0) - (s == stages - 1) for s in range(stages)]
        if stages == 1:
            counts = [n_layers]
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def _middle_first(stages: int) -> list[int]:
    """Stage indices from the middle outwards (the order extra units go in)."""
    middle = (stages - 1) / 2
    return sorted(range(stages), key=lambda s: (abs(s - middle), s))


def rank_stages(pp_rank: int, c) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in increasing order (module docstring: loop or v)."""
    pp, per_rank = c.pp, stages_per_rank(c)
    if c.pp_schedule in V_SCHEDULES:
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(per_rank)]


def check_pipeline(c, n_layers: int, grad_accum: int, activation_checkpoint: str = "none",
                   compile_on: bool = False) -> None:
    """ValueError (one line, every key and number involved) for a pipeline the runtime does not run
    (`c`: a PipelineConfig)."""
    if c.pp == 1:
        return
    _check_stages_per_rank(c)
    _check_micro_batches(c, grad_accum)
    _check_layers(c, n_layers)
    schedule = f"parallel.pp_schedule={c.pp_schedule!r}"
    if c.pp_schedule in ZERO_BUBBLE and c.reshard_after_forward == "true":
        raise ValueError(f"parallel.reshard_after_forward='true' with {schedule}: a zero-bubble schedule computes "
                         f"weight gradients after FSDP resharded the weights (wrong gradients, no error); use "
                         f"'auto' or 'false'")
    if c.pp_schedule in ZERO_BUBBLE and activation_checkpoint != "none":
        raise ValueError(f"training.activation_checkpoint={activation_checkpoint!r} with {schedule}: its weight "
                         f"pass would recompute each region once per weight group; use parallel.pp_schedule="
                         f"'1f1b' or 'interleaved_1f1b', or training.activation_checkpoint='none'")
    if c.pp_schedule in ZERO_BUBBLE and compile_on:
        raise ValueError(f"training.compile=true with {schedule}: torch's zero-bubble schedules refuse compiled "
                         f"stages; use parallel.pp_schedule='1f1b' or 'interleaved_1f1b', or training.compile=false")


def _check_stages_per_rank(c) -> None:
    per_rank, schedule = stages_per_rank(c), c.pp_schedule
    wanted = {"1f1b": (1, "1"), "gpipe": (1, "1"), "zbv": (2, "2"), "dualpipev": (2, "2")}
    if schedule in wanted and per_rank != wanted[schedule][0]:
        raise ValueError(f"parallel.pp_stages_per_rank={per_rank} with parallel.pp_schedule={schedule!r}: it runs "
                         f"{wanted[schedule][1]} stage(s) per rank")
    if schedule == "interleaved_1f1b" and per_rank < 2:
        raise ValueError(f"parallel.pp_stages_per_rank={per_rank} with parallel.pp_schedule='interleaved_1f1b': "
                         f"it needs >= 2 stages per rank (use '1f1b' for one)")


def _check_micro_batches(c, grad_accum: int) -> None:
    pp, schedule = c.pp, c.pp_schedule
    least = 2 * pp if schedule in V_SCHEDULES else pp
    if grad_accum < least:
        rule = f"2 x parallel.pp = {least}" if schedule in V_SCHEDULES else f"parallel.pp = {least}"
        raise ValueError(f"training.grad_accum={grad_accum} micro-batches with parallel.pp_schedule={schedule!r}: "
                         f"it needs at least {rule}")
    rounds = max(1, grad_accum // pp)
    if schedule == "interleaved_1f1b" and grad_accum % rounds:
        raise ValueError(f"training.grad_accum={grad_accum} with parallel.pp_schedule='interleaved_1f1b' and "
                         f"parallel.pp={pp}: it runs grad_accum // pp = {rounds} rounds, which must divide "
                         f"grad_accum (e.g. a multiple of {pp})")


def _check_layers(c, n_layers: int) -> None:
    stages = n_stages(c)
    if c.pp_layers and len(c.pp_layers) != stages:
        raise ValueError(f"parallel.pp_layers={list(c.pp_layers)}: {len(c.pp_layers)} numbers, but "
                         f"parallel.pp={c.pp} x {stages_per_rank(c)} stages per rank = {stages} stages")
    if c.pp_layers and sum(c.pp_layers) != n_layers:
        raise ValueError(f"parallel.pp_layers={list(c.pp_layers)} sums to {sum(c.pp_layers)}, but "
                         f"model.n_layers={n_layers}")
    if n_layers + 2 < stages:
        raise ValueError(f"parallel.pp={c.pp} x {stages_per_rank(c)} stages per rank = {stages} stages "
                         f"for model.n_layers={n_layers} + the embedding + the head = {n_layers + 2} units")
    layers = stage_layers(n_layers, stages, c.pp_layers)
    empty = [s for s in range(1, stages - 1) if not layers[s]]
    if empty:
        raise ValueError(f"parallel.pp_layers={[len(r) for r in layers]}: stage(s) {empty} hold no block (only the "
                         f"first and the last stage may hold just the embedding or the head)")


def describe_stages(c, world_size: int, n_layers: int) -> list[str]:
    """Lines for the c printout: each pipeline rank's ranks and its stages' blocks (`c`: a PipelineConfig)."""
    if c.pp == 1:
        return []
    size, stages = world_size // c.pp, n_stages(c)
    layers = stage_layers(n_layers, stages, c.pp_layers)
    lines = [f"pipeline pp={c.pp} (outermost), schedule {c.pp_schedule}, {stages} stages "
             f"({stages_per_rank(c)} per rank), FSDP reshard_after_forward={reshard_after_forward(c)}"]
    for p in range(c.pp):
        held = "; ".join(f"stage {s}: {_units(layers[s], s, stages)}" for s in rank_stages(p, c))
        lines.append(f"  pipeline rank {p}: ranks {_span(p * size, size)}  {held}")
    return lines


def _units(blocks: range, stage: int, stages: int) -> str:
    named = f"block {blocks.start}" if len(blocks) == 1 else f"blocks {blocks.start}-{blocks.stop - 1}"
    parts = (["embedding"] if stage == 0 else []) + ([named] if blocks else [])
    return " + ".join(parts + (["norm + head"] if stage == stages - 1 else []))


def _span(first: int, size: int) -> str:
    return f"[{first}]" if size == 1 else f"[{first}..{first + size - 1}]"
