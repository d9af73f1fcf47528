"""Megatron indexed datasets (runtime/data/indexed.py) against megatron-core's own IndexedDatasetBuilder and
IndexedDataset (megatron.core.datasets.indexed_dataset, the `test` extra), both directions; bad files
fail in one line naming the file."""

import os
import struct
import warnings

import numpy as np
import pytest
import torch

from runtime.data.indexed import IndexedTokens, IndexedWriter, prefix_of
from word_tokenizer import _tiny_tokenizer


def _documents(seed=0, n=40, vocab=50000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, 60)) for _ in range(n)]


@pytest.fixture(scope="module")
def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": not needed here
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_written_by_megatron_read_back_to_the_same_documents(tmp_path, megatron, dtype):
    """Megatron's documents of several sequences (sentence splitting) and of one (add_item + end_document)."""
    docs, prefix = _documents(), str(tmp_path / "mega")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, doc in enumerate(docs):
        if i % 2:
            cut = len(doc) // 2
            builder.add_document(torch.from_numpy(doc), [cut, len(doc) - cut])
        else:
            builder.add_item(torch.from_numpy(doc))
            builder.end_document()
    builder.finalize(prefix + ".idx")
    ours = IndexedTokens(prefix)
    assert len(ours) == len(docs) and ours.dtype == np.dtype(dtype)
    for i, doc in enumerate(docs):
        assert np.array_equal(ours.document(i), doc), i
    assert prefix_of(prefix + ".bin") == prefix_of(prefix) == prefix and prefix_of(str(tmp_path / "none.bin")) is None


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_written_here_read_in_megatron_to_the_same_documents(tmp_path, megatron, dtype):
    docs, prefix = _documents(1), str(tmp_path / "ours")
    writer = IndexedWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    theirs = megatron.IndexedDataset(prefix)
    assert len(theirs) == len(docs) and len(theirs.document_indices) == len(docs) + 1
    for i, doc in enumerate(docs):
        assert theirs[i].dtype == np.dtype(dtype) and np.array_equal(theirs[i], doc), i
    assert not os.path.exists(prefix + ".bin.tmp") and not os.path.exists(prefix + ".idx.tmp")


def _write(prefix, docs, dtype=np.uint16):
    writer = IndexedWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()


def _patch(path, offset, fmt, value):
    data = bytearray(open(path, "rb").read())
    data[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: os.remove(p + ".idx"), "no such file {p}.idx"),
    (lambda p: os.remove(p + ".bin"), "no such file {p}.bin"),
    (lambda p: open(p + ".idx", "wb").write(b"garbage"), "not a Megatron index"),
    (lambda p: _patch(p + ".idx", 17, "<B", 4), "{p}.bin: 20 bytes, but its index {p}.idx lists 10 int32 tokens"),
    (lambda p: _patch(p + ".idx", 17, "<B", 7), "dtype code 7 is not an integer token dtype"),
    (lambda p: _patch(p + ".idx", 9, "<Q", 2), "index version 2, expected 1"),
    (lambda p: _patch(p + ".idx", 18, "<Q", 5), "but 5 sequences and 4 document indices need"),
    (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "{p}.bin: 22 bytes, but its index {p}.idx lists 10 uint16"),
    (lambda p: _patch(p + ".idx", 34 + 12 * 3 + 16, "<q", 0), "document indices must rise from 0 to the sequence count 3"),
    (lambda p: _patch(p + ".idx", 34 + 12 + 8, "<q", 6), "sequence 1 points to byte 6, expected 4"),
])
def test_bad_index_files_fail_in_one_line_naming_the_file(tmp_path, damage, message):
    prefix = str(tmp_path / "d")
    _write(prefix, [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10]])
    damage(prefix)
    with pytest.raises(ValueError) as error:
        IndexedTokens(prefix, key="data.sources[1].path")
    text = str(error.value)
    assert text.startswith("data.sources[1].path: ") and message.format(p=prefix) in text and "\n" not in text, text


@pytest.mark.parametrize("unit, documents", [
    ("file", ["the cat sat on the mat", "a cat dog"]),
    ("line", ["the cat sat", "on the mat", "a cat dog"]),
    ("jsonl", ["the cat", "sat on mat"]),
])
def test_tokenize_text_writes_indexed_documents_the_loader_reads(tmp_path, unit, documents):
    from launch.tokenize_text import main

    from runtime.data.loader import open_bin

    ids = _tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    if unit == "jsonl":
        (tmp_path / "a.txt").write_text('{"text": "the cat"}\n\n{"text": "sat on mat", "id": 7}\n')
        inputs = [str(tmp_path / "a.txt")]
    else:
        (tmp_path / "a.txt").write_text("the cat sat\n\non the mat\n")
        (tmp_path / "b.txt").write_text("a cat dog\n")
        inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    prefix = str(tmp_path / "train")
    argv = ["--tokenizer", str(tmp_path / "tokenizer.json"), "--out", prefix + ".bin", "--format", "indexed",
            "--document", unit, "--eos", "<eos>", *inputs]
    assert main(argv) == 0
    if unit == "line":  # tokenizing processes change nothing (the ParallelEncoder keeps the order)
        assert main([*argv[:3], prefix + "_w2.bin", *argv[4:], "--workers", "2"]) == 0
        for ext in (".bin", ".idx"):
            assert open(prefix + ext, "rb").read() == open(prefix + "_w2" + ext, "rb").read()
    read = IndexedTokens(prefix)
    expected = [[ids.get(w, 0) for w in doc.split()] + [ids["<eos>"]] for doc in documents]
    assert [read.document(i).tolist() for i in range(len(read))] == expected
    file = open_bin(prefix)  # data.path = the prefix: the loader's view, vocab from the sidecar
    assert file.vocab_size == 8 and file.doc_starts.tolist() == np.cumsum([0] + [len(d) for d in expected]).tolist()


def test_tokenize_text_refuses_bad_jsonl_and_document_without_indexed(tmp_path, capsys):
    from launch.tokenize_text import main

    _tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.jsonl").write_text('{"text": "the cat"}\n{"txt": "x"}\n')
    base = ["--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "o")]
    assert main(base + ["--format", "indexed", "--document", "jsonl", str(tmp_path / "a.jsonl")]) == 2
    assert main(base + ["--document", "line", str(tmp_path / "a.jsonl")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {tmp_path}/a.jsonl line 2: expected an object with a string \"text\"",
                   "error: --document line applies to --format indexed only (a flat .bin records no documents)"], err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "tokenizer.json"]  # nothing written
