"""Entry point: `torchrun --nproc_per_node N launch/posttrain.py [--config PATH] [--section.key=value ...]`.

The same config, layouts, optimizers, checkpoints, metrics and training loop as launch/pretrain.py,
with the post-training objective (runtime/posttrain/objective.py) on rollout data (`data.source = "rollouts"`).
Before any collective every rank builds or checks the rollout file's line index (runtime/posttrain/rollout_file.py);
then, before the run dir is locked (a bad file leaves none behind), each rank validates its share of the
lines, and one all-gather that every rank reaches makes a bad line anywhere one line naming the file and
the line, on every rank (exit status 2). The run reads the file through the descriptor it validated.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch import precheck  # noqa: E402

if __name__ == "__main__":  # a config error exits here, before torch and the model code load
    precheck.training_job(sys.argv[1:], path_source="rollouts")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch import pretrain  # noqa: E402
from parallel.ep.direct import check_fp8_device  # noqa: E402
from runtime.checkpoint import pretrained  # noqa: E402
from runtime.posttrain import init_source  # noqa: E402
from runtime.config_parser import help_text  # noqa: E402
from runtime.posttrain.objective import FeedbackObjective, check_init_from, copy_weights, load_model_weights  # noqa: E402
from runtime.posttrain.rollout_file import RolloutFile, line_offsets  # noqa: E402
from runtime.train import build_model  # noqa: E402


def check_environment(config) -> None:
    """The device exists and the rollout file is readable, with its line index (ValueError naming the key otherwise)."""
    if config.data.source != "rollouts":
        raise ValueError(f"data.source={config.data.source!r}: post-training reads rollouts (data.source='rollouts')")
    p = config.posttrain
    if p.sft_coef == p.rl_coef == p.feedback_coef == 0:
        raise ValueError("posttrain.sft_coef=0, posttrain.rl_coef=0 and posttrain.feedback_coef=0: the loss would be "
                         "0 and train nothing (like optim.lr=0); give one of them > 0")
    if config.model.aux_loss_alpha > 0:
        raise ValueError(f"model.aux_loss_alpha={config.model.aux_loss_alpha}: the sequence-wise aux loss would count "
                         f"rollout padding; use aux-loss-free balancing (alpha=0)")
    if config.training.compile == "true":  # "auto" runs post-training eager (runtime/train.py build_model)
        raise ValueError("training.compile=true: post-training's packed rows and prefix-shared teacher are not "
                         "compiled yet; use training.compile=false (or auto, which runs it eager)")
    if config.training.device_type() == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device='cuda' but torch sees no CUDA device (use 'auto' or 'cpu')")
    for key in ("ep_dispatch_dtype", "ep_combine_grad_dtype"):
        if getattr(config.parallel, key) != "compute":
            check_fp8_device(config.training.device_type(), key)  # parallel.<key>: float8 on this device
    pretrain.check_run(config)
    line_offsets(config.data.path)  # the index; the lines are validated by the loader, a share per rank
    pretrain.check_token_sources(config)  # eval.path, when given
    if config.model_init_from:  # posttrain.init_from is a Hugging Face directory (runtime/posttrain/init_source.py)
        pretrained.check_init_from(config)
    elif config.posttrain.init_from:
        check_init_from(init_source.checkpoint_path(config.posttrain.init_from), dataclasses.asdict(config.model))


def build_objective(config, model, meshes, layout, device) -> FeedbackObjective:
    """The objective; for `initial` and `ema` teachers, a second model sharded like the student. The
    student starts from `posttrain.init_from` when given (a checkpoint of the run dir, if any, then
    takes precedence: the run resumes); a Hugging Face directory was already loaded by build_model."""
    path = config.posttrain.init_from
    if path and not pretrained.resuming(config.run.dir):
        if not config.model_init_from:
            load_model_weights(model, init_source.checkpoint_path(path))
        if dist.get_rank() == 0:
            print(init_source.describe(path), flush=True)
    elif path and dist.get_rank() == 0 and not config.model_init_from:  # build_model says so for a Hugging Face dir
        print(f"{config.run.dir} has checkpoints: resuming from them, posttrain.init_from={path} is ignored", flush=True)
    teacher = None
    if config.posttrain.teacher != "live":
        teacher = build_model(config, meshes, layout, device)
        copy_weights(model, teacher)
        teacher.requires_grad_(False)
    cp_group = meshes.cp.get_group() if layout.cp > 1 else None
    return FeedbackObjective(config.posttrain, cp_group, teacher)


def open_rollouts(config) -> RolloutFile:
    """Collective: the rollout file validated by every rank's share (RunError naming the line otherwise);
    rank 0 notes trajectories that cost more than data.batch_tokens."""
    rollouts = RolloutFile(config.data.path, config.model.vocab_size, config.model.max_seq_len,
                           seed=config.training.seed, batch_tokens=config.data.batch_tokens)
    note = rollouts.budget_note()
    if note and dist.get_rank() == 0:
        print(note, flush=True)
    return rollouts


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text("launch/posttrain.py"))
        return 0
    return pretrain.main(argv, check=check_environment, build_objective=build_objective, path_source="rollouts",
                         open_data=open_rollouts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
