"""Safetensors files of a Hugging Face directory: the index, header-only checks, box reads, streaming writes.

Reading: `CheckpointFiles` parses the JSON headers only (no tensor bytes) to check keys, shapes and
dtypes; `read_box` reads one box of one tensor through safetensors' lazy `get_slice`, so a rank
touches only the bytes of the rows (and, per row, the columns) it asks for. FP8 block-quantized
weights (float8_e4m3fn with a float32 `<key>_scale_inv` per block of `weight_block_size`) are read
over the enclosing whole blocks and dequantized as weight * scale_inv per block, in fp32. compressed-tensors
INT4 weights (`<P>.weight_packed` + `weight_scale` + `weight_shape`, models/hf/int4.py) appear as one entry
`<P>.weight` of dtype code "I4"; a box reads the enclosing whole 32-value groups of its packed words and
scales. A K2.5 directory nests the text model under a key prefix (`language_model.`): `scan(path, prefix)`
lists the text model's keys without it and keeps every other key in `others` (vision tower, projector).
`scan(path, prefix, keys)` opens only the files that hold `keys` (the index's weight_map says which: with an
FP8 weight its scales, with an INT4 weight its three parts): a pipeline stage's rank reads neither the headers
nor the bytes of the other stages' files. `names` are the files it opened; `weight_map` every key's file.

Writing: `write_shards` streams (key, shape, dtype, fetch) records into `model-0000i-of-0000n.safetensors`
files of at most `shard_bytes` each plus `model.safetensors.index.json`, one tensor in memory at a time
(safetensors' header lists every tensor first, so shapes and dtypes are planned before any bytes).
"""

import json
import os
import struct
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open

from models.hf import int4
from models.hf.keys import Source, our_rows

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
          "I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
CODES = {v: k for k, v in DTYPES.items()}

SHARD_BYTES = 4 * 2**30  # exported shard size: a few GB, like the published checkpoints


@dataclass
class CheckpointFiles:
    """key -> (file, dtype code, shape) for every tensor of the directory, from the headers alone."""

    directory: str
    entries: dict[str, tuple[str, str, tuple[int, ...]]]  # text keys without the prefix; INT4 weights as "I4"
    prefix: str = ""  # stored key = prefix + text key
    others: dict[str, tuple[str, str, tuple[int, ...]]] = field(default_factory=dict)  # keys outside the prefix
    names: tuple[str, ...] = ()  # the files scanned (headers read); only these are ever opened for tensors
    weight_map: dict[str, str] = field(default_factory=dict)  # every stored key -> its file (the index's)
    keys: frozenset[str] | None = None  # the text keys the scan was restricted to (None: the whole directory)
    bytes_read: int = 0  # tensor bytes requested through read_box (a per-rank counter)
    _open: dict = field(default_factory=dict)

    @classmethod
    def scan(cls, directory: str, prefix: str = "", keys=None) -> "CheckpointFiles":
        """The headers of every file, or with `keys` (text keys) of only the files that hold them.
        ValueError (one line) for a missing directory, index, or shard file, or an unreadable header."""
        if not os.path.isdir(directory):
            raise ValueError(f"{directory}: no such directory")
        files = _shard_files(directory)
        names = sorted(set(files.values()) if keys is None or None in files else _files_of(files, prefix, keys))
        entries = {}
        for name in names:
            for key, (code, shape) in _header(os.path.join(directory, name)).items():
                entries[key] = (name, code, shape)
        for key, name in files.items():
            if key is not None and entries.get(key, (name,))[0] != name:
                raise ValueError(f"{directory}/{INDEX}: {key!r} listed in {name} but not found there")
        text = {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix)}
        others = {k: v for k, v in entries.items() if not k.startswith(prefix)}
        weight_map = {k: e[0] for k, e in entries.items()} if None in files else files
        return cls(directory, _int4_entries(text), prefix, others, tuple(names), weight_map,
                   None if keys is None else frozenset(keys))

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def dtype_code(self, key: str) -> str:
        return self.entries[key][1]

    def _slice(self, key: str, name: str | None = None):
        name = name or self.entries[key][0]
        if name not in self._open:
            self._open[name] = safe_open(os.path.join(self.directory, name), framework="pt")
        return self._open[name].get_slice(self.prefix + key)

    def read(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The box of text key `key` as stored (its own dtype); an INT4 part is `<P>.weight_packed` etc.
        ValueError naming the file and key if it cannot be read."""
        name = self.entries[key][0] if key in self.entries else self._int4_part_file(key)
        try:
            out = self._slice(key, name)[tuple(slice(a, b) for a, b in box)]
        except (OSError, SafetensorError) as e:
            reason = " ".join(str(e).split())[:200]
            raise ValueError(f"{os.path.join(self.directory, name)}: cannot read {self.prefix + key} ({reason})") from None
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _int4_part_file(self, key: str) -> str:
        """The shard file of a part of an INT4 weight (parts may sit in different shards)."""
        return self.entries[_int4_base(key)][3][key.rsplit(".", 1)[1]][0]

    def path(self, key: str) -> str:
        return os.path.join(self.directory, self.entries[key][0])

    def int4_part(self, key: str, part: str) -> tuple[str, tuple[int, ...]]:
        """(dtype code, shape) of `part` (weight_packed / weight_scale / weight_shape) of INT4 weight `key`."""
        return self.entries[key][3][part][1:]

    def read_int4_shape(self, key: str) -> list[int]:
        """The [out, in] that `<P>.weight_shape` of INT4 weight `key` records (a 2-element tensor)."""
        code, shape = self.int4_part(key, "weight_shape")
        if len(shape) != 1 or shape[0] != 2 or not code.startswith(("I", "U")):
            return [f"{code}{list(shape)}"]  # not a shape: the caller names it
        return [int(v) for v in self.read(key[: -len("weight")] + "weight_shape", ((0, 2),))]

    def _read_int4(self, key: str, box) -> torch.Tensor:
        """fp32 box of an INT4 weight: the enclosing whole groups of packed words and scales, dequantized."""
        (r0, r1), (c0, c1) = box
        base, g0, g1 = key[: -len("weight")], c0 // int4.GROUP, -(-c1 // int4.GROUP)
        words = self.int4_part(key, "weight_packed")[1][1]
        w0, w1 = g0 * int4.WORDS_PER_GROUP, min(g1 * int4.WORDS_PER_GROUP, words)
        packed = self.read(base + "weight_packed", ((r0, r1), (w0, w1)))
        scale = self.read(base + "weight_scale", ((r0, r1), (g0, g1)))
        return int4.dequantize(packed, scale)[:, c0 - g0 * int4.GROUP: c1 - g0 * int4.GROUP]

    def read_box(self, key: str, box: tuple[tuple[int, int], ...], fp8_block) -> torch.Tensor:
        """The box of `key` in fp32; FP8 weights dequantized with their per-block scales. ValueError
        naming the file and key if a value is not finite (NaN, inf: every step would be non-finite)."""
        if any(b <= a for a, b in box):
            return torch.zeros([b - a for a, b in box])
        code = self.dtype_code(key)
        if code == "I4":
            out = self._read_int4(key, box)
        else:
            out = self.read(key, box).float() if code != "F8_E4M3" else self._dequantized(key, box, fp8_block)
        # a finite fp32 sum means every value is finite (NaN and inf propagate); it costs ~1/20 of
        # isfinite().all() on the CPU, which runs only when the sum is not finite (or overflowed)
        if not torch.isfinite(out.sum()) and not bool(torch.isfinite(out).all()):
            raise ValueError(f"{self.path(key)}: {self.prefix + key} holds non-finite values (NaN or inf); "
                             f"the weights are damaged")
        return out

    def _dequantized(self, key: str, box, fp8_block) -> torch.Tensor:
        (r0, r1), (c0, c1) = box
        (br, bc), (rows, cols) = fp8_block, self.shape(key)
        outer = ((r0 // br * br, min(-(-r1 // br) * br, rows)), (c0 // bc * bc, min(-(-c1 // bc) * bc, cols)))
        weight = self.read(key, outer).float()
        scale = self.read(key + "_scale_inv", ((r0 // br, -(-r1 // br)), (c0 // bc, -(-c1 // bc))))
        scale = scale.float().repeat_interleave(br, 0)[: weight.shape[0]].repeat_interleave(bc, 1)[:, : weight.shape[1]]
        return (weight * scale)[r0 - outer[0][0]: r1 - outer[0][0], c0 - outer[1][0]: c1 - outer[1][0]]


def _int4_base(part_key: str) -> str:
    return part_key.rsplit(".", 1)[0] + ".weight"


def _int4_entries(entries: dict) -> dict:
    """`entries` with each INT4 triple `<P>.weight_packed/_scale/_shape` replaced by one entry `<P>.weight`:
    (file of weight_packed, "I4", [out, 8 * words], {part: (file, dtype code, shape)}). A missing part or a
    plain `<P>.weight` next to the packed one is left for the checks to name."""
    out = dict(entries)
    for key, (name, code, shape) in entries.items():
        if not key.endswith(".weight_packed"):
            continue
        base = key[: -len("_packed")]
        parts = {s: entries[base[: -len("weight")] + s] for s in int4.SUFFIXES if base[: -len("weight")] + s in entries}
        if base in out or code != "I32" or len(shape) != 2 or len(parts) != 3:
            continue
        for s in int4.SUFFIXES:
            del out[base[: -len("weight")] + s]
        out[base] = (name, "I4", (shape[0], shape[1] * int4.PER_WORD), parts)
    return out


def _files_of(files: dict[str, str], prefix: str, keys) -> set[str]:
    """The index's files that hold text keys `keys`, with their FP8 scales and INT4 parts (a key the index
    does not list holds no file: the checks name it missing)."""
    names = set()
    for key in keys:
        stored = [prefix + key, prefix + key + "_scale_inv"]
        if key.endswith(".weight"):
            stored += [prefix + key[: -len("weight")] + suffix for suffix in int4.SUFFIXES]
        names.update(files[k] for k in stored if k in files)
    return names


def _shard_files(directory: str) -> dict:
    """{key: file} from the index, or {None: "model.safetensors"} for a single-file checkpoint."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        weight_map = _weight_map(index)
        for name in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(directory, name)):
                count = sum(v == name for v in weight_map.values())
                raise ValueError(f"{directory}: shard file {name} (listed in {INDEX} for {count} tensors) is missing")
        return weight_map
    if os.path.exists(os.path.join(directory, SINGLE)):
        return {None: SINGLE}
    raise ValueError(f"{directory}: neither {INDEX} nor {SINGLE} found")


def _weight_map(index: str) -> dict[str, str]:
    """The index's {key: shard file name}; ValueError naming the index if it is not that."""
    try:
        with open(index, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{index}: not a readable index ({str(e)[:200]})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v and os.sep not in v and v != ".."
                                                   for v in weight_map.values()):
        raise ValueError(f"{index}: not a safetensors index (expected {{\"weight_map\": {{key: file name}}}})")
    return weight_map


def _header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (dtype code, shape) from the JSON header of `path`; ValueError (one line naming the file) for
    an unreadable or malformed header, or a file too short for the data its header declares (a download
    cut short): the size check reads no tensor bytes."""
    try:
        file_bytes = os.path.getsize(path)
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > file_bytes - 8:  # garbage in the first 8 bytes: never allocate what they say
                raise ValueError(f"its header length {size:,} exceeds the file's {file_bytes:,} bytes")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    entries, data_end = {}, 0
    for key, meta in header.items():
        entries[key], end = _entry(path, key, meta)
        data_end = max(data_end, end)
    if 8 + size + data_end > file_bytes:
        raise ValueError(f"{path}: truncated: its header places tensor data up to byte {8 + size + data_end:,}, "
                         f"the file has {file_bytes:,} bytes (an interrupted download or copy?)")
    return entries


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def _entry(path: str, key: str, meta) -> tuple[tuple[str, tuple[int, ...]], int]:
    """((dtype code, shape), end of the data) of one header entry, whose data_offsets must span its bytes."""
    try:
        code, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        numel = 1
        for s in shape:
            numel *= s
        wanted = numel * _ITEM_BYTES[code] if code in _ITEM_BYTES else end - begin
        ok = type(begin) is int and type(end) is int and 0 <= begin and end - begin == wanted and min(shape, default=0) >= 0
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: malformed safetensors header entry for {key!r}: {json.dumps(meta)[:200]}")
    return (code, shape), end


@dataclass(frozen=True)
class TensorRecord:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: object  # () -> tensor of `shape` and `dtype`, called once when its bytes are written

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_shards(records: list[TensorRecord], out_dir: str, shard_bytes: int) -> None:
    """Stream the records into safetensors shards of at most shard_bytes (a larger tensor gets its own)."""
    os.makedirs(out_dir, exist_ok=True)
    shards, size = [[]], 0
    for record in records:
        if shards[-1] and size + record.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(record)
        size += record.nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_file(shard, os.path.join(out_dir, name))
        weight_map.update({r.key: name for r in shard})
        total += sum(r.nbytes for r in shard)
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _write_file(records: list[TensorRecord], path: str) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for r in records:
        header[r.key] = {"dtype": CODES[r.dtype], "shape": list(r.shape), "data_offsets": [offset, offset + r.nbytes]}
        offset += r.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for r in records:
            tensor = r.fetch()
            assert tuple(tensor.shape) == r.shape and tensor.dtype == r.dtype, (r.key, tensor.shape, tensor.dtype)
            f.write(tensor.contiguous().view(torch.uint8).numpy().data)  # no copy


def tensor_records(name: str, source: Source, shape, fetch, dtype) -> list[TensorRecord]:
    """One record per checkpoint key of our tensor `name`; the records are written in order, so the
    tensor is fetched at its first record and released at its last."""
    out_dtype = torch.float32 if name.endswith("expert_bias") else dtype  # the router bias stays fp32
    loaded = {}

    def part(index, last: bool) -> torch.Tensor:
        if "t" not in loaded:
            t = fetch(name).to(out_dtype)
            loaded["t"] = t[our_rows(source.rope_rows, t.shape[0])] if source.rope_rows else t
        t = loaded.pop("t") if last else loaded["t"]
        return t if index is None else t[index]

    if not source.stacked:
        return [TensorRecord(source.key, shape, out_dtype, lambda: part(None, True))]
    n, keys, key_shape = shape[0], source.row_keys, source.key_shape(shape)
    rows = key_shape[0]  # expert e's key i holds our rows [i * rows, (i + 1) * rows) of dim 1
    return [TensorRecord(key.format(e=e), key_shape, out_dtype,
                         lambda e=e, i=i: part((e, slice(i * rows, (i + 1) * rows)), e == n - 1 and i == len(keys) - 1))
            for e in range(n) for i, key in enumerate(keys)]
