"""What each pipeline rank runs: the layers, the embedding, the output head and loss, the multi-token-prediction
modules of its stages (planning/step.py charges each rank its own work; the slowest rank sets the pipeline's pace).

A layout is Megatron's `--pipeline-model-parallel-layout` grammar (megatron/core/transformer/
pipeline_parallel_layer_layout.py): the pp x v virtual stages in order, separated by "|"; in each, "E" the
embedding, "t" one transformer layer (in model order), "m" one multi-token-prediction module, "L" the final norm,
output head and loss; "X*n" repeats a symbol and "(...)*n" a group; commas are cosmetic. Virtual stage s runs on
pipeline rank s mod pp. Examples: Megatron-Bridge's DeepSeek-V3 on PP 8 x VP 4 "Et|(tt|)*30mL"; Megatron's
account_for_embedding/loss_in_pipeline_split, Qwen3-235B's 94 layers on PP 8 x VP 4, "Ett|(ttt|)*30ttL".
    None          the default split (`default_layout`): the layers as even as the stages allow, one more on each of
                  the first (layers mod stages) stages (NeMo AutoModel's and torchtitan's rule; Megatron's even
                  split where it divides), the embedding on the first stage, the modules and the head on the last
    "balanced"    every rank an equal share of everything (a run whose split its source does not give and whose
                  stack balances it by hand)
DualPipe (pp_schedule "dualpipe") runs stage i and stage pp - 1 - i on rank i, each for half the micro-batches.
"""

import re
from dataclasses import dataclass

SYMBOLS = "EtmL"


@dataclass(frozen=True)
class RankLoad:
    """The work of one pipeline rank, per micro-batch, as shares of whole modules: {layer index: share}, and the
    shares of the multi-token-prediction modules, the output head and loss, and the embedding it runs."""
    layers: tuple  # ((layer index, share), ...)
    mtp: float = 0.0
    head: float = 0.0
    embedding: float = 0.0


def parse(text: str) -> list[str]:
    """The virtual stages of a layout string, each a string of SYMBOLS (Megatron's parse_str_to_list)."""
    flat = text.replace(",", "")
    flat = re.sub(r"\(([^)]+)\)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), flat)
    flat = re.sub(r"(.)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), flat)
    stages = flat.split("|")
    bad = sorted(set("".join(stages)) - set(SYMBOLS))
    if bad:
        raise ValueError(f"layout.pipeline_layout = {text!r}: unknown symbol(s) {bad}; expected E, t, m, L, | "
                         f"and X*n, (...)*n")
    return stages


def default_layout(n_layers: int, stages: int, mtp: int) -> list[str]:
    """The layers as even as `stages` allow (the first n_layers mod stages one more), the embedding first, the
    multi-token-prediction modules and the head last (module docstring)."""
    base, extra = divmod(n_layers, stages)
    out = ["t" * (base + (s < extra)) for s in range(stages)]
    out[0] = "E" + out[0]
    out[-1] += "m" * mtp + "L"
    return out


def check(stages: list[str], pp: int, virtual: int, n_layers: int, mtp: int) -> None:
    """ValueError with every number when the layout does not describe the model on pp x virtual stages."""
    flat = "".join(stages)
    if len(stages) != pp * virtual:
        raise ValueError(f"layout.pipeline_layout has {len(stages)} stage(s), not layout.pp x virtual_stages = "
                         f"{pp} x {virtual} = {pp * virtual}")
    counts = {s: flat.count(s) for s in SYMBOLS}
    if counts["t"] != n_layers or counts["m"] != mtp or counts["E"] != 1 or counts["L"] != 1:
        raise ValueError(f"layout.pipeline_layout holds {counts['t']} layers, {counts['m']} multi-token-prediction "
                         f"modules, {counts['E']} embedding and {counts['L']} loss; the model has {n_layers} layers "
                         f"and {mtp} modules (model.mtp_layers), and needs one embedding and one loss")
    if not (flat.startswith("E") and flat.endswith("L")):
        raise ValueError("layout.pipeline_layout must start with the embedding (E) and end with the loss (L)")


def rank_loads(layout: str | None, pp: int, virtual: int, n_layers: int, mtp: int, dualpipe: bool) -> list[RankLoad]:
    """Each pipeline rank's work (module docstring)."""
    if layout == "balanced":
        share = 1 / pp
        return [RankLoad(tuple((i, share) for i in range(n_layers)), mtp * share, share, share)] * pp
    stages = parse(layout) if layout else default_layout(n_layers, pp * virtual, mtp)
    check(stages, pp, virtual, n_layers, mtp)
    index, numbered = 0, []
    for stage in stages:  # layer indices in model order
        numbered.append([])
        for symbol in stage:
            numbered[-1].append(index if symbol == "t" else symbol)
            index += symbol == "t"
    held = [[(s, 1.0) for s in range(len(stages)) if s % pp == r] for r in range(pp)]
    if dualpipe:
        held = [[(r, 0.5), (pp - 1 - r, 0.5)] for r in range(pp)]
    return [_load([(numbered[s], w) for s, w in h]) for h in held]


def _load(stages: list) -> RankLoad:
    layers, other = [], dict.fromkeys("mLE", 0.0)
    for items, share in stages:
        for item in items:
            if isinstance(item, int):
                layers.append((item, share))
            else:
                other[item] += share
    return RankLoad(tuple(layers), other["m"], other["L"], other["E"])
