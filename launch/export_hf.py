"""Export a training checkpoint as a Hugging Face DeepSeek-V3 directory.

    python launch/export_hf.py --run-dir DIR [--step N] --out OUT [--dtype bfloat16|float32] [--shard-gb 4]
                               [--tokenizer DIR [--trust-remote-code]]
                               [--like SRC_DIR [--experts-dtype int4|bfloat16]]

Reads the DCP checkpoint `checkpoints/step_N` (default: the newest complete one) and the model config
its COMPLETE marker records, and writes config.json, model-0000i-of-0000n.safetensors shards and
model.safetensors.index.json with one key per expert, as the published checkpoints have them (w13's
halves as gate_proj and up_proj). Checkpoints from before w1 and w3 were fused export too. One
process, no process group: tensors are read from DCP one at a time (DCP reassembles each from every
rank's shards), so memory stays bounded by the largest tensor. `--out`'s missing parents are created. A
bad argument (a run dir without checkpoints, an `--out` that is a file, not empty or inside an input,
`--shard-gb` <= 0, inside a run directory or a checkpoint) or a checkpoint that does not load exits with status 2 and one line; a failed export
removes what it wrote. `--like SRC_DIR` writes in the layout of the directory training started from (Kimi
K2.5: its nesting, INT4 experts re-quantized, vision tower and projector copied byte for byte, its
config.json and other files: models/hf/like.py). `--tokenizer DIR`: runtime/data/tokenizer_dir.py loads it
(Kimi's tiktoken tokenizer with `--trust-remote-code`); launch/tokenizer_files.py copies its files.
"""

import math
import os
import shutil
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from launch import tokenizer_files  # noqa: E402
from launch.precheck import ToolParser  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.hf.checkpoint import write_hf  # noqa: E402
from models.hf.files import SHARD_BYTES  # noqa: E402
from models.hf.like import EXPERTS_DTYPES, check_like, write_like  # noqa: E402
from runtime.paths import check_output_dir  # noqa: E402
from runtime.checkpoint import checkpoint  # noqa: E402
from runtime.cli import report  # noqa: E402
from runtime.errors import RunError  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PREFIX = "train.model."  # where runtime/train.py's app_state puts the model in the DCP checkpoint


def checkpoint_path(run_dir: str, step: int | None) -> str:
    check_run_dir(run_dir)
    directory = checkpoint.checkpoint_dir(run_dir)
    if step is None:
        path = checkpoint.latest_checkpoint(directory)
        if path is None:
            raise ValueError(f"--run-dir: no complete checkpoint under {directory}")
        return path
    path = os.path.join(directory, f"step_{step}")
    if not os.path.isfile(os.path.join(path, checkpoint.MARKER)):
        steps = [checkpoint.checkpoint_step(p) for p in checkpoint.complete_checkpoints(directory)]
        raise ValueError(f"--step {step}: no complete checkpoint {path} (complete steps: {steps})")
    return path


def check_run_dir(run_dir: str) -> None:
    """ValueError unless `run_dir` is a directory; a hint when it is a checkpoint or checkpoints/ itself."""
    if not os.path.isdir(run_dir):
        what = "not a directory" if os.path.exists(run_dir) else "no such directory"
        raise ValueError(f"--run-dir {run_dir}: {what}")
    if os.path.isdir(checkpoint.checkpoint_dir(run_dir)):
        return
    if os.path.isfile(os.path.join(run_dir, checkpoint.MARKER)):
        raise ValueError(f"--run-dir {run_dir} is a checkpoint: give the run directory that holds checkpoints/ "
                         f"(and --step {checkpoint.checkpoint_step(run_dir)})")
    if checkpoint.complete_checkpoints(run_dir):
        raise ValueError(f"--run-dir {run_dir} is a checkpoints/ directory: give the run directory above it")


def check_out(out: str, inputs: dict[str, str] | None = None) -> str | None:
    """ValueError unless `out` is a new or an empty directory (an export never mixes with other files) outside
    every input directory ({flag: path}); returns the outermost directory the export will create (`out` or a
    missing parent of it), None when `out` exists."""
    if os.path.isdir(out):
        if os.listdir(out):
            raise ValueError(f"--out {out} exists and is not empty: give a new or an empty directory")
    elif os.path.exists(out):
        raise ValueError(f"--out {out} is a file: give a new or an empty directory")
    check_output_dir("--out", out, [(f"{flag} {path}", path) for flag, path in (inputs or {}).items()])
    if os.path.isdir(out):
        return None
    top = os.path.abspath(out)
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    if not os.path.isdir(os.path.dirname(top)):
        raise ValueError(f"--out {out}: its parent {os.path.dirname(top)} is not a directory")
    return top


def checkpoint_model_config(path: str) -> ModelConfig:
    """The ModelConfig recorded in the checkpoint's marker (runtime/train.py `run_meta`)."""
    saved = checkpoint.read_meta(path).get("model")
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: the {checkpoint.MARKER} marker records no model config")
    try:
        return ModelConfig(**saved)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: the recorded model config does not build: {e}") from None


def check_shapes(path: str, config: ModelConfig) -> None:
    """ValueError (one line) when a weight of the marker's model config has another shape in the checkpoint
    (a hand-edited or swapped marker): before anything is written."""
    from models import Transformer

    try:
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # unreadable: dcp_fetch reports it, naming the checkpoint
        return
    with torch.device("meta"):
        model = Transformer(config)
    for name, param in model.named_parameters():
        meta = metadata.get(PREFIX + name)
        if meta is not None and tuple(meta.size) != tuple(param.shape):
            raise ValueError(f"{path}: {name} is {list(meta.size)} in the checkpoint but {list(param.shape)} by the "
                             f"model config its {checkpoint.MARKER} marker records (model.dim={config.dim}, "
                             f"model.n_heads={config.n_heads}, model.vocab_size={config.vocab_size}): the marker does "
                             f"not belong to these tensors")


def dcp_fetch(path: str):
    """fetch(our_name) -> the full fp32 tensor from the DCP checkpoint at `path` (one tensor per call).

    A checkpoint from before the routed experts' w1 and w3 were fused stores them apart: their w13
    is the two concatenated on dim 1 (w1 rows, then w3 rows). Unloadable (one line) for missing,
    truncated or garbled files; ValueError for a tensor of the marker's config the checkpoint lacks."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise checkpoint.Unloadable(f"{path}: unreadable DCP metadata ({checkpoint.failure_reason(e)})") from None

    def fetch(name: str) -> torch.Tensor:
        if name.endswith(".experts.w13") and PREFIX + name not in metadata:
            return torch.cat([read(name[: -len("w13")] + part) for part in ("w1", "w3")], dim=1)
        return read(name)

    def read(name: str) -> torch.Tensor:
        if PREFIX + name not in metadata:
            raise ValueError(f"{path} holds no {name}, a weight of the model config its {checkpoint.MARKER} "
                             f"marker records")
        meta = metadata[PREFIX + name]
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        try:
            with warnings.catch_warnings():  # DCP warns that no process group exists: one process is intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({PREFIX + name: tensor}, checkpoint_id=path, no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
            raise checkpoint.Unloadable(f"{path}: {name} does not load, a shard file is missing or damaged "
                                        f"({checkpoint.failure_reason(e)})") from None
        return tensor

    return fetch


def export(run_dir: str, out: str, step: int | None = None, dtype: str = "bfloat16",
           shard_bytes: int = SHARD_BYTES, tokenizer: str | None = None, like: str | None = None,
           experts_dtype: str = "int4", trust_remote_code: bool = False) -> str:
    """Write the Hugging Face directory `out` (new or empty); returns the checkpoint it came from. On any
    failure `out` is left as it was. `tokenizer`: a directory whose tokenizer files join the export."""
    if tokenizer is not None and like is not None:
        raise ValueError(f"--tokenizer {tokenizer} has no effect with --like {like}: the export copies the "
                         f"tokenizer files of {like} with its layout")
    path = checkpoint_path(run_dir, step)
    config = checkpoint_model_config(path)
    check_shapes(path, config)
    unknown = {"bos_token_id": None, "eos_token_id": None}  # not transformers' defaults 0 and 1
    ids = tokenizer_files.export_ids(tokenizer, config.vocab_size, trust_remote_code) if tokenizer else unknown
    inputs = {"--run-dir": run_dir, "--tokenizer": tokenizer, "--like": like}
    created = check_out(out, {flag: p for flag, p in inputs.items() if p is not None})
    if like is not None:
        check_like(config, like)  # before anything is written
    try:
        os.makedirs(out, exist_ok=True)
        if like is not None:
            write_like(config, dcp_fetch(path), out, like, dtype=DTYPES[dtype], experts_dtype=experts_dtype,
                       shard_bytes=shard_bytes)
        else:
            write_hf(config, dcp_fetch(path), out, dtype=DTYPES[dtype], rope_interleave=True,
                     shard_bytes=shard_bytes, config_extra=ids)
        if tokenizer:
            tokenizer_files.write_tokenizer(tokenizer, out, ids)
    except BaseException as e:
        _discard(out, created)
        if isinstance(e, OSError):
            raise ValueError(f"--out {out}: cannot write ({e.strerror or e})") from None
        raise
    return path


def _discard(out: str, created: str | None) -> None:
    """Remove what a failed export wrote into `out`: the directories it `created` (out and missing parents),
    or the files it wrote into the empty `out`."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))


def shard_limit(shard_gb: float) -> int:
    """--shard-gb in bytes; ValueError unless it is a finite number > 0."""
    if not (math.isfinite(shard_gb) and shard_gb > 0):
        raise ValueError(f"--shard-gb {shard_gb}: must be a number of GiB > 0")
    return max(1, int(shard_gb * 2**30))


def main(argv: list[str]) -> int:
    parser = ToolParser(description=__doc__.split("\n\n")[0], prefix="export error")
    parser.add_argument("--run-dir", required=True, help="the training run directory (run.dir)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--out", required=True, help="output directory: new (created) or empty")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="weight dtype in the export (default: %(default)s; config.json states it)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (tokenizer.json, tokenizer_config."
                        "json, chat template...) to copy into the export, with bos/eos ids and generation_config.json")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="with --tokenizer: run its own code (Kimi K2.5's tokenization_kimi.py)")
    parser.add_argument("--shard-gb", type=float, default=SHARD_BYTES / 2**30, help="largest shard file, GiB")
    parser.add_argument("--like", default=None, help="write in the layout of this Hugging Face directory (e.g. the "
                        "K2.5 directory training started from)")
    parser.add_argument("--experts-dtype", choices=EXPERTS_DTYPES, default=None,
                        help="with --like: routed experts INT4 where the source's are (default: int4) or bfloat16")
    args = parser.parse_args(argv)
    try:
        if args.experts_dtype is not None and args.like is None:
            raise ValueError(f"--experts-dtype {args.experts_dtype} has no effect without --like")
        if args.trust_remote_code and args.tokenizer is None:
            raise ValueError("--trust-remote-code has no effect without --tokenizer")
        path = export(args.run_dir, args.out, args.step, args.dtype, shard_limit(args.shard_gb), args.tokenizer,
                      like=args.like, experts_dtype=args.experts_dtype or "int4",
                      trust_remote_code=args.trust_remote_code)
    except (ValueError, RunError) as e:  # RunError: an unreadable checkpoint marker or shard file
        return report(e, "export error")
    print(f"exported {path} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
