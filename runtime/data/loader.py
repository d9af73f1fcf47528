"""Token sources and the per-rank loader (the `[data]` section: runtime/data/config.py).

Letters: B = rows (sequences) of one micro-batch on this rank, S = tokens of a sequence on this rank
(seq_len / cp), L = seq_len.

Which tokens make up step t (a pure function of the data config, the seed and t, never of the layout):
  - `corpus` / `bin`: the global batch is `batch_size` windows of L+1 consecutive tokens starting at
    positions drawn uniformly (with replacement) from a NumPy generator seeded by (seed, t). Sampling by
    step instead of walking epochs keeps resume trivial: the loader's whole state is the next step.
  - `synthetic`: row r of step t is L+1 uniform token ids from a generator seeded by (seed, t, r).
  - `[[data.sources]]` (a `bin` mixture): rows per source and their windows from runtime/data/mixture.py.
  Inputs are a window's first L tokens, labels its last L (next-token prediction). A token file is flat or
  a Megatron indexed dataset (runtime/data/indexed.py); with `data.document_mask` the micro-batches also carry
  the documents of each row (runtime/data/documents.py).

How step t is split over ranks and micro-batches (gradient accumulation):
  the global rows [0, batch_size) are cut into `grad_accum` consecutive micro-batches; inside micro-batch
  m, data-parallel rank d holds rows m*batch_size/grad_accum + d*B + [0, B), B = batch_size/(grad_accum*dp).
  Along the sequence, context-parallel rank i holds chunks i and 2*cp-1-i of the 2*cp equal chunks (the
  load-balanced causal scheme: every rank gets one early and one late chunk, so equal attention work),
  and `positions_S` are those tokens' global positions. Every rank's micro-batch has B*S tokens, so the
  mean of the per-rank, per-micro-batch mean losses is the mean over the global batch.
"""

import dataclasses
import json
import math
import os
from typing import NamedTuple

import numpy as np
import torch

from parallel.context_parallel import load_balanced_positions
from runtime.data import corpus
from runtime.data.documents import crossing_labels, document_micro_batches, window_documents
from runtime.data.indexed import IndexedTokens, prefix_of
from runtime.data.config import DataConfig, check_split
from runtime.data.mixture import Mixture

_DATA_STREAM = 0xDA7A  # mixed into every data seed so data draws never coincide with other seeded streams
_EVAL_STREAM = 0xE7A1  # the held-out evaluation batches' draws


def startup_line(train: str, held_out: str | None, data: DataConfig, eval_config) -> str:
    """The one start-up line naming the data: `train` and `held_out` are the loaders' describe() (None:
    no evaluation, whose reason the line gives)."""
    if held_out is None:
        held_out = ("none (eval.interval=0)" if not eval_config.enabled()
                    else "none (post-training evaluates only an eval.path token file)")
    elif eval_config.enabled():
        held_out += f"; {eval_config.steps} batches of data.batch_size every {eval_config.interval} steps"
    return f"data: {train} | held-out: {held_out}"


class MicroBatch(NamedTuple):
    inputs_BS: torch.Tensor  # int64 token ids
    labels_BS: torch.Tensor  # int64 next-token ids
    positions_S: torch.Tensor  # int64 global positions of the S tokens (RoPE and the causal mask)


def read_sidecar(path: str, key: str = "data.path") -> dict | None:
    """The JSON written next to a token file by launch/tokenize_text.py (`<path>.json`), or None.
    `key`: the config key that named the file, which errors start with."""
    sidecar = path + ".json"
    if not os.path.exists(sidecar):
        return None
    try:
        with open(sidecar, "rb") as f:
            meta = json.loads(f.read().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{key}: the sidecar {sidecar} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("dtype", "uint16") not in ("uint16", "uint32", "int32"):
        raise ValueError(f"{key}: the sidecar {sidecar} must be a JSON object with \"dtype\": \"uint16\", "
                         f"\"uint32\" or \"int32\", got {str(meta)[:80]}")
    return meta


class TokenFile(NamedTuple):
    tokens: np.ndarray  # [N] token ids (np.memmap for files)
    vocab_size: int  # from the sidecar, 0 if unknown
    doc_starts: np.ndarray | None  # int64 [D + 1] first token of each document (indexed datasets), else None


def open_bin(path: str, dtype: str = "auto", key: str = "data.path") -> TokenFile:
    """Memory-map a token file: a Megatron indexed dataset (`path` = its prefix, `.bin` or `.idx`, with
    `.idx` present; runtime/data/indexed.py) or a flat file of ids with an optional `<path>.json` sidecar.
    `key`: the config key that named the file (data.path, eval.path), which errors start with."""
    if (prefix := prefix_of(path)) is not None:
        indexed = IndexedTokens(prefix, key)
        if dtype != "auto" and np.dtype(dtype) != indexed.dtype:
            raise ValueError(f"data.dtype={dtype} but the index {prefix}.idx says {indexed.dtype}")
        if len(indexed.tokens) == 0:
            raise ValueError(f"{key}: {prefix} is empty (0 tokens)")
        vocab_size = int((read_sidecar(prefix + ".bin", key) or {}).get("vocab_size", 0))  # tokenize_text's
        return TokenFile(indexed.tokens, vocab_size, indexed.doc_starts)
    if os.path.isdir(path):
        raise ValueError(f"{key}: {path!r} is a directory; give a token file (.bin) or an indexed dataset's prefix "
                         f"(PREFIX for PREFIX.bin + PREFIX.idx)")
    if not os.path.isfile(path):
        prefix = path.removesuffix(".bin")
        raise ValueError(f"{key}: no such file {path!r} (nor an indexed dataset {prefix}.idx + {prefix}.bin)")
    meta = read_sidecar(path, key) or {}
    dtype_key = "--dtype" if key.startswith("--") else "data.dtype"  # a tool's flag, or the config key
    if not meta and _json_text(path):
        raise ValueError(f"{key}: {path} is JSON text (a rollout file for launch/posttrain.py?), not a token file: "
                         f"give token ids (launch/tokenize_text.py writes them, with a sidecar naming the dtype)")
    if dtype == "auto":
        if "dtype" not in meta:
            raise ValueError(f"{dtype_key}: 'auto' needs the sidecar {path}.json of {key}={path}; set {dtype_key} "
                             f"to uint16 or uint32")
        dtype = meta["dtype"]
    elif meta.get("dtype", dtype) != dtype:
        raise ValueError(f"{dtype_key}={dtype} but the sidecar {path}.json says {meta['dtype']}")
    itemsize, size = np.dtype(dtype).itemsize, os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{key}: {path} is empty (0 tokens)")
    if size % itemsize != 0:
        raise ValueError(f"{key}: {path} has {size} bytes, not a multiple of {itemsize} ({dtype})")
    return TokenFile(np.memmap(path, dtype=dtype, mode="r"), int(meta.get("vocab_size", 0)), None)


def _json_text(path: str) -> bool:
    """Whether the file starts like JSON text: `{` or `[` and 64 bytes of printable text, which token ids
    (uint16 / uint32, little-endian) would not be unless every id of the head had only printable bytes."""
    with open(path, "rb") as f:
        head = f.read(64)
    text = head.decode("ascii", errors="replace")
    return text.lstrip()[:1] in ("{", "[") and all(c.isprintable() or c in "\n\r\t" for c in text)


def open_tokens(config: DataConfig, key: str = "data.path") -> TokenFile | None:
    """The single source's tokens (None for synthetic; a mixture opens each of data.sources instead)."""
    if config.source == "corpus":
        return TokenFile(corpus.corpus_tokens(), corpus.VOCAB_SIZE, None)
    if config.source == "bin":
        return open_bin(config.path, config.dtype, key)
    assert config.source == "synthetic", config.source
    return None


def token_files(config: DataConfig, key: str = "data.path") -> list[tuple[str, str]]:
    """(path, the key naming it) of every token file a `bin` config reads; [] for the other sources."""
    if config.source != "bin":
        return []
    if config.sources:
        return [(s.path, f"data.sources[{i}].path") for i, s in enumerate(config.sources)]
    return [(config.path, key)]


def first_id_at_least(tokens: np.ndarray, limit: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """(position, id) of the first token id >= limit in a (memory-mapped) array, read in chunks of
    `chunk` tokens so memory stays bounded; None if there is none."""
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        if part.max() >= limit:
            offset = int(np.argmax(part >= limit))
            return start + offset, int(part[offset])
    return None


def check_token_ids(path: str, dtype: str, vocab_size: int, key: str = "data.path") -> None:
    """ValueError naming the file if any token id of a token file is >= vocab_size or negative. Scans the
    whole file once at start-up (about a second per few GB) instead of failing at the batch that holds it."""
    tokens = open_bin(path, dtype, key).tokens
    if np.issubdtype(tokens.dtype, np.signedinteger) and len(tokens) and tokens.min() < 0:
        at = int(np.argmax(np.asarray(tokens) < 0))
        raise ValueError(f"{key}: {path} holds the negative token id {int(tokens[at])} at token {at:,}")
    if np.iinfo(tokens.dtype).max < vocab_size:
        return  # no id of this dtype can reach the vocabulary size
    found = first_id_at_least(tokens, vocab_size)
    if found is not None:
        raise ValueError(f"{key}: {path} holds token id {found[1]} >= model.vocab_size={vocab_size} "
                         f"at token {found[0]:,} of {len(tokens):,}; wrong tokenizer or data.dtype?")


def split_tokens(tokens: np.ndarray | None, holdout: float, split: str) -> np.ndarray | None:
    """The `split` ("train" or "eval") part of a token array: eval is the last `holdout` fraction, which
    training then never sees; holdout 0 keeps everything for either split."""
    if tokens is None or holdout == 0:
        return tokens
    boundary = len(tokens) - int(len(tokens) * holdout)
    return tokens[:boundary] if split == "train" else tokens[boundary:]


def window_starts(seed: int, step: int, batch_size: int, num_tokens: int, seq_len: int,
                  stream: int = _DATA_STREAM) -> np.ndarray:
    """Start offsets of the global batch's windows at `step`, int64 [batch_size]; pure."""
    rng = np.random.default_rng([stream, seed, step])
    return rng.integers(0, num_tokens - seq_len, size=batch_size)  # window = seq_len + 1 tokens


class Part(NamedTuple):
    """The tokens one loader reads from one source: its split of the file, and where that came from."""
    name: str  # the source's name (mixtures), else ""
    tokens: np.ndarray  # [N'] this split's tokens
    doc_starts: np.ndarray | None  # [D' + 1] this split's document starts (None: not recorded)
    file_tokens: int  # tokens in the whole file
    vocab_size: int  # from the sidecar or the corpus, 0 if unknown
    describe: str  # e.g. "bin data/x (uint16): 1,234 tokens, 5 documents"


def split_documents(doc_starts: np.ndarray | None, n: int, holdout: float, split: str) -> np.ndarray | None:
    """Document starts [D' + 1] of `split_tokens`' part of n tokens: the document cut by the boundary
    counts in both parts (its tail starts the eval part)."""
    if doc_starts is None or holdout == 0:
        return doc_starts
    boundary = n - int(n * holdout)
    if split == "train":
        return np.concatenate([doc_starts[doc_starts < boundary], [boundary]])
    return np.concatenate([[0], doc_starts[doc_starts > boundary] - boundary])


def open_part(config: DataConfig, key: str, holdout: float, split: str, name: str = "") -> Part:
    """One token source of a non-synthetic config (data.path or the corpus), split for `split`."""
    file = open_tokens(config, key)
    tokens = split_tokens(file.tokens, holdout, split)
    docs = split_documents(file.doc_starts, len(file.tokens), holdout, split)
    what = "corpus (bundled byte-level text)" if config.source == "corpus" else f"bin {config.path} ({tokens.dtype})"
    documents = "documents not recorded" if docs is None else f"{len(file.doc_starts) - 1:,} documents"
    return Part(name, tokens, docs, len(file.tokens), file.vocab_size,
                f"{what}: {len(file.tokens):,} tokens, {documents}")


class Loader:
    """This rank's micro-batches of each optimizer step; `state_dict()` is the next step to load."""

    def __init__(self, config: DataConfig, seed: int, *, dp_rank: int = 0, dp_degree: int = 1, cp_rank: int = 0,
                 cp_degree: int = 1, grad_accum: int = 1, vocab_size: int | None = None, holdout: float = 0.0,
                 split: str = "train", path_key: str = "data.path", say=None):
        """`vocab_size` is the model's: required for `synthetic`, checked against the source otherwise.
        `split`/`holdout`: see `split_tokens`; the eval split also draws its windows from its own stream.
        `path_key`: the config key that named config.path, which errors about the file start with.
        `say(line)`: where a mixture notes a source that wraps around (None: silent)."""
        check_split(config, dp_degree, cp_degree, grad_accum)
        assert 0 <= dp_rank < dp_degree and 0 <= cp_rank < cp_degree, (dp_rank, dp_degree, cp_rank, cp_degree)
        self.config, self.seed, self.grad_accum, self.step = config, seed, grad_accum, 0
        self.rows = config.batch_size // (grad_accum * dp_degree)  # B
        self.first_row = dp_rank * self.rows
        self.positions_S = load_balanced_positions(config.seq_len, cp_degree, cp_rank)
        self.holdout, self.split = holdout, split.partition("/")[0]  # "eval/<name>": a mixture source's held-out part
        self.part = f"the {split} part (eval.holdout={holdout}) of " if holdout else ""
        self.stream = _DATA_STREAM if split == "train" else _EVAL_STREAM
        self.model_vocab = vocab_size
        self.path_key = path_key
        self.parts = self._open_parts(path_key)
        self.tokens = self.parts[0].tokens if len(self.parts) == 1 else None  # single source
        source_vocab = max((p.vocab_size for p in self.parts), default=0)
        self.vocab_size = vocab_size if config.source == "synthetic" else source_vocab
        self._check_sizes(source_vocab, vocab_size)
        self.mixture = None
        if config.sources:
            self.mixture = Mixture([p.name for p in self.parts], [len(p.tokens) for p in self.parts],
                                   [s.weight for s in config.sources], config.batch_size, config.seq_len, seed, say)

    def _open_parts(self, path_key: str) -> list[Part]:
        c = self.config
        if c.source == "synthetic":
            return []
        if not c.sources:
            return [open_part(c, path_key, self.holdout, self.split)]
        return [open_part(dataclasses.replace(c, sources=(), path=s.path), f"data.sources[{i}].path", self.holdout,
                          self.split, s.label()) for i, s in enumerate(c.sources)]

    def _check_sizes(self, source_vocab: int, model_vocab: int | None) -> None:
        if self.config.source == "synthetic" and not model_vocab:
            raise ValueError("data.source 'synthetic' needs the model's vocab_size")
        if model_vocab and source_vocab > model_vocab:
            raise ValueError(f"data: the {self.config.source} source has vocab size {source_vocab} but "
                             f"model.vocab_size={model_vocab}")
        for i, part in enumerate(self.parts):
            if self.config.document_mask and part.doc_starts is None:
                key = f"data.sources[{i}].path" if part.name else self.path_key
                raise ValueError(f"data.document_mask: {key} is a flat token file without document boundaries; "
                                 f"write a Megatron indexed dataset (launch/tokenize_text.py --format indexed)")
            if len(part.tokens) < self.config.seq_len + 1:
                what = f"data.sources[{i}] ({part.name!r})" if part.name else f"the {self.config.source} source"
                raise ValueError(f"data.seq_len={self.config.seq_len} needs windows of {self.config.seq_len + 1} "
                                 f"tokens but {self.part}{what} has only {len(part.tokens)}")

    def describe(self) -> str:
        """What this loader reads, for the start-up line: source, file, tokens, documents, split."""
        if self.config.source == "synthetic":
            return f"synthetic: uniform random ids < {self.vocab_size} (the {self.split} stream)"
        if self.split == "eval" and self.holdout:
            return f"the last {len(self.parts[0].tokens):,} tokens of the training source (eval.holdout={self.holdout})"
        if not self.mixture:
            part = self.parts[0]
            return part.describe + (f"; training reads the first {len(part.tokens):,}" if self.holdout else "")
        total = math.fsum(s.weight for s in self.config.sources)
        held = f", the last {self.holdout:.0%} of each held out" if self.holdout else ""
        return f"mixture of {len(self.parts)} sources{held}: " + "; ".join(
            f"{p.name} {s.weight / total:.1%} = {p.describe}" for p, s in zip(self.parts, self.config.sources))

    def tokens_by_source(self, step: int) -> dict[str, int]:
        """Cumulative label tokens per source name over steps 0..step (mixtures; {} otherwise)."""
        return self.mixture.tokens_by_source(step) if self.mixture else {}

    def batch(self, step: int) -> list[MicroBatch]:
        """The `grad_accum` micro-batches of `step` for this rank; a pure function of (config, seed, step).
        With data.document_mask: DocumentMicroBatch (runtime/data/documents.py) instead."""
        windows_BW = self._windows(step)  # W = L + 1; this rank's rows of the step, micro-batch-major
        pos_S = self.positions_S
        if self.config.document_mask:
            doc_BW, global_labels = self._documents(step)
            return document_micro_batches(windows_BW, doc_BW, pos_S, self.rows, global_labels)
        return [MicroBatch(w_BW[:, :-1][:, pos_S], w_BW[:, 1:][:, pos_S], pos_S)
                for w_BW in windows_BW.split(self.rows)]

    def _documents(self, step: int) -> tuple[np.ndarray, int]:
        """(window document ids [rows, W] of this rank's rows, trained labels of the whole step)."""
        part_B, start_B = self._draws(step)
        rows, width, L = self._global_rows(), self.config.seq_len + 1, self.config.seq_len
        doc_BW = np.empty((len(rows), width), dtype=np.int64)
        crossing = 0
        for p, part in enumerate(self.parts):
            mine, every = np.flatnonzero(part_B[rows] == p), part_B == p
            doc_BW[mine] = window_documents(part.doc_starts, start_B[rows][mine], width)
            crossing += crossing_labels(part.doc_starts, start_B[every], L)
        return doc_BW, self.config.batch_size * L - crossing

    def _draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source part [B], window start [B]) of every global row of `step` (token sources only)."""
        if self.mixture is not None:
            return self.mixture.draws(step)
        starts = window_starts(self.seed, step, self.config.batch_size, len(self.tokens), self.config.seq_len,
                               self.stream)
        return np.zeros(len(starts), dtype=np.int64), starts

    def _global_rows(self) -> np.ndarray:
        per_micro = self.config.batch_size // self.grad_accum
        return np.concatenate([m * per_micro + self.first_row + np.arange(self.rows) for m in range(self.grad_accum)])

    def _windows(self, step: int) -> torch.Tensor:
        rows, length = self._global_rows(), self.config.seq_len + 1
        if self.config.source == "synthetic":
            windows = [np.random.default_rng([self.stream, self.seed, step, r]).integers(0, self.vocab_size, length)
                       for r in rows]
        else:
            part_B, start_B = self._draws(step)
            windows = [self.parts[part_B[r]].tokens[start_B[r]:start_B[r] + length] for r in rows]
        windows = np.stack(windows).astype(np.int64)
        if self.model_vocab and windows.max(initial=0) >= self.model_vocab:  # wrong dtype or tokenizer
            raise ValueError(f"data: token id {windows.max()} in the {self.config.source} source at step {step} "
                             f">= model.vocab_size={self.model_vocab}")
        return torch.from_numpy(windows)

    def next_step(self) -> list[MicroBatch]:
        """The micro-batches of the next step; advances the position saved in checkpoints."""
        micro = self.batch(self.step)
        self.step += 1
        return micro

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def record(self) -> dict:
        """What a checkpoint records of the data read beyond the config (nothing: the token sources' settings
        are recorded with the config, runtime/eval_config.recorded_settings)."""
        return {}

    def changes(self, saved: dict) -> str | None:
        """A line naming how the data changed since the checkpoint `saved`: the config's settings say it."""
        return None
