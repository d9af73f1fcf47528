"""The post-training objective (the `[posttrain]` section): RL over the trajectory plus targeted feedback.

    loss = sft_coef * L_sft + rl_coef * L_rl + feedback_coef * L_feedback

L_sft is the next-token loss -log p(token) over every assistant token (supervised fine-tuning on the
same rollouts; sft_coef = 0 by default), divided by the step's assistant-token count like L_rl.
L_rl is the clipped policy gradient over every assistant token, divided by the step's assistant-token
count; L_feedback is KL(student || stopgrad teacher) over the feedback turns' tokens only, divided by
the step's target-token count (`feedback_norm = "targets"`) or by its assistant-token count
("assistant": the feedback's weight then falls as flagged turns get rare; runtime/posttrain/feedback.py has the
per-token losses). The student is the
policy on the trajectory; the teacher is the model on tokens[:at] + hint + tokens[at:end], with
the current weights (`live`), a frozen copy of the starting weights (`initial`) or an EMA (`ema`).

Per micro-batch (runtime/posttrain/rollout_batch.py builds it), the training loop's `forward_backward` runs:
  1. teacher forwards, no grad, routers in eval mode (teacher tokens do not move the expert bias):
     one pass over each trajectory's prefix fills a KV cache (communication under cp: the K/V
     all-gather), then each feedback item's hint + turn attends to its cached prefix and to itself
     (`prefix_shared_teacher`); the head runs at the target positions only;
  2. teacher data of the targets this rank holds on the teacher side: the logits (`full`), top-k
     log-probs, ids and tail (`topk`) or the sampled token's log-prob (`sampled`);
  3. communication: all-gather of that data over the cp group (only when cp > 1; an item is forwarded
     by one cp rank, so a target's teacher position may live on another cp rank than its student one);
  4. student forward over packed rows (document masking; the tail's padding removed from the routers'
     expert counts and QK-clip's max logits), then the head and the losses over the trained tokens and
     the targets in chunks of posttrain.head_chunk tokens, logits recomputed in backward
     (models/output_head.py: memory head_chunk x V instead of the row's S x V), backward.
Every rank divides by the GLOBAL counts, which it knows from the step plan without communication, so
the per-rank losses sum to the single-process loss (parallel/gradients.py). Metrics: one all-reduce.
"""

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from models.document_attention import Documents
from models.kv_cache import KVCache
from models.output_head import LossPart
from optim.qk_clip import padding_ignored
from runtime.checkpoint import checkpoint
from runtime.posttrain import feedback, init_source
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.rollout_batch import RolloutMicroBatch, RolloutStep
from runtime.staging import to_device
from runtime.syncs import host_side


# ---- teacher data of the targets ----------------------------------------------------------------

def teacher_data(logits_NV: torch.Tensor, labels_N: torch.Tensor, config: PosttrainConfig) -> list[torch.Tensor]:
    """What the student side needs from the teacher at N target positions, as a list of [N, ...] tensors."""
    if config.mode == "full":
        return [logits_NV.float()]
    if config.mode == "sampled":
        return [feedback.token_logp(logits_NV, labels_N)]
    logp_NK, idx_NK, log_tail_N = feedback.teacher_topk(logits_NV, config.top_k)
    return [logp_NK, idx_NK] + ([] if log_tail_N is None else [log_tail_N])


def feedback_kl(student_NV: torch.Tensor, labels_N: torch.Tensor, data: list[torch.Tensor],
                config: PosttrainConfig) -> torch.Tensor:
    """Per-target KL(student || teacher) [N] in the configured mode (sampled: the surrogate)."""
    if config.mode == "full":
        return feedback.kl_full(student_NV, data[0], config.vocab_chunk)
    if config.mode == "sampled":
        return feedback.kl_sampled(feedback.token_logp(student_NV, labels_N), data[0])
    return feedback.kl_topk(student_NV, data[0], data[1], data[2] if len(data) > 2 else None)


def _gather_cp(local: list[torch.Tensor], mb: RolloutMicroBatch, group) -> list[torch.Tensor]:
    """Each local target's teacher data, fetched from the cp rank holding its teacher position.

    Communication: one all-gather over cp per tensor, each rank's list padded to the longest."""
    longest = max(mb.teacher_counts_P)
    if longest == 0:  # no target in this cp group (every rank of it knows): nothing to exchange
        return [x[:0] for x in local]
    out = []
    for x in local:
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[:len(x)] = x
        gathered = x.new_empty((len(mb.teacher_counts_P) * longest, *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded, group=group)
        out.append(gathered[mb.source_rank_m * longest + mb.source_slot_m])
    return out


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _to_device(x, device):
    if isinstance(x, Documents):  # built on the host per micro-batch, without a flex block mask (runs eager)
        return x._replace(doc_BL=to_device(x.doc_BL, device), rope_BS=to_device(x.rope_BS, device))
    return to_device(x, device) if isinstance(x, torch.Tensor) else x


def _has_padding(host_pad_BS: torch.Tensor) -> bool:
    """Whether the micro-batch has padding, read from its host-side mask (no device sync)."""
    with host_side():
        return bool(host_pad_BS.numpy().any())


def _padded_counts(experts_TK: torch.Tensor, pad_T: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Top-k copies of padding tokens per expert, int64 [E]: a scatter-add of the padding flags (a
    boolean-mask index and `bincount` would each read sizes back to the host)."""
    pad_TK = pad_T[:, None].expand_as(experts_TK).long()
    return torch.zeros(n_experts, dtype=torch.int64, device=experts_TK.device).scatter_add_(
        0, experts_TK.flatten(), pad_TK.flatten())


@contextlib.contextmanager
def _padding_ignored(model: nn.Module, pad_BS: torch.Tensor, has_padding: bool):
    """Padding tokens count neither in the routers' expert counts (the aux-loss-free bias update sees
    only trajectory tokens, so it does not depend on how much padding a layout needs) nor in QK-clip's
    max logits (optim/qk_clip.py). Nothing to do without padding. Keep it open through backward
    (activation checkpointing reruns attention and routers there; the routers' rerun is undone)."""
    if not has_padding:
        yield
        return
    pad_T = pad_BS.flatten()

    def hook(router, args, output):
        if router.training:
            router.tokens_per_expert -= _padded_counts(output[1], pad_T, router.n_experts)

    handles = [r.register_forward_hook(hook) for r in model.routers()]
    try:
        with padding_ignored(model, pad_BS):
            yield
    finally:
        for h in handles:
            h.remove()


def prefix_shared_teacher(teacher: nn.Module, mb: RolloutMicroBatch) -> torch.Tensor:
    """The teacher's logits [m, V] of the targets whose teacher position is on this rank: one pass over the
    prefix rows fills a KV cache (through each layer's `kv_source`: under cp, the all-gathered whole rows),
    then each item attends to its own cached prefix, placed in its item row before its tokens, and to
    itself (runtime/posttrain/rollout_batch.py); the head runs at the target positions only."""
    cache = KVCache(len(teacher.layers), sources=[block.attention.kv_source for block in teacher.layers])
    teacher(mb.teacher_inputs_BS, mb.teacher_positions_S, cache=cache, documents=mb.teacher_documents,
            head=False)  # communication under cp: the K/V all-gather
    documents = Documents(mb.item_doc_IL, mb.item_rope_IS)
    cached = cache.rows(mb.item_cache_IT, mb.item_cache_positions_T)
    h_ISD = teacher(mb.item_inputs_IS, mb.item_positions_S, cache=cached, documents=documents, head=False)
    return teacher.logits_at(h_ISD, mb.teacher_flat_m)


# ---- the objective ------------------------------------------------------------------------------

class FeedbackObjective:
    """`forward_backward(model, step, device)` for the training loop (runtime/train.py). The compute dtype
    is FSDP's (training.param_dtype): logits come in it, every loss is computed in fp32."""

    def __init__(self, config: PosttrainConfig, cp_group=None, teacher: nn.Module | None = None):
        """`teacher`: a model sharded like the student (initial / ema), or None to use the live weights."""
        self.config, self.cp_group, self.teacher = config, cp_group, teacher

    def forward_backward(self, model: nn.Module, step: RolloutStep, device) -> tuple[torch.Tensor, int, dict]:
        """Accumulate gradients over the step's micro-batches; (this rank's loss share, tokens, metrics)."""
        # loss, rl sum, kl sum, clipped count, teacher entropy sum, sft sum, positions, padding positions
        sums = torch.zeros(8, device=device)
        for mb in step.micro_batches:
            has_padding = _has_padding(mb.pad_BS)
            mb = RolloutMicroBatch(*(_to_device(x, device) for x in mb))
            data, entropy_sum = self._teacher(model, mb)
            with _padding_ignored(model, mb.pad_BS, has_padding):
                sums[:6] += self._student(model, mb, data, step)
            sums[4] += entropy_sum
            sums[6] += mb.positions  # host ints added to a device tensor: no sync
            sums[7] += mb.padding
        local_loss = sums[0].clone()  # the loop sums the ranks' shares (parallel/gradients.global_loss)
        if dist.is_initialized():
            dist.all_reduce(sums)  # communication: 8 floats (every rank's shares of the global means)
        n_rl, n_tgt = max(step.trained_tokens, 1), max(step.target_tokens, 1)
        _, rl, kl, clipped, entropy, sft, positions, padding = sums.tolist()  # one host sync
        metrics = {"sft_loss": sft / n_rl, "rl_loss": rl / n_rl, "feedback_kl": kl / n_tgt,
                   "target_tokens": step.target_tokens, "clip_fraction": clipped / n_rl,
                   "teacher_entropy": entropy / n_tgt, "teacher_tokens": step.teacher_tokens,
                   "padding_fraction": padding / max(positions, 1)}
        return local_loss, step.tokens, metrics

    @torch.no_grad()
    def _teacher(self, model: nn.Module, mb: RolloutMicroBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Teacher data for this rank's student-side targets, and the entropy summed over its teacher-side ones."""
        if mb.teacher_inputs_BS.shape[0] == 0:  # no feedback anywhere in the step: no rank runs a teacher
            return [], torch.zeros((), device=mb.inputs_BS.device)
        teacher = self.teacher if self.teacher is not None else model
        with _eval_mode(teacher):
            logits_mV = prefix_shared_teacher(teacher, mb)
        data = teacher_data(logits_mV, mb.teacher_labels_m, self.config)
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            data = _gather_cp(data, mb, self.cp_group)
        return data, feedback.entropy(logits_mV).sum()

    def _student(self, model, mb: RolloutMicroBatch, data: list[torch.Tensor], step: RolloutStep):
        """The student's forward and backward; its sums [loss, rl, kl, clipped, 0, sft]. The head and the
        losses run in token chunks of `head_chunk` (models/output_head.py): over the trained tokens (RL and
        SFT) and, apart, over the targets (the feedback KL)."""
        c = self.config
        n_rl = max(step.trained_tokens, 1)
        n_feedback = max(step.target_tokens if c.feedback_norm == "targets" else step.trained_tokens, 1)

        def trained(logits_cV, lo, hi):
            logp = feedback.token_logp(logits_cV, mb.labels_n[lo:hi])
            old = torch.where(mb.has_old_n[lo:hi], mb.old_logp_n[lo:hi], logp.detach())
            rl_sum, clipped = feedback.ppo_loss(logp, old, mb.advantages_n[lo:hi], c.clip_eps)
            sft_sum = -logp.sum()
            loss = (c.sft_coef * sft_sum + c.rl_coef * rl_sum) / n_rl
            return torch.stack([loss, rl_sum, torch.zeros_like(loss), clipped.float(), torch.zeros_like(loss), sft_sum])

        def targets(logits_cV, lo, hi):
            kl_sum = feedback_kl(logits_cV, mb.target_labels_m[lo:hi], [x[lo:hi] for x in data], c).sum()
            zero = torch.zeros_like(kl_sum)
            return torch.stack([c.feedback_coef * kl_sum / n_feedback, zero, kl_sum, zero, zero, zero])

        h_BSD = model(mb.inputs_BS, mb.positions_S, documents=mb.documents, head=False)
        parts = [LossPart(mb.trained_flat_n, trained)] + ([LossPart(mb.target_flat_m, targets)] if data else [])
        sums = model.head_losses(h_BSD, parts, c.head_chunk)
        sums[0].backward()
        return sums.detach()

    @torch.no_grad()
    def after_step(self, model: nn.Module) -> None:
        """EMA teacher: teacher <- decay * teacher + (1 - decay) * student, on the local shards (no
        communication: both models are sharded alike); buffers (expert bias) follow the student."""
        if self.teacher is None or self.config.teacher != "ema":
            return
        for t, s in zip(self.teacher.parameters(), model.parameters()):
            _local(t).lerp_(_local(s), 1.0 - self.config.ema_decay)
        copy_buffers(model, self.teacher)

    def state(self) -> dict:
        """Extra checkpoint entries: the teacher's weights when they are not the live ones."""
        return {} if self.teacher is None else {"teacher": TeacherState(self.teacher)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    """dst <- src, shard by shard (both parallelized alike: no communication)."""
    for t, s in zip(dst.parameters(), src.parameters()):
        _local(t).copy_(_local(s))
    copy_buffers(src, dst)


@torch.no_grad()
def copy_buffers(src: nn.Module, dst: nn.Module) -> None:
    for t, s in zip(dst.buffers(), src.buffers()):
        t.copy_(s)


class TeacherState:
    """The teacher model's weights as one checkpoint Stateful (DCP, resharded on load like the student)."""

    def __init__(self, teacher: nn.Module):
        self.teacher = teacher

    def state_dict(self) -> dict:
        return get_model_state_dict(self.teacher)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.teacher, state)


class _ModelWeights:
    """The model part of a checkpoint's "train" entry as one Stateful (the optimizer state is not read)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])


def check_init_from(path: str, model_config: dict) -> None:
    """ValueError naming posttrain.init_from unless `path` is a complete checkpoint of this model, apart from
    the training-only keys (runtime/posttrain/init_source.py); no collective."""
    if not os.path.isfile(os.path.join(path, checkpoint.MARKER)):
        raise ValueError(f"posttrain.init_from: {path} is not a complete checkpoint (no {checkpoint.MARKER} marker)")
    try:
        saved = checkpoint.read_meta(path).get("model", {})
    except checkpoint.Unloadable as e:  # a RunError: turned into the start-up check's ValueError
        raise ValueError(f"posttrain.init_from: {e}") from None
    shape = {k: v for k, v in model_config.items() if k not in init_source.TRAINING_KEYS}
    diffs = checkpoint.differences(saved, shape, "model.")
    if diffs:
        raise ValueError(f"posttrain.init_from: {path} holds another model ({'; '.join(diffs)})")


def load_model_weights(model: nn.Module, path: str) -> None:
    """Collective (DCP): the model weights (and buffers) of checkpoint `path`, resharded to this layout."""
    checkpoint.load(path, {"train": _ModelWeights(model)})
