"""The `[data]` section: DataConfig, its `[[data.sources]]` tables and how a batch must split over ranks
(no torch: the config tree imports it; runtime/data/loader.py reads the tokens, runtime/data/mixture.py mixes sources).
"""

import math
import os
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    path: str = ""  # an indexed dataset (prefix of .bin + .idx) or a flat .bin
    weight: float = 1.0  # share of the sequences, relative to the other sources' weights (> 0)
    name: str = ""  # name in tokens_by_source and eval_loss/<name>; default: the file name without .bin

    def label(self) -> str:
        return self.name or os.path.basename(self.path).removesuffix(".bin")


def check_sources(sources: tuple) -> None:
    """ValueError naming data.sources[i] on a missing path, a weight that is not positive, a repeated name."""
    seen = {}
    for i, source in enumerate(sources):
        if not source.path:
            raise ValueError(f"data.sources[{i}].path is empty: give an indexed dataset prefix or a .bin")
        if not (source.weight > 0 and math.isfinite(source.weight)):
            raise ValueError(f"data.sources[{i}].weight={source.weight} must be positive and finite")
        if source.label() in seen:
            raise ValueError(f"data.sources[{i}].name={source.label()!r} repeats data.sources[{seen[source.label()]}]'s; "
                             f"give each source its own name")
        seen[source.label()] = i


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: Literal["corpus", "bin", "synthetic", "rollouts"] = "corpus"  # byte corpus, token file, random, rollouts (posttrain); unset with data.path: bin (posttrain: rollouts)
    seq_len: int = 128  # tokens per training sequence
    batch_size: int = 16  # GLOBAL sequences per optimizer step (over all data-parallel ranks and micro-batches)
    path: str = ""  # bin: the token file: a Megatron indexed dataset (prefix of .bin + .idx) or a flat .bin of uint16/uint32 ids
    dtype: Literal["auto", "uint16", "uint32"] = "auto"  # bin: flat token dtype; auto = from the sidecar <path>.json (indexed: from the .idx)
    document_mask: bool = False  # bin, indexed datasets: attend only within a document, RoPE positions restart per document, cross-document labels untrained
    sources: tuple[SourceConfig, ...] = ()  # bin: a weighted mixture, TOML [[data.sources]] tables of path, weight, name (runtime/data/mixture.py); instead of data.path
    batch_tokens: int = 4096  # rollouts: token budget of a step (student + teacher tokens; see runtime/posttrain/rollouts.py)

    def __post_init__(self):
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError(f"data.seq_len={self.seq_len} and data.batch_size={self.batch_size} must be >= 1")
        if self.sources:
            self._check_sources()
        elif self.source in ("bin", "rollouts") and not self.path:
            kind = "token file" if self.source == "bin" else "rollouts file (JSON lines)"
            raise ValueError(f"data.path: source {self.source!r} needs the path of a {kind}")
        if self.path and self.source in ("corpus", "synthetic"):
            raise ValueError(f"data.path={self.path!r} is read only by data.source 'bin' or 'rollouts', but data.source="
                             f"{self.source!r}: drop one of them (a data.path alone means a token file)")
        if self.batch_tokens < 1:
            raise ValueError(f"data.batch_tokens={self.batch_tokens} must be >= 1")
        if self.document_mask and self.source != "bin":
            raise ValueError(f"data.document_mask needs token files with document boundaries (data.source='bin', "
                             f"Megatron indexed datasets), but data.source={self.source!r}")

    def _check_sources(self) -> None:
        if self.path:
            raise ValueError(f"data.path={self.path!r} and [[data.sources]] are both given: a mixture lists every "
                             f"file in data.sources")
        if self.source != "bin":
            raise ValueError(f"[[data.sources]] are token files, but data.source={self.source!r} (use 'bin')")
        check_sources(self.sources)

    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def check_split(config: DataConfig, dp_degree: int, cp_degree: int, grad_accum: int) -> None:
    """Raise ValueError unless the global batch splits evenly over micro-batches, dp ranks and cp chunks."""
    if config.source != "rollouts" and config.batch_size % (grad_accum * dp_degree) != 0:  # rollouts: by tokens
        raise ValueError(f"data.batch_size={config.batch_size} is not divisible by training.grad_accum={grad_accum} "
                         f"x data-parallel degree {dp_degree} = {grad_accum * dp_degree}")
    if config.seq_len % (2 * cp_degree) != 0:
        raise ValueError(f"data.seq_len={config.seq_len} is not divisible by 2*cp={2 * cp_degree} (load-balanced "
                         f"context parallelism cuts each sequence into 2*cp chunks)")
