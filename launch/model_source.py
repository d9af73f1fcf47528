"""A whole model in one process from what a user points at: a run directory (its newest complete checkpoint,
or `step`), one checkpoint directory (`.../checkpoints/step_N`), or a Hugging Face directory.

    load_model(path, step=None) -> (Transformer in eval mode, fp32, CPU; a line saying what was loaded)

Used by launch/evaluate.py and launch/generate.py. A training checkpoint is read from DCP one tensor at a
time (DCP reassembles each from every rank's shards, so the layout it was saved with does not matter) with
the model config its COMPLETE marker records; a Hugging Face directory through models/hf/checkpoint.py. Every problem
(no such directory, no complete checkpoint, a damaged file) is a ValueError or RunError of one line.
"""

import warnings

import torch
import torch.distributed.checkpoint as dcp

from launch.export_hf import PREFIX, check_shapes, checkpoint_model_config, checkpoint_path, dcp_fetch
from models.hf.checkpoint import load_pretrained
from models.model import Transformer
from runtime.checkpoint import checkpoint
from runtime.posttrain import init_source


def kind(path: str) -> str:
    """"hf" (config.json), "checkpoint" (a COMPLETE marker) or "run" (a complete checkpoint under
    checkpoints/); ValueError naming --model else (runtime/posttrain/init_source.py, as posttrain.init_from)."""
    return init_source.kind(path, where=f"--model {path}")


def load_model(path: str, step: int | None = None) -> tuple[Transformer, str]:
    """The model at `path` (see the module docstring) and one line naming what was loaded."""
    found = kind(path)
    if step is not None and found != "run":
        raise ValueError(f"--step {step}: only with a run directory (--model {path} is a {found} directory)")
    if found == "hf":
        model = load_pretrained(path)
        return model, f"model: Hugging Face directory {path}"
    ckpt = path if found == "checkpoint" else checkpoint_path(path, step)
    return load_checkpoint(ckpt), f"model: checkpoint {ckpt} (step {checkpoint.checkpoint_step(ckpt)})"


@torch.no_grad()
def load_checkpoint(path: str) -> Transformer:
    """The model of the DCP checkpoint `path`, whole, fp32, CPU, eval mode: one DCP read of every tensor
    in place; a checkpoint it does not fit (routed experts' w1 and w3 stored apart, from before they were
    fused) or a damaged one goes tensor by tensor through export_hf's reader, which says what is wrong."""
    config = checkpoint_model_config(path)
    check_shapes(path, config)  # a marker that does not belong to the tensors: one line, not a copy_ error
    model = Transformer(config)
    state = model.state_dict()
    try:
        with warnings.catch_warnings():  # DCP warns that no process group exists: one process is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({PREFIX + name: t for name, t in state.items()}, checkpoint_id=path, no_dist=True)
    except (Exception, dcp.CheckpointException):  # CheckpointException is a BaseException
        fetch = dcp_fetch(path)
        for name, tensor in state.items():
            tensor.copy_(fetch(name))
    return model.eval()
