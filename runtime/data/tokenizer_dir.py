"""A local tokenizer, from a `tokenizer.json` file or a Hugging Face tokenizer directory, for every tool.

    tokenizer = load_tokenizer(path, trust_remote_code=False)      # a file or a directory (tokenize_text)
    tokenizer = load_directory(directory, trust_remote_code=False) # a directory (generate, export_hf)
    tokenizer.get_vocab_size(with_added_tokens=True); tokenizer.token_to_id(token) -> int | None
    tokenizer.encode(text, add_special_tokens=False).ids -> list[int]; tokenizer.decode(ids) -> str
    special_ids(directory, tokenizer) -> {"bos_token_id": id, "eos_token_id": id}   (those that are known)
    load_transformers(directory, trust_remote_code=False) -> the transformers tokenizer (chat templates)
    with ParallelEncoder(tokenizer, workers) as encoder: encoder.map(texts) -> token ids of each text, in order

Sources, in this order: a `tokenizer.json` file, or a directory holding one (the `tokenizers` package);
otherwise a directory that `transformers.AutoTokenizer` loads from its `tokenizer_config.json`. Kimi K2 /
K2.5 ship the second kind: `tiktoken.model` + `tokenization_kimi.py` (custom code named by the config's
`auto_map`), which runs only with `trust_remote_code=True`; without it the load is refused in one line
naming --trust-remote-code. Nothing is downloaded. Both kinds answer the `tokenizers.Tokenizer` calls
above, so a tool written for one reads the other. Special-token strings in the text encode as their ids
in both (as `tokenizers` and Kimi's tokenizer do). Special ids come from the directory's
generation_config.json when it has one (what `transformers` generation reads), else from
tokenizer_config.json's `bos_token` / `eos_token` looked up in the tokenizer. `ParallelEncoder` forks
worker processes that inherit the loaded tokenizer; the ids come back in input order, so the output is
the same for any number of workers.
"""

import itertools
import json
import multiprocessing
import os
from dataclasses import dataclass

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL = ("bos", "eos")


def load_tokenizer(path: str, trust_remote_code: bool = False, flag: str = "--tokenizer"):
    """The tokenizer at `path` (file or directory); ValueError (one line, starting with `flag`) otherwise."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
            return _tokenizers_file(os.path.join(path, TOKENIZER_JSON), flag)
        if os.path.isfile(os.path.join(path, TOKENIZER_CONFIG)):
            return AutoTokenizerAdapter(load_transformers(path, trust_remote_code, flag))
        raise ValueError(f"{flag}: {path} is a directory; give the tokenizer.json file or a Hugging Face "
                         f"tokenizer directory (it has neither {TOKENIZER_JSON} nor {TOKENIZER_CONFIG})")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file {path}")
    return _tokenizers_file(path, flag)


def load_directory(directory: str, trust_remote_code: bool = False, flag: str = "--tokenizer"):
    """The tokenizer of the tokenizer DIRECTORY `directory` (tools that also read its generation_config.json
    and tokenizer_config.json: special_ids); ValueError naming `flag` for a file or a missing path."""
    _check_directory(directory, flag)
    return load_tokenizer(directory, trust_remote_code, flag)


def load_transformers(directory: str, trust_remote_code: bool = False, flag: str = "--tokenizer"):
    """`transformers.AutoTokenizer` of the local directory (for its chat template, added tokens...), refused in
    one line when its tokenizer_config.json names custom code and `trust_remote_code` is False."""
    _check_directory(directory, flag)
    code = custom_code(directory, flag) if os.path.isfile(os.path.join(directory, TOKENIZER_CONFIG)) else None
    if code and not trust_remote_code:
        raise ValueError(f"{flag}: {directory} loads its tokenizer with custom code ({code}, from "
                         f"{TOKENIZER_CONFIG} auto_map); pass --trust-remote-code to run it")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # whatever transformers or the tokenizer's own code raises: name it in one line
        raise ValueError(f"{flag}: {directory} does not load with transformers.AutoTokenizer "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None


def _check_directory(directory: str, flag: str) -> None:
    if not os.path.isdir(directory):
        what = "not a directory" if os.path.exists(directory) else "no such directory"
        raise ValueError(f"{flag} {directory}: {what} (give the model's tokenizer directory)")


def _tokenizers_file(path: str, flag: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        raise ValueError(f"{flag}: {path} is not a valid tokenizer.json ({str(e).splitlines()[0][:120]})") from None


def custom_code(directory: str, flag: str = "--tokenizer") -> str | None:
    """The custom tokenizer class `tokenizer_config.json` asks AutoTokenizer to import (auto_map), or None."""
    config = read_json(os.path.join(directory, TOKENIZER_CONFIG), flag)
    auto = (config.get("auto_map") or {}).get("AutoTokenizer")
    names = [auto] if isinstance(auto, str) else [n for n in auto or [] if n]
    return names[0] if names else None


def read_json(path: str, flag: str = "--tokenizer") -> dict:
    """The JSON object in `path`; ValueError naming `flag` and the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: {path} is not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: {path} is not a JSON object")
    return value


def generation_ids(directory: str, flag: str = "--tokenizer") -> dict:
    """bos_token_id / eos_token_id (an id or a list of ids) of `directory`/generation_config.json, those set."""
    path = os.path.join(directory, "generation_config.json")
    raw = read_json(path, flag) if os.path.isfile(path) else {}
    return {f"{s}_token_id": raw[f"{s}_token_id"] for s in SPECIAL if raw.get(f"{s}_token_id") is not None}


def special_ids(directory: str, tokenizer, flag: str = "--tokenizer") -> dict:
    """{"bos_token_id": ..., "eos_token_id": ...}, each only when the directory says which token it is: its
    generation_config.json (what `transformers` generation reads), else tokenizer_config.json's `bos_token` /
    `eos_token` looked up in the loaded `tokenizer`."""
    ids = generation_ids(directory, flag)
    config = os.path.join(directory, TOKENIZER_CONFIG)
    raw = read_json(config, flag) if os.path.isfile(config) else {}
    for s in SPECIAL:
        token = raw.get(f"{s}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if f"{s}_token_id" not in ids and isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            ids[f"{s}_token_id"] = tokenizer.token_to_id(token)
    return ids


def eos_ids(directory: str, tokenizer, flag: str = "--tokenizer") -> tuple[int, ...]:
    """The end-of-sequence ids generation stops at (none known: an empty tuple)."""
    eos = special_ids(directory, tokenizer, flag).get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


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

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


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
