"""The tokenizer files an export carries, so that the export serves on its own (launch/export_hf.py).

    export_ids(dir, vocab_size, trust_remote_code) -> {"bos_token_id": id | None, "eos_token_id": id | None}
    write_tokenizer(dir, out, ids) -> names of the files written

The tokenizer is loaded (runtime/data/tokenizer_dir.py: tokenizer.json, or Kimi K2's tiktoken.model with its
tokenization_*.py code, which needs --trust-remote-code) to check that its ids fit the model and to look up
the bos/eos ids; then its files, the code included, are copied as they are.
"""

import json
import os
import shutil

from runtime.data import tokenizer_dir

# Files of a tokenizer directory an export carries (those present are copied): the tokenizer itself, its
# configuration (special tokens, the chat template of older exports), the chat template file of newer
# ones, the vocabulary files of slow / tiktoken tokenizers, and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "tiktoken.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def copy_tokenizer(directory: str, out: str) -> list[str]:
    """Copy the tokenizer files of `directory` (and its tokenization_*.py code) into `out`."""
    copied = []
    code = sorted(n for n in os.listdir(directory) if n.startswith("tokenization_") and n.endswith(".py"))
    for name in TOKENIZER_FILES + tuple(code):
        if os.path.isfile(os.path.join(directory, name)):
            shutil.copyfile(os.path.join(directory, name), os.path.join(out, name))
            copied.append(name)
    return copied


def export_ids(directory: str, vocab_size: int, trust_remote_code: bool = False) -> dict:
    """The bos/eos ids config.json states for an export with the tokenizer of `directory` (None when unknown:
    `transformers` would otherwise assume bos 0 and eos 1); ValueError when the tokenizer does not load or
    its ids do not fit the model's embedding (`vocab_size`)."""
    tokenizer = tokenizer_dir.load_directory(directory, trust_remote_code)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"--tokenizer {directory}: {size} tokens but the model's vocab_size is {vocab_size}")
    return {"bos_token_id": None, "eos_token_id": None, **tokenizer_dir.special_ids(directory, tokenizer)}


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
