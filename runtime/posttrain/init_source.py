"""What `posttrain.init_from` points at, and the model it supplies: shape and weights.

    posttrain.init_from = a run directory       its newest complete checkpoint (launch/pretrain.py, any layout)
                        = .../checkpoints/step_N that checkpoint
                        = a Hugging Face dir     config.json + safetensors (as model.init_from reads them)

The model's shape comes from there: the model config the checkpoint's COMPLETE marker records (as
launch/export_hf.py reads it), or the directory's config.json. A `[model]` key given in the TOML file or
on the command line must agree with it (ConfigError naming each key and both values), except the keys
that only steer training (`TRAINING_KEYS`: post-training may change the balancing and the init is
unused). No collective and no tensor bytes: load_config runs this on every rank before any process group.
"""

import dataclasses
import os

from models.config import ModelConfig
from models.hf.config import read_hf_config
from models.presets import preset
from runtime.checkpoint import dirs as checkpoint_dirs

TRAINING_KEYS = ("aux_loss_alpha", "bias_update_speed", "init_std")


def kind(path: str, where: str | None = None) -> str:
    """"hf", "checkpoint" or "run"; ValueError (one line starting with `where`, default
    "posttrain.init_from=PATH") otherwise. launch/model_source.py asks the same for --model."""
    where = where or f"posttrain.init_from={path}"
    if not os.path.isdir(path):
        raise ValueError(f"{where}: {'not a directory' if os.path.exists(path) else 'no such directory'}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if os.path.isfile(os.path.join(path, checkpoint_dirs.MARKER)):
        return "checkpoint"
    if checkpoint_dirs.latest_checkpoint(checkpoint_dirs.checkpoint_dir(path)) is not None:
        return "run"
    raise ValueError(f"{where}: neither a run directory with a complete checkpoint, a complete checkpoint (no "
                     f"{checkpoint_dirs.MARKER} marker) nor a Hugging Face directory (no config.json)")


def checkpoint_path(path: str) -> str:
    """The DCP checkpoint `path` names: itself, or a run directory's newest complete one."""
    if kind(path) == "checkpoint":
        return path
    return checkpoint_dirs.latest_checkpoint(checkpoint_dirs.checkpoint_dir(path))


def source_model(path: str) -> ModelConfig:
    """The model config recorded at `path` (ValueError naming posttrain.init_from)."""
    if kind(path) == "hf":
        try:
            return read_hf_config(path)[0]
        except ValueError as e:
            raise ValueError(f"posttrain.init_from: {e}") from None
    ckpt = checkpoint_path(path)
    try:
        saved = checkpoint_dirs.read_meta(ckpt).get("model")
        return ModelConfig(**saved)
    except (checkpoint_dirs.Unloadable, TypeError, ValueError) as e:
        raise ValueError(f"posttrain.init_from={ckpt}: its {checkpoint_dirs.MARKER} marker records no usable "
                         f"model config ({e})") from None


def model_config(path: str, preset_name: str | None, overrides: dict) -> ModelConfig:
    """The checkpoint's model with the training-only `overrides`; ValueError naming every given key that
    contradicts it (`preset_name`: the preset given explicitly, None when it was not)."""
    base = source_model(path)
    clashes = [f"model.{k}={v!r} (checkpoint: {getattr(base, k)!r})" for k, v in overrides.items()
               if k not in TRAINING_KEYS and getattr(base, k) != v]
    if preset_name is not None:
        shape = {k: v for k, v in dataclasses.asdict(preset(preset_name)).items()
                 if k not in TRAINING_KEYS and k not in overrides and getattr(base, k) != v}
        if shape:
            clashes.insert(0, f"model.preset={preset_name!r} ({', '.join(f'{k}={v!r}' for k, v in shape.items())}; "
                              f"checkpoint: {', '.join(f'{k}={getattr(base, k)!r}' for k in shape)})")
    if clashes:
        raise ValueError(f"{'; '.join(clashes)}: contradicts posttrain.init_from={path}, which supplies the "
                         f"model's shape; drop the key (only {', '.join(TRAINING_KEYS)} may differ)")
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if k in TRAINING_KEYS})


def describe(path: str) -> str:
    """One start-up line: which weights start the run, from where."""
    if kind(path) == "hf":
        return f"posttrain.init_from: model shape and weights from the Hugging Face directory {path}"
    ckpt = checkpoint_path(path)
    meta = checkpoint_dirs.read_meta(ckpt)
    return (f"posttrain.init_from: model shape and weights from checkpoint {ckpt} (step {meta.get('step')}, "
            f"saved on {meta.get('world_size')} ranks); optimizer state starts fresh")
