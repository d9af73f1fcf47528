"""Hugging Face DeepSeek-V3-architecture checkpoints (DeepSeek-V3, Kimi K2 / K2.5, Moonlight): load and save.

    load_pretrained(path) -> Transformer          one process, CPU, fp32, eval mode
    save_pretrained(model, path)                  a directory `transformers` loads (DeepseekV3ForCausalLM)
    load_state(model, path) -> bytes read         fill any (sharded) model in place, shard by shard
    plan_files(model, path, fmt) -> CheckpointFiles  the files holding this rank's boxes, headers read
(`check_checkpoint`, the headers against the config: models/hf/check.py; the export in a source's layout:
models/hf/like.py.)

Sharded loading: after `parallelize` + `to_empty`, every parameter is a DTensor and each rank holds one
box of it (models/boxes.py). `load_state` reads exactly that box from the safetensors files through
lazy slices: for stacked experts only the experts of the box, and of each only the rows/columns of
the box; for FP8 weights the enclosing whole blocks and their scales; for compressed-tensors INT4
weights (Kimi K2-Thinking / K2.5 routed experts) the enclosing 32-value groups of the packed int32
words and their scales (models/hf/int4.py). K2.5's text model sits under `language_model.`; its vision
tower and projector are never read. No rank ever holds a full
tensor it does not own, and there is no communication at all: every rank reads its own bytes. Nor does a
rank open a file that holds none of its bytes (`plan_files`, from the index's weight_map): a pipeline
stage (parallel/pp/part.py, the whole model's names) opens only the files of its layers, and with experts
sharded only the files of its experts.
Key names and the rotary row order: models/hf/keys.py. config.json: models/hf/config.py.
"""

import json
import os

import torch
from torch.distributed.tensor import DTensor

from models.boxes import dtensor_box
from models.config import ModelConfig
from models.hf.check import check_checkpoint
from models.hf.config import CheckpointFormat, hf_config_dict, read_hf_config
from models.hf.files import SHARD_BYTES, CheckpointFiles, tensor_records, write_shards
from models.hf.keys import NOT_LOADED, Source, checkpoint_rows, hf_sources
from models.model import Transformer



def load_pretrained(path: str) -> Transformer:
    """The checkpoint at `path` as our model, on the CPU in fp32, in eval mode."""
    config, fmt = read_hf_config(path)
    check_checkpoint(path, config, fmt)
    model = Transformer(config)
    load_state(model, path, fmt)
    return model.eval()


@torch.no_grad()
def load_state(model: Transformer, path: str, fmt: CheckpointFormat | None = None,
               files: CheckpointFiles | None = None) -> int:
    """Fill every parameter and buffer of `model` (a Transformer or a pipeline stage's part of one; plain
    or DTensor shards) from the checkpoint at `path`, through `files` (default: `plan_files`).

    Each rank reads only its own boxes; no collectives. Call `check_checkpoint` first (on every rank,
    before any collective) for one-line errors. Returns the tensor bytes this rank requested."""
    fmt = fmt or read_hf_config(path)[1]
    files = plan_files(model, path, fmt) if files is None else files
    sources = hf_sources(model, fmt.rope_interleave)
    for name, tensor in _loaded(model):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if name.rsplit(".", 1)[-1] in NOT_LOADED:
            local.zero_()
            continue
        box = dtensor_box(tensor)
        local.copy_(read_source(files, sources[name], box, fmt.fp8_block).view(local.shape))
    return files.bytes_read


def plan_files(model: Transformer, path: str, fmt: CheckpointFormat) -> CheckpointFiles:
    """The checkpoint's files that hold this rank's boxes of `model`'s tensors, their headers read (no
    other file is opened): for stacked experts only the boxes' experts, and of each only the row keys
    (gate_proj, up_proj) the box's rows reach. ValueError (one line) for a missing or unreadable file."""
    return CheckpointFiles.scan(path, fmt.prefix, set(box_keys(model, fmt)))


def box_keys(model: Transformer, fmt: CheckpointFormat) -> list[str]:
    """The checkpoint (text) keys this rank's boxes of `model` read, in the loader's order."""
    keys, tensors = [], dict(_loaded(model))
    for name, source in hf_sources(model, fmt.rope_interleave).items():
        tensor = tensors[name]
        box = dtensor_box(tensor)
        if any(b <= a for a, b in box):
            continue
        if not source.stacked:
            keys.append(source.key)
            continue
        (e0, e1), (r0, r1) = box[0], box[1]
        rows = tensor.shape[1] // len(source.row_keys)  # rows per row key: w13 = gate_proj rows, then up_proj's
        keys += [key.format(e=e) for e in range(e0, e1) for i, key in enumerate(source.row_keys)
                 if max(r0, i * rows) < min(r1, (i + 1) * rows)]
    return keys


def _loaded(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


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
                    rope_interleave: bool = True, shard_bytes: int = SHARD_BYTES) -> None:
    """Write `model` (one process, plain tensors) as a Hugging Face directory `transformers` loads (in the
    layout of another directory: models/hf/like.py `save_like`)."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
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
        records += tensor_records(name, source, shapes[name], fetch, dtype)
    write_shards(records, path, shard_bytes)
    written = str(dtype).removeprefix("torch.")  # the router bias stays fp32, as in the published checkpoints
    raw = {**hf_config_dict(config, rope_interleave), "torch_dtype": written, "dtype": written, **(config_extra or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
