"""Export in the layout of a source directory: `save_like(model, out, SRC)`, `export_hf.py --like SRC`.

The result serves wherever SRC served (Kimi K2.5 in an inference engine, at the same footprint):
    - config.json: SRC's, unchanged, except that `--experts-dtype bfloat16` drops the quantization block;
    - the trained text tensors under SRC's key prefix (`language_model.` for K2.5), in `dtype`, except
      where SRC stores a weight as compressed-tensors INT4: there re-quantized to INT4 (symmetric,
      group 32, SRC's scale and shape dtypes) in the same packed format (models/hf/int4.py);
    - every other tensor of SRC (vision tower, projector, multi-token-prediction layers) copied byte for byte;
    - every other file of SRC (tokenizer, chat template, modeling code, generation config) copied as is.
SRC's text model must be the run's (same ModelConfig, first differing field named). Memory is bounded by
the largest tensor, as for `write_hf`; nothing is communicated.
"""

import dataclasses
import json
import os
import shutil

import torch
from safetensors import safe_open

from models.config import ModelConfig
from models.hf import int4
from models.hf.check import check_checkpoint
from models.hf.config import read_hf_config
from models.hf.files import DTYPES, INDEX, SHARD_BYTES, CheckpointFiles, TensorRecord, tensor_records, write_shards
from models.hf.keys import hf_sources
from models.model import Transformer

EXPERTS_DTYPES = ("int4", "bfloat16")  # int4: where SRC's experts are INT4; bfloat16: unquantized
_TRAINING_FIELDS = {"aux_loss_alpha", "bias_update_speed", "init_std"}  # not in a checkpoint's config.json


def check_like(config: ModelConfig, like: str):
    """(CheckpointFormat, CheckpointFiles) of `like`; ValueError (one line) unless its text model is `config`."""
    try:
        theirs, fmt = read_hf_config(like)
    except ValueError as e:
        raise ValueError(f"--like {e}") from None
    for field in dataclasses.fields(ModelConfig):
        a, b = getattr(theirs, field.name), getattr(config, field.name)
        if field.name not in _TRAINING_FIELDS and a != b:
            raise ValueError(f"--like {like}: its text model differs from the exported model: {field.name}={a!r} "
                             f"there, {b!r} here")
    if fmt.fp8_block is not None:
        raise ValueError(f"--like {like}: its weights are FP8 blocks; exporting in FP8 is not supported "
                         f"(export without --like)")
    try:
        check_checkpoint(like, theirs, fmt)
    except ValueError as e:
        raise ValueError(f"--like {e}") from None
    return fmt, CheckpointFiles.scan(like, fmt.prefix)


def write_like(config: ModelConfig, fetch, out: str, like: str, *, dtype: torch.dtype, experts_dtype: str = "int4",
               shard_bytes: int) -> None:
    """Write `out` in the layout of `like` from `fetch(our_name) -> full tensor` (see the module docstring)."""
    if experts_dtype not in EXPERTS_DTYPES:
        raise ValueError(f"--experts-dtype {experts_dtype}: expected one of {EXPERTS_DTYPES}")
    fmt, files = check_like(config, like)
    with torch.device("meta"):
        meta = Transformer(config)
    shapes = {n: tuple(t.shape) for n, t in list(meta.named_parameters()) + list(meta.named_buffers())}
    records, written = [], set()
    for name, source in hf_sources(meta, fmt.rope_interleave).items():
        quantized = experts_dtype == "int4" and files.dtype_code(source.keys(1)[0]) == "I4"
        for r in tensor_records(name, source, shapes[name], fetch, torch.float32 if quantized else dtype):
            written.add(r.key)
            plain = [dataclasses.replace(r, key=fmt.prefix + r.key)]
            records += _int4_records(files, fmt.prefix, r) if quantized else plain
    records += _copied(files, written)
    write_shards(records, out, shard_bytes)
    _write_config(like, out, drop_quantization=experts_dtype == "bfloat16" and fmt.int4 is not None, dtype=dtype)
    _copy_other_files(like, out)


def save_like(model: Transformer, out: str, like: str, *, dtype: torch.dtype = torch.float32,
              experts_dtype: str = "int4", shard_bytes: int = SHARD_BYTES) -> None:
    """`model` (one process, plain tensors) written in the layout of `like` (models/hf/checkpoint.py
    `save_pretrained` writes the plain DeepSeek-V3 layout)."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    write_like(model.config, lambda name: state[name].detach(), out, like, dtype=dtype, experts_dtype=experts_dtype,
               shard_bytes=shard_bytes)


def _int4_records(files: CheckpointFiles, prefix: str, record: TensorRecord) -> list[TensorRecord]:
    """weight_packed, weight_scale, weight_shape of one re-quantized weight (quantized once, at the first)."""
    rows, cols = record.shape
    scale_dtype = DTYPES[files.int4_part(record.key, "weight_scale")[0]]
    shape_dtype = DTYPES[files.int4_part(record.key, "weight_shape")[0]]
    cache = {}

    def part(i: int) -> torch.Tensor:
        if "q" not in cache:
            cache["q"] = int4.quantize(record.fetch(), scale_dtype)
        return cache["q"][0] if i == 0 else cache.pop("q")[1]

    base = prefix + record.key[: -len("weight")]
    return [TensorRecord(base + "weight_packed", (rows, -(-cols // int4.PER_WORD)), torch.int32, lambda: part(0)),
            TensorRecord(base + "weight_scale", (rows, -(-cols // int4.GROUP)), scale_dtype, lambda: part(1)),
            TensorRecord(base + "weight_shape", (2,), shape_dtype,
                         lambda: torch.tensor([rows, cols], dtype=shape_dtype))]


def _copied(files: CheckpointFiles, written: set[str]) -> list[TensorRecord]:
    """Byte-for-byte records of every stored tensor of `files` that the export does not write."""
    stored = {files.prefix + k: e[:3] for k, e in files.entries.items() if k not in written and e[1] != "I4"}
    for key, entry in files.entries.items():
        if key not in written and entry[1] == "I4":  # e.g. an MTP layer's INT4 experts: their three parts
            stored |= {files.prefix + key[: -len("weight")] + p: v for p, v in entry[3].items()}
    stored |= files.others
    records = []
    for key, (name, code, shape) in sorted(stored.items()):
        if code not in DTYPES:
            raise ValueError(f"--like {files.directory}: {key} has dtype {code}, which the export cannot copy")
        records.append(TensorRecord(key, tuple(shape), DTYPES[code],
                                    lambda key=key, name=name: _raw(files.directory, name, key)))
    return records


def _raw(directory: str, name: str, key: str) -> torch.Tensor:
    with safe_open(os.path.join(directory, name), framework="pt") as f:
        return f.get_tensor(key)


def _write_config(like: str, out: str, drop_quantization: bool, dtype: torch.dtype) -> None:
    """SRC's config.json; its `torch_dtype` / `dtype` (top level and text_config), where given, name the
    dtype the unquantized weights are written in (SRC's may say float32 over bf16 weights)."""
    with open(os.path.join(like, "config.json")) as f:
        raw = json.load(f)
    written = str(dtype).removeprefix("torch.")
    for section in (raw, raw.get("text_config")):
        for key in ("torch_dtype", "dtype"):
            if isinstance(section, dict) and section.get(key) is not None:
                section[key] = written
    if drop_quantization:
        raw.pop("quantization_config", None)
        if isinstance(raw.get("text_config"), dict):
            raw["text_config"].pop("quantization_config", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)


def _copy_other_files(like: str, out: str) -> None:
    """SRC's files that are not weights, index or config.json (tokenizer, modeling code, ...), as they are."""
    for name in sorted(os.listdir(like)):
        path = os.path.join(like, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (INDEX, "config.json"):
            shutil.copy2(path, os.path.join(out, name))
