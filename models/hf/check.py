"""A Hugging Face directory against the ModelConfig it must hold, from the safetensors headers alone (no tensor
bytes): every problem is one ValueError line naming the key and both shapes or dtypes.

    check_checkpoint(path, config, fmt) -> notes   files, keys, shapes, dtypes, FP8 scales, INT4 parts
    expected_shapes(config) -> {key: shape}        what a directory of `config` holds
    is_linear(key)                                 what a compressed-tensors target "Linear" matches
"""

import re

import torch

from models.config import ModelConfig
from models.hf import int4
from models.hf.config import MULTIMODAL_PREFIXES, CheckpointFormat
from models.hf.files import CheckpointFiles
from models.hf.keys import hf_sources
from models.model import Transformer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_checkpoint(path: str, config: ModelConfig, fmt: CheckpointFormat,
                     files: CheckpointFiles | None = None) -> list[str]:
    """Check files, keys, shapes and dtypes against `config` from the headers alone (no tensor bytes).

    Raises ValueError (one line) on a missing shard file, missing or unexpected keys, a shape that
    does not match the config (both shapes named), an FP8 weight without its scales, or an INT4 weight
    whose packed words, scales or recorded shape disagree, or that the quantization_config's targets and
    ignore do not quantize (or the reverse). Returns notes for the user (skipped multi-token-prediction
    layers, skipped multimodal tensors). `files` scanned for some keys only (models/hf/checkpoint.py
    `plan_files`: one rank's share): those keys are checked, from those files' headers alone, and
    unexpected keys are left to the whole check (start-up)."""
    files = CheckpointFiles.scan(path, fmt.prefix) if files is None else files
    expected = expected_shapes(config, fmt.rope_interleave)
    if files.keys is not None:
        expected = {k: s for k, s in expected.items() if k in files.keys}
    present = set(files.entries)
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensor(s) missing, e.g. {[fmt.prefix + k for k in missing[:3]]}")
    if files.keys is None:
        _check_unexpected(path, config, fmt, files, expected)
    for key, shape in expected.items():
        _check_tensor(files, key, shape, fmt)
    return _notes(path, files, fmt)


def _check_unexpected(path: str, config: ModelConfig, fmt: CheckpointFormat, files: CheckpointFiles,
                      expected: dict) -> None:
    present = set(files.entries)
    mtp = {k for k in present if _is_mtp(k, fmt)}
    scales = {k + "_scale_inv" for k in expected if files.dtype_code(k) == "F8_E4M3"}
    unexpected = sorted(fmt.prefix + k for k in present - set(expected) - mtp - scales
                        - {k for k in present if k.endswith(_IGNORED_SUFFIXES)})
    others = set(files.others)
    multimodal = {k for k in others if fmt.prefix and k.startswith(MULTIMODAL_PREFIXES)}
    unexpected += sorted(others - multimodal)
    if unexpected:
        deeper = sorted({int(m.group(1)) for m in map(_LAYER.match, unexpected) if m and int(m.group(1)) >= config.n_layers})
        why = (f" (layers {deeper[0]}..{deeper[-1]}: the model has n_layers={config.n_layers} and config.json declares "
               f"{fmt.n_mtp_layers} multi-token-prediction layers)") if deeper else ""
        raise ValueError(f"{path}: {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}{why}")


def _notes(path: str, files: CheckpointFiles, fmt: CheckpointFormat) -> list[str]:
    """What the load skips, from the directory's key list (every key, whichever files were scanned); an
    INT4 weight's three parts count once."""
    text = {k[len(fmt.prefix):] for k in files.weight_map if k.startswith(fmt.prefix)}
    mtp = {_int4_weight(k) for k in text if _is_mtp(k, fmt)}
    multimodal = {k for k in files.weight_map if fmt.prefix and not k.startswith(fmt.prefix)
                  and k.startswith(MULTIMODAL_PREFIXES)}
    notes = []
    if mtp:
        notes.append(f"{path}: skipping {len(mtp)} multi-token-prediction tensors (layers >= {fmt.first_mtp_layer})")
    if multimodal:
        notes.append(f"{path}: skipping {len(multimodal)} vision tower / projector tensors (not trained; "
                     f"export --like keeps them)")
    return notes


def _int4_weight(key: str) -> str:
    """`<P>.weight` for a part `<P>.weight_packed` / `_scale` / `_shape` of an INT4 weight, else `key`."""
    module, _, param = key.rpartition(".")
    return f"{module}.weight" if param in int4.SUFFIXES else key


_LINEAR_MODULES = {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                   "up_proj", "down_proj", "lm_head"}


def is_linear(key: str) -> bool:
    """Whether checkpoint key `key` is the weight of an nn.Linear in the Hugging Face model (what a
    compressed-tensors target "Linear" matches): projections and the head, not embeddings, norms or the router."""
    module, _, param = key.rpartition(".")
    return param == "weight" and module.rsplit(".", 1)[-1] in _LINEAR_MODULES


def _check_int4(files: CheckpointFiles, key: str, shape: tuple[int, ...], fmt: CheckpointFormat):
    """One-line ValueError unless `key` is INT4 exactly when the quantization_config says so, and its
    packed words, scales and recorded shape fit `shape`."""
    where, name = files.directory, files.prefix + key
    module = name[: -len(".weight")]
    stored = files.dtype_code(key) == "I4"
    if stored and fmt.int4 is None:
        raise ValueError(f"{where}: {module}.weight_packed is compressed-tensors INT4 but config.json has no "
                         f"compressed-tensors quantization_config")
    wanted = fmt.int4 is not None and len(shape) == 2 and fmt.int4.quantized(module, is_linear(key))
    if stored != wanted:
        raise ValueError(f"{where}: {name if not stored else module + '.weight_packed'} is "
                         f"{'INT4' if stored else files.dtype_code(key)}, but quantization_config (targets "
                         f"{list(fmt.int4.targets)}, ignore {list(fmt.int4.ignore)}) "
                         f"{'leaves' if stored else 'quantizes'} {module}")
    if not stored:
        return
    recorded = files.read_int4_shape(key)
    if recorded != list(shape):
        raise ValueError(f"{where}: {module}.weight_shape is {recorded}, the config implies {list(shape)}")
    for part, per in (("weight_packed", int4.PER_WORD), ("weight_scale", int4.GROUP)):
        code, got = files.int4_part(key, part)
        want = [shape[0], -(-shape[1] // per)]
        if list(got) != want:
            raise ValueError(f"{where}: {module}.{part} has shape {list(got)}, weight_shape {list(shape)} implies "
                             f"{want} ({per} values per {'int32 word' if per == int4.PER_WORD else 'scale'})")
    code = files.int4_part(key, "weight_scale")[0]
    if code not in ("BF16", "F16", "F32"):
        raise ValueError(f"{where}: {module}.weight_scale has dtype {code}, expected BF16, F16 or F32")


def _is_mtp(key: str, fmt: CheckpointFormat) -> bool:
    """A key of the multi-token-prediction layers config.json declares (num_nextn_predict_layers after its
    num_hidden_layers); any other layer the config does not use is an unexpected tensor, not skipped."""
    match = _LAYER.match(key)
    return bool(match) and fmt.first_mtp_layer <= int(match.group(1)) < fmt.first_mtp_layer + fmt.n_mtp_layers


def _check_tensor(files: CheckpointFiles, key: str, shape: tuple[int, ...], fmt: CheckpointFormat):
    if files.dtype_code(key) == "I4" or fmt.int4 is not None:
        _check_int4(files, key, shape, fmt)
        if files.dtype_code(key) == "I4":
            return
    if files.shape(key) != shape:
        raise ValueError(f"{files.directory}: {files.prefix}{key} has shape {list(files.shape(key))}, the config "
                         f"implies {list(shape)}")
    code = files.dtype_code(key)
    if code == "F8_E4M3":
        if fmt.fp8_block is None or len(shape) != 2:
            raise ValueError(f"{files.directory}: {key} is float8_e4m3fn but config.json has no fp8 quantization_config")
        scale_shape = tuple(-(-s // b) for s, b in zip(shape, fmt.fp8_block))
        scale_key = key + "_scale_inv"
        if scale_key not in files.entries or files.shape(scale_key) != scale_shape:
            got = list(files.shape(scale_key)) if scale_key in files.entries else "missing"
            raise ValueError(f"{files.directory}: {scale_key} is {got}, expected shape {list(scale_shape)} "
                             f"(blocks of {list(fmt.fp8_block)})")
    elif code not in ("F32", "BF16", "F16"):
        raise ValueError(f"{files.directory}: {key} has dtype {code}, expected F32, BF16, F16 or F8_E4M3")


def expected_shapes(config: ModelConfig, rope_interleave: bool = True) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape for `config` (from a model on the meta device: no storage)."""
    with torch.device("meta"):
        model = Transformer(config)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    out = {}
    for name, source in hf_sources(model, rope_interleave).items():
        shape = tuple(tensors[name].shape)
        for key in source.keys(shape[0]):
            out[key] = source.key_shape(shape)
    return out
