"""A Hugging Face tokenizer directory as the launch tools use it: tokenizer.json (read with the `tokenizers`
package, nothing downloaded), its special-token ids, and the files an export copies so that the export
serves on its own.

    special_ids(dir, tokenizer) -> {"bos_token_id": id, "eos_token_id": id}   (those that are known)
    copy_tokenizer(dir, out) -> names of the files copied

Ids come from the directory's generation_config.json when it has one (what `transformers` generation
reads), else from tokenizer_config.json's `bos_token` / `eos_token` looked up in tokenizer.json or in its
`added_tokens_decoder`. An export also carries tokenizers without a tokenizer.json (Kimi K2's tiktoken.model
with its tokenization_*.py code, loaded with trust_remote_code); launch/generate.py needs tokenizer.json.
"""

import json
import os
import shutil

from launch.tokenize_text import load_tokenizer

# Files of a tokenizer directory an export carries (those present are copied): the tokenizer itself, its
# configuration (special tokens, the chat template of older exports), the chat template file of newer
# ones, the vocabulary files of slow / tiktoken tokenizers, and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "tiktoken.model",
                   "vocab.json", "merges.txt", "generation_config.json")
SPECIAL = ("bos", "eos")
VOCABULARIES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")  # one makes a tokenizer dir


def tokenizer_path(directory: str, flag: str = "--tokenizer") -> str:
    """`directory`/tokenizer.json; ValueError naming `flag` when the directory or the file is missing."""
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {directory}: {'not a directory' if os.path.exists(directory) else 'no such directory'}")
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {directory}: no tokenizer.json (a Hugging Face tokenizer directory holds one)")
    return path


def load(directory: str, flag: str = "--tokenizer"):
    """The `tokenizers.Tokenizer` of `directory` (ValueError in one line otherwise)."""
    return load_tokenizer(tokenizer_path(directory, flag))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def special_ids(directory: str, tokenizer) -> dict[str, int | list[int]]:
    """{"bos_token_id": ..., "eos_token_id": ...}, each only when the directory says which token it is."""
    ids = {}
    generation = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation):
        raw = _read_json(generation)
        ids.update({f"{s}_token_id": raw[f"{s}_token_id"] for s in SPECIAL if raw.get(f"{s}_token_id") is not None})
    config = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config):
        raw = _read_json(config)
        for s in SPECIAL:
            token = raw.get(f"{s}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if f"{s}_token_id" not in ids and isinstance(token, str) and _token_id(token, tokenizer, raw) is not None:
                ids[f"{s}_token_id"] = _token_id(token, tokenizer, raw)
    return ids


def _token_id(token: str, tokenizer, config: dict) -> int | None:
    """The id of `token`: from tokenizer.json when loaded, else tokenizer_config.json's added_tokens_decoder."""
    if tokenizer is not None:
        return tokenizer.token_to_id(token)
    added = config.get("added_tokens_decoder", {})
    return next((int(i) for i, t in added.items() if isinstance(t, dict) and t.get("content") == token), None)


def eos_ids(directory: str, tokenizer) -> tuple[int, ...]:
    """The end-of-sequence ids generation stops at (none known: an empty tuple)."""
    eos = special_ids(directory, tokenizer).get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def check_directory(directory: str) -> None:
    """ValueError naming --tokenizer unless `directory` holds a vocabulary file (VOCABULARIES)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--tokenizer {directory}: {'not a directory' if os.path.exists(directory) else 'no such directory'}")
    if not any(os.path.isfile(os.path.join(directory, name)) for name in VOCABULARIES):
        raise ValueError(f"--tokenizer {directory}: no tokenizer files (none of {', '.join(VOCABULARIES)})")


def copy_tokenizer(directory: str, out: str) -> list[str]:
    """Copy the tokenizer files of `directory` (and its tokenization_*.py code) into `out`."""
    check_directory(directory)
    copied = []
    code = sorted(n for n in os.listdir(directory) if n.startswith("tokenization_") and n.endswith(".py"))
    for name in TOKENIZER_FILES + tuple(code):
        if os.path.isfile(os.path.join(directory, name)):
            shutil.copyfile(os.path.join(directory, name), os.path.join(out, name))
            copied.append(name)
    return copied


def export_ids(directory: str, vocab_size: int) -> dict:
    """The bos/eos ids config.json states for an export with the tokenizer of `directory` (None when unknown:
    `transformers` would otherwise assume bos 0 and eos 1); ValueError when the tokenizer's ids do not fit
    the model's embedding (`vocab_size`)."""
    check_directory(directory)
    tokenizer = load(directory) if os.path.isfile(os.path.join(directory, "tokenizer.json")) else None
    size = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else 0
    if size > vocab_size:
        raise ValueError(f"--tokenizer {directory}: {size} tokens but the model's vocab_size is {vocab_size}")
    return {"bos_token_id": None, "eos_token_id": None, **special_ids(directory, tokenizer)}


def write_tokenizer(directory: str, out: str, ids: dict) -> list[str]:
    """Copy the tokenizer files into the export `out` and, unless one was copied, write a
    generation_config.json with the known ids; returns the names written."""
    written = copy_tokenizer(directory, out)
    if "generation_config.json" not in written:
        generation = {k: v for k, v in ids.items() if v is not None}
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=2)
        written.append("generation_config.json")
    return written
