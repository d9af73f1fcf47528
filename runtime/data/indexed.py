"""Megatron indexed datasets: a `.bin` of token ids plus a `.idx` index (the `MMIDIDX` format), read by
memory map and written by `IndexedWriter` (launch/tokenize_text.py --format indexed).

The `.idx` layout, little-endian, as megatron-core's `megatron/core/datasets/indexed_dataset.py` writes it
(`_IndexWriter`; tests/unit/test_indexed.py checks both directions against megatron-core itself):

    9 bytes  b"MMIDIDX\\x00\\x00"          header
    uint64   1                           version
    uint8    dtype code                  1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    uint64   sequence count N
    uint64   document-index count D + 1
    int32    [N] sequence lengths         (tokens)
    int64    [N] sequence pointers        (byte offsets into the .bin)
    int64    [D + 1] document indices     (sequence index where each document starts; 0 first, N last)
    (int8 [N] sequence modes: multimodal datasets only, not read here)

A document is the run of sequences between two consecutive document indices (Megatron's preprocessing
writes one sequence per document unless it splits sentences). twinmesh reads the `.bin` as one flat token
array (so the pointers must be contiguous, as every Megatron builder writes them) and keeps each
document's first token offset: `doc_starts` [D + 1], int64, last = the token count.
"""

import json
import os
import struct
from collections.abc import Iterator

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
TOKEN_CODES = {np.dtype(t).name: code for code, t in DTYPE_CODES.items() if np.issubdtype(t, np.integer)}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # 34 bytes before the arrays


def prefix_of(path: str) -> str | None:
    """The dataset prefix if `path` names an indexed dataset (`P`, `P.bin` or `P.idx` with `P.idx` present)."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    return prefix if os.path.isfile(prefix + ".idx") else None


class IndexedTokens:
    """An indexed dataset as flat tokens [N] (np.memmap of its .bin) and document starts [D + 1] (int64)."""

    def __init__(self, prefix: str, key: str = "data.path"):
        """ValueError naming `key` and the file on a missing, malformed or mismatched .idx/.bin."""
        self.prefix, self.key = prefix, key
        idx, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"{key}: indexed dataset {prefix}: no such file {path}")
        dtype, lengths, pointers, doc_index = self._read_index(idx)
        self.dtype = np.dtype(dtype)
        total = int(lengths.sum(dtype=np.int64))
        self._check_bin(bin_path, lengths, pointers, total)
        self._check_documents(idx, doc_index, len(lengths))
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if total else np.zeros(0, self.dtype)
        seq_starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.doc_starts = seq_starts[doc_index]

    def _fail(self, path: str, what: str):
        raise ValueError(f"{self.key}: {path}: {what}")

    def _read_index(self, idx: str):
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(_FIXED)
        if len(head) < _FIXED or head[:9] != HEADER:
            self._fail(idx, f"not a Megatron index (expected the header {HEADER!r} and {_FIXED} bytes, got "
                            f"{head[:9]!r}, {size} bytes)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            self._fail(idx, f"index version {version}, expected 1")
        if code not in DTYPE_CODES or not np.issubdtype(DTYPE_CODES[code], np.integer):
            self._fail(idx, f"dtype code {code} is not an integer token dtype (valid: {sorted(TOKEN_CODES.values())})")
        need = _FIXED + 12 * n_seq + 8 * n_doc
        if size not in (need, need + n_seq):  # + n_seq: the int8 modes of a multimodal index
            self._fail(idx, f"{size} bytes, but {n_seq} sequences and {n_doc} document indices need {need}")
        lengths = np.memmap(idx, np.int32, "r", _FIXED, (n_seq,)) if n_seq else np.zeros(0, np.int32)
        pointers = np.memmap(idx, np.int64, "r", _FIXED + 4 * n_seq, (n_seq,)) if n_seq else np.zeros(0, np.int64)
        doc_index = np.memmap(idx, np.int64, "r", _FIXED + 12 * n_seq, (n_doc,)) if n_doc else np.zeros(0, np.int64)
        return DTYPE_CODES[code], np.asarray(lengths), np.asarray(pointers), np.asarray(doc_index)

    def _check_bin(self, bin_path: str, lengths, pointers, total: int) -> None:
        itemsize, size = self.dtype.itemsize, os.path.getsize(bin_path)
        if (lengths < 0).any():
            self._fail(self.prefix + ".idx", f"negative sequence length {int(lengths.min())}")
        if size != total * itemsize:
            self._fail(bin_path, f"{size} bytes, but its index {self.prefix}.idx lists {total:,} {self.dtype} tokens "
                                 f"= {total * itemsize} bytes (wrong dtype, or .bin and .idx of different datasets?)")
        expected = (np.cumsum(lengths, dtype=np.int64) - lengths) * itemsize
        if not np.array_equal(pointers, expected):
            bad = int(np.argmax(pointers != expected))
            self._fail(self.prefix + ".idx", f"sequence {bad} points to byte {int(pointers[bad])}, expected "
                                             f"{int(expected[bad])} (sequences must be contiguous)")

    def _check_documents(self, idx: str, doc_index, n_seq: int) -> None:
        if len(doc_index) < 1 or doc_index[0] != 0 or doc_index[-1] != n_seq or (np.diff(doc_index) < 0).any():
            self._fail(idx, f"document indices must rise from 0 to the sequence count {n_seq}, got "
                            f"{doc_index[:4].tolist()}...{doc_index[-2:].tolist()} ({len(doc_index)} entries)")

    def __len__(self) -> int:
        """Documents."""
        return len(self.doc_starts) - 1

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.doc_starts[i]:self.doc_starts[i + 1]]


class IndexedWriter:
    """Writes `<prefix>.bin` and `<prefix>.idx`, one sequence per document, as megatron-core reads them.
    Both appear atomically at `finalize()` (written to `.tmp` names, then renamed); `abort()` removes them."""

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype.name not in TOKEN_CODES:
            raise ValueError(f"token dtype {self.dtype} has no Megatron code (valid: {', '.join(TOKEN_CODES)})")
        self.lengths: list[int] = []
        self._bin = open(prefix + ".bin.tmp", "wb")

    def add_document(self, ids) -> None:
        """Append one document (a sequence of token ids); empty documents are kept (length 0)."""
        ids = np.asarray(ids, dtype=self.dtype)
        self._bin.write(ids.tobytes())
        self.lengths.append(len(ids))

    def num_tokens(self) -> int:
        return sum(self.lengths)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * self.dtype.itemsize
        doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(HEADER + struct.pack("<QBQQ", 1, TOKEN_CODES[self.dtype.name], len(lengths), len(doc_index)))
            f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_index.tobytes())
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        for path in (self.prefix + ".bin.tmp", self.prefix + ".idx.tmp"):
            if os.path.exists(path):
                os.remove(path)


def text_documents(paths: list[str], unit: str, chunks) -> Iterator[Iterator[str]]:
    """The documents of text files, each as pieces of text: `unit` "file" (a whole file, in the pieces
    `chunks(path)` yields), "line" (each non-empty line) or "jsonl" (each line a JSON object whose "text"
    is the document). ValueError naming the file and line of a bad JSONL record."""
    for path in paths:
        if unit == "file":
            yield chunks(path)
            continue
        for number, line in enumerate(line for chunk in chunks(path) for line in chunk.splitlines()):
            if unit == "line":
                if line.strip():
                    yield iter([line])
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number + 1}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path} line {number + 1}: expected an object with a string \"text\"")
            yield iter([record["text"]])
