"""A tiny word-level `tokenizers` tokenizer.json for the text-tokenizing tests (tests/unit/test_data.py,
tests/unit/test_indexed.py): skips the test when the `tokenizers` package is missing."""

import pytest


def _tiny_tokenizer(path, extra_words=0):
    tokenizers = pytest.importorskip("tokenizers", reason="launch/tokenize_text.py needs the `tokenizers` package")
    words = ["[UNK]", "<eos>", "the", "cat", "sat", "on", "mat", "a"] + [f"w{i}" for i in range(extra_words)]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(path)
    return vocab
