"""The step under a pipeline schedule: torch.distributed.pipelining's stages and schedules (public API).

Placements and communication (pp > 1; parallel/pp/plan.py places the stages):
  activations  each micro-batch's hidden states h [b, s, D] (the compute dtype) go from stage to stage point
               to point inside the pp group (the ranks at one coordinate of every stage), their gradients
               back the same way; b = data.batch_size / (dp x grad_accum), s = data.seq_len / cp.
  weights      each stage is FSDP-sharded on its own stage's meshes (parallel/fsdp.py), reshard_after_forward
               off: a stage gathers its weights at its first micro-batch and keeps them for the step.
               Gradients accumulate unsharded over the micro-batches and are reduce-scattered (summed, as
               without pp) ONCE per step, by the schedule after the stage's last backward
               (PipelineStage.perform_reduce_grad); training.grad_sync does not apply.
  loss         the last stage computes `loss_fn(logits, labels, global_tokens)` per micro-batch: its share
               of the step's global mean (parallel/gradients.py); scale_grads=False, since the loss is
               already divided. Other stages return 0, so the step's all-reduced sum is the global loss.
Static metadata: each PipelineStage is declared its input and output shapes and dtypes (meta tensors), so
building it runs no forward (without them torch runs one real forward to infer shapes, which counts a
micro-batch in every router and every QK-clip maximum) and exchanges no shapes.
Evaluation runs the forwards of a schedule of its own (`forward_loss`: looped breadth-first, or ZBV's order
for the V placement, over stages declared apart, its backward actions doing nothing), so training's stages
are never switched between modes.
Micro-batches: the loader's training.grad_accum micro-batches are concatenated on the batch dim and the
schedule cuts them back the same way (`step`, which also sets what the schedule's private
`_step_microbatches` needs). Every rank passes the tokens, the labels and the positions; a stage reads
what it needs (the first stage the tokens, the last the labels, all the positions, carried as one value
every micro-batch shares: parallel/pp/part.py `StageInputs`). Each stage's module is its FSDP root, as
torch's stage needs to run FSDP's gradient reduction itself.
"""

import torch
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD, REDUCE_GRAD

from parallel import _torch_private
from parallel.gradients import loss_fn
from parallel.pp.part import StageInputs
from parallel.pp.plan import V_SCHEDULES, n_stages, rank_stages

SCHEDULE_CLASSES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B,
                    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
SINGLE_STAGE = ("1f1b", "gpipe")  # PipelineScheduleSingle: one stage per rank
# forward-only evaluation: each micro-batch through the stages in their placement's order (parallel/pp/plan.py)
EVAL_CLASSES = {"loop": ScheduleLoopedBFS, "v": ScheduleZBVZeroBubble}


def _pipeline_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, global_tokens: int) -> torch.Tensor:
    return loss_fn(logits_BSV, labels_BS, global_tokens)


class Pipeline:
    """This rank's stages and the schedule over them. `micro_shape` = (b, s): one micro-batch's rows and
    local sequence length on this rank; `dtype`: the compute dtype (training.param_dtype)."""

    def __init__(self, stages, layout, pp_mesh, micro_shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device, n_micro_batches: int):
        c = layout.pp_config
        total, ids = n_stages(c), rank_stages(pp_mesh.get_local_rank(), c)

        def declared():
            return [_stage(part, index, total, micro_shape, dtype, device, pp_mesh.get_group())
                    for part, index in zip(stages, ids)]

        single = c.pp_schedule in SINGLE_STAGE
        self.schedule = _schedule(SCHEDULE_CLASSES[c.pp_schedule], declared(), single, n_micro_batches)
        placement = "v" if c.pp_schedule in V_SCHEDULES else "loop"
        self.eval_schedule = _schedule(EVAL_CLASSES[placement], declared(), False, n_micro_batches)
        _forward_only(self.eval_schedule)

    def forward_backward(self, micro_batches, global_tokens: int, device) -> torch.Tensor:
        """Forward and backward of every micro-batch under the schedule; this rank's share of the global
        mean loss (the sum of its micro-batches' losses on the last stage's ranks, 0 elsewhere)."""
        args, labels, inputs = _whole_batch(micro_batches, device)
        losses = []
        self.schedule.step(*args, target=labels, losses=losses, return_outputs=False,
                           loss_kwargs={"global_tokens": global_tokens}, inputs=inputs)
        return _local_loss(losses, device)

    @torch.no_grad()
    def forward_loss(self, micro_batches, global_tokens: int, device) -> torch.Tensor:
        """The schedule's forward only (evaluation): this rank's share of the mean loss, as above."""
        args, labels, inputs = _whole_batch(micro_batches, device)
        losses = []
        self.eval_schedule.eval(*args, target=labels, losses=losses, loss_kwargs={"global_tokens": global_tokens},
                                inputs=inputs)
        return _local_loss(losses, device)


def _schedule(cls, stages: list, single: bool, n_micro_batches: int):
    return cls(stages[0] if single else stages, n_micro_batches, loss_fn=_pipeline_loss, scale_grads=False)


def _forward_only(schedule) -> None:
    """Evaluation's schedule does nothing for its backward actions (public hook of torch's runtime
    schedules): torch 2.13's `eval()` still runs them, and a V schedule's backward asserts there when the
    next stage sits on the same rank; its gradient reduction must not run either."""
    for kind in (FULL_BACKWARD, BACKWARD_INPUT):
        schedule.register_custom_function(kind, _no_backward)
    for kind in (BACKWARD_WEIGHT, REDUCE_GRAD):
        schedule.register_custom_function(kind, _nothing)


def _no_backward(action, context) -> None:
    """A skipped backward: only the (empty) gradient receive it would have waited for is forgotten."""
    _torch_private.drop_backward_receive(context.schedule_ref, action.stage_index, action.microbatch_index)


def _nothing(action, context) -> None:
    pass


def _stage(part, index: int, total: int, micro_shape, dtype, device, group) -> PipelineStage:
    """A PipelineStage of `part` with its metadata declared (meta tensors): no forward at construction."""
    b, s = micro_shape
    dim, vocab = part.config.dim, part.config.vocab_size
    first, last = index == 0, index == total - 1
    x = (torch.empty(b, s, dtype=torch.int64, device="meta") if first
         else torch.empty(b, s, dim, dtype=dtype, device="meta", requires_grad=True))
    y = torch.empty(b, s, vocab if last else dim, dtype=dtype, device="meta", requires_grad=True)
    return PipelineStage(part, index, total, device, input_args=x, output_args=y, group=group)


def _whole_batch(micro_batches, device):
    """((tokens,), labels, StageInputs): the micro-batches concatenated on the batch dim."""
    inputs_BS = torch.cat([m[0] for m in micro_batches]).to(device)
    labels_BS = torch.cat([m[1] for m in micro_batches]).to(device)
    return (inputs_BS,), labels_BS, StageInputs(micro_batches[0][2].to(device))


def _local_loss(losses: list[torch.Tensor], device) -> torch.Tensor:
    total = torch.zeros((), device=device)
    for loss in losses:
        total += loss.detach()
    return total
