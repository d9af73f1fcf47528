"""Hugging Face DeepSeek-V3-architecture checkpoints (DeepSeek-V3, Kimi K2 / K2.5, Moonlight): load and save.

    load_pretrained(path) -> Transformer          one process, CPU, fp32, eval mode
    save_pretrained(model, path)                  a directory `transformers` loads (DeepseekV3ForCausalLM)
    check_checkpoint(path, config) -> notes       headers only: every problem as one ValueError line
    load_state(model, path) -> bytes read         fill any (sharded) model in place, shard by shard

Sharded loading: after `parallelize` + `to_empty`, every parameter is a DTensor and each rank holds one
box of it (models/boxes.py). `load_state` reads exactly that box from the safetensors files through
lazy slices: for stacked experts only the experts of the box, and of each only the rows/columns of
the box; for FP8 weights the enclosing whole blocks and their scales; for compressed-tensors INT4
weights (Kimi K2-Thinking / K2.5 routed experts) the enclosing 32-value groups of the packed int32
words and their scales (models/hf/int4.py). K2.5's text model sits under `language_model.`; its vision
tower and projector are never read. No rank ever holds a full
tensor it does not own, and there is no communication at all: every rank reads its own bytes.
Key names and the rotary row order: models/hf/keys.py. config.json: models/hf/config.py.
"""

import json
import os
import re

import torch
from torch.distributed.tensor import DTensor

from models.boxes import dtensor_box
from models.config import ModelConfig
from models.hf import int4
from models.hf.config import MULTIMODAL_PREFIXES, CheckpointFormat, hf_config_dict, read_hf_config
from models.hf.files import CheckpointFiles, TensorRecord, write_shards
from models.hf.keys import NOT_LOADED, Source, checkpoint_rows, hf_sources, our_rows
from models.model import Transformer

SHARD_BYTES = 4 * 2**30  # exported shard size: a few GB, like the published checkpoints
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_pretrained(path: str) -> Transformer:
    """The checkpoint at `path` as our model, on the CPU in fp32, in eval mode."""
    config, fmt = read_hf_config(path)
    check_checkpoint(path, config, fmt)
    model = Transformer(config)
    load_state(model, path, fmt)
    return model.eval()


def check_checkpoint(path: str, config: ModelConfig, fmt: CheckpointFormat) -> list[str]:
    """Check files, keys, shapes and dtypes against `config` from the headers alone (no tensor bytes).

    Raises ValueError (one line) on a missing shard file, missing or unexpected keys, a shape that
    does not match the config (both shapes named), an FP8 weight without its scales, or an INT4 weight
    whose packed words, scales or recorded shape disagree, or that the quantization_config's targets and
    ignore do not quantize (or the reverse). Returns notes for the user (skipped multi-token-prediction
    layers, skipped multimodal tensors)."""
    files = CheckpointFiles.scan(path, fmt.prefix)
    expected = expected_shapes(config, fmt.rope_interleave)
    present = set(files.entries)
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensor(s) missing, e.g. {[fmt.prefix + k for k in missing[:3]]}")
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
    for key, shape in expected.items():
        _check_tensor(files, key, shape, fmt)
    notes = []
    if mtp:
        notes.append(f"{path}: skipping {len(mtp)} multi-token-prediction tensors (layers >= {fmt.first_mtp_layer})")
    if multimodal:
        notes.append(f"{path}: skipping {len(multimodal)} vision tower / projector tensors (not trained; "
                     f"export --like keeps them)")
    return notes


_LINEAR_MODULES = {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                   "up_proj", "down_proj", "lm_head"}


def _is_linear(key: str) -> bool:
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
    wanted = fmt.int4 is not None and len(shape) == 2 and fmt.int4.quantized(module, _is_linear(key))
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


@torch.no_grad()
def load_state(model: Transformer, path: str, fmt: CheckpointFormat | None = None) -> int:
    """Fill every parameter and buffer of `model` (plain or DTensor shards) from the checkpoint at `path`.

    Each rank reads only its own boxes; no collectives. Call `check_checkpoint` first (on every rank,
    before any collective) for one-line errors. Returns the tensor bytes this rank requested."""
    fmt = fmt or read_hf_config(path)[1]
    files = CheckpointFiles.scan(path, fmt.prefix)
    sources = hf_sources(model, fmt.rope_interleave)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if name.rsplit(".", 1)[-1] in NOT_LOADED:
            local.zero_()
            continue
        box = dtensor_box(tensor)
        local.copy_(read_source(files, sources[name], box, fmt.fp8_block).view(local.shape))
    return files.bytes_read


def read_source(files: CheckpointFiles, source: Source, box, fp8_block) -> torch.Tensor:
    """Our tensor's `box` in fp32, assembled from the checkpoint (experts stacked, gate/up rows side by
    side, rotary rows permuted)."""
    if source.stacked:
        (e0, e1), rest = box[0], box[1:]
        parts = [_read_expert(files, source, e, rest, fp8_block) for e in range(e0, e1)]
        return torch.stack(parts) if parts else torch.zeros([0] + [b - a for a, b in rest])
    if source.rope_rows is None or box[0][1] <= box[0][0]:
        return files.read_box(source.key, box, fp8_block)
    rows = checkpoint_rows(source.rope_rows, torch.arange(*box[0]))
    lo, hi = int(rows.min()), int(rows.max()) + 1  # within the box's heads: at most one rotary block more
    return files.read_box(source.key, ((lo, hi), *box[1:]), fp8_block)[rows - lo]


def _read_expert(files: CheckpointFiles, source: Source, e: int, box, fp8_block) -> torch.Tensor:
    """Rows box[0] (and the rest of `box`) of expert e's matrix: from each row key the rows it holds."""
    (r0, r1), rest = box[0], box[1:]
    n = files.shape(source.key.format(e=e))[0]  # rows per key
    spans = [(i, max(r0, i * n), min(r1, (i + 1) * n)) for i in range(len(source.row_keys))]
    parts = [files.read_box(source.row_keys[i].format(e=e), ((lo - i * n, hi - i * n), *rest), fp8_block)
             for i, lo, hi in spans if hi > lo]
    return torch.cat(parts) if parts else torch.zeros([max(0, r1 - r0)] + [b - a for a, b in rest])


def save_pretrained(model: Transformer, path: str, *, dtype: torch.dtype = torch.float32,
                    rope_interleave: bool = True, shard_bytes: int = SHARD_BYTES, like: str | None = None,
                    experts_dtype: str = "int4") -> None:
    """Write `model` (one process, plain tensors) as a Hugging Face directory `transformers` loads; with
    `like=SRC`, in the layout of SRC (K2.5 nesting, INT4 experts, SRC's other tensors: models/hf/like.py)."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    if like is not None:
        from models.hf.like import write_like  # it builds on this module

        write_like(model.config, lambda name: state[name].detach(), path, like, dtype=dtype,
                   experts_dtype=experts_dtype, shard_bytes=shard_bytes)
        return
    write_hf(model.config, lambda name: state[name].detach(), path, dtype=dtype,
             rope_interleave=rope_interleave, shard_bytes=shard_bytes)


def write_hf(config: ModelConfig, fetch, path: str, *, dtype: torch.dtype, rope_interleave: bool,
             shard_bytes: int, config_extra: dict | None = None) -> None:
    """config.json + safetensors shards from `fetch(our_name) -> full tensor`, called once per tensor
    and dropped after its experts/rows are written: memory is bounded by the largest tensor. config.json
    states `dtype` (as `torch_dtype` and transformers 5's `dtype`); `config_extra` adds fields (token ids).
    ValueError (one line, nothing written) for a model the DeepSeek-V3 format cannot hold."""
    if config.attn != "mla":
        raise ValueError(f"the model uses attn={config.attn!r} attention; the Hugging Face DeepSeek-V3 format "
                         f"(DeepseekV3ForCausalLM) needs multi-head latent attention, attn='mla': only MLA models "
                         f"export")
    with torch.device("meta"):
        meta = Transformer(config)
    shapes = {n: tuple(t.shape) for n, t in list(meta.named_parameters()) + list(meta.named_buffers())}
    records = []
    for name, source in hf_sources(meta, rope_interleave).items():
        records += _records(name, source, shapes[name], fetch, dtype)
    write_shards(records, path, shard_bytes)
    written = str(dtype).removeprefix("torch.")  # the router bias stays fp32, as in the published checkpoints
    raw = {**hf_config_dict(config, rope_interleave), "torch_dtype": written, "dtype": written, **(config_extra or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)


def _records(name: str, source: Source, shape, fetch, dtype) -> list[TensorRecord]:
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
