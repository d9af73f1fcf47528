"""A local tokenizer, from a `tokenizer.json` file or a Hugging Face tokenizer directory, for our tools.

    tokenizer = load_tokenizer(path, trust_remote_code=False)
    tokenizer.get_vocab_size(with_added_tokens=True); tokenizer.token_to_id(token) -> int | None
    tokenizer.encode(text, add_special_tokens=False).ids -> list[int]
    with ParallelEncoder(tokenizer, workers) as encoder: encoder.map(texts) -> token ids of each text, in order

Sources, in this order: a `tokenizer.json` file, or a directory holding one (the `tokenizers` package);
otherwise a directory that `transformers.AutoTokenizer` loads from its `tokenizer_config.json`. Kimi K2 /
K2.5 ship the second kind: `tiktoken.model` + `tokenization_kimi.py` (custom code named by the config's
`auto_map`), which runs only with `trust_remote_code=True`; without it the load is refused in one line.
Nothing is downloaded. Both kinds answer the `tokenizers.Tokenizer` calls above, so a tool written for
one reads the other. Special-token strings in the text encode as their ids in both (as `tokenizers` and
Kimi's tokenizer do). `ParallelEncoder` forks worker processes that inherit the loaded tokenizer; the
ids come back in input order, so the output is the same for any number of workers.
"""

import itertools
import json
import multiprocessing
import os
from dataclasses import dataclass

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer at `path` (file or directory); ValueError (one line, starting with --tokenizer) otherwise."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
            return _tokenizers_file(os.path.join(path, TOKENIZER_JSON))
        if os.path.isfile(os.path.join(path, TOKENIZER_CONFIG)):
            return _auto_tokenizer(path, trust_remote_code)
        raise ValueError(f"--tokenizer: {path} is a directory; give the tokenizer.json file or a Hugging Face "
                         f"tokenizer directory (it has neither {TOKENIZER_JSON} nor {TOKENIZER_CONFIG})")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer: no such file {path}")
    return _tokenizers_file(path)


def _tokenizers_file(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        raise ValueError(f"--tokenizer: {path} is not a valid tokenizer.json ({str(e).splitlines()[0][:120]})") from None


def custom_code(directory: str) -> str | None:
    """The custom tokenizer class `tokenizer_config.json` asks AutoTokenizer to import (auto_map), or None."""
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--tokenizer: {directory}/{TOKENIZER_CONFIG} is not readable JSON ({e})") from None
    auto = (config.get("auto_map") or {}).get("AutoTokenizer")
    names = [auto] if isinstance(auto, str) else [n for n in auto or [] if n]
    return names[0] if names else None


def _auto_tokenizer(directory: str, trust_remote_code: bool) -> "AutoTokenizerAdapter":
    code = custom_code(directory)
    if code and not trust_remote_code:
        raise ValueError(f"--tokenizer: {directory} loads its tokenizer with custom code ({code}, from "
                         f"{TOKENIZER_CONFIG} auto_map); pass --trust-remote-code to run it")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # whatever the tokenizer's own code raises: name it in one line
        raise ValueError(f"--tokenizer: {directory} does not load with transformers.AutoTokenizer "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    return AutoTokenizerAdapter(tokenizer)


@dataclass
class Encoding:
    ids: list[int]


class AutoTokenizerAdapter:
    """A transformers tokenizer behind the `tokenizers.Tokenizer` calls our tools make."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.tokenizer) if with_added_tokens else self.tokenizer.vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of an added/special token, or of a string that is exactly one token; None otherwise."""
        added = self.tokenizer.added_tokens_encoder
        if token in added:
            return added[token]
        ids = self.encode(token).ids
        return ids[0] if len(ids) == 1 else None

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        return Encoding(list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))


_WORKER_TOKENIZER = None  # set in the parent right before forking: the workers inherit it


def _encode(text: str) -> list[int]:
    return _WORKER_TOKENIZER.encode(text, add_special_tokens=False).ids


class ParallelEncoder:
    """Encode texts on `workers` forked processes (1 = in this process), results in input order."""

    def __init__(self, tokenizer, workers: int = 1):
        if workers < 1:
            raise ValueError(f"--workers {workers}: must be >= 1")
        self.tokenizer, self.workers, self.pool = tokenizer, workers, None

    def __enter__(self) -> "ParallelEncoder":
        global _WORKER_TOKENIZER
        if self.workers > 1:
            _WORKER_TOKENIZER = self.tokenizer
            self.pool = multiprocessing.get_context("fork").Pool(self.workers)
        return self

    def __exit__(self, *exc) -> None:
        global _WORKER_TOKENIZER
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()
        _WORKER_TOKENIZER = None

    def map(self, texts):
        """Token ids of each text of the iterable `texts`, in order; at most 4 texts per worker in flight
        (Pool.imap would read the whole iterable ahead, i.e. a whole input file into memory)."""
        texts = iter(texts)
        if self.pool is None:
            yield from (self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts)
            return
        while batch := list(itertools.islice(texts, 4 * self.workers)):
            yield from self.pool.map(_encode, batch, chunksize=1)
