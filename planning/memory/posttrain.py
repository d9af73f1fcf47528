"""Per-rank peak memory of a post-training job (`data.source = "rollouts"`, launch/posttrain.py) before
launch: the terms post-training adds to planning/memory/pretrain.py's for the teacher and the feedback losses
(launch/estimate_memory.py is the command line; it chooses this estimate for a post-training config).

    python launch/estimate_memory.py --config configs/posttrain_example.toml --world 2 \\
        [--rollout-tokens L] [--feedback-items K] [--hint-tokens H] [--turn-tokens T] [--assistant-fraction A]

The rollouts' shape is an input (the config bounds it, the file is not read): L the longest trajectory
(default model.max_seq_len, the loader's limit), K feedback items per trajectory, each a hint of H tokens
before a flagged turn of T tokens, A the fraction of a row's tokens that are trained (assistant tokens).
From it, per micro-batch on one rank (runtime/posttrain/rollout_batch.py's layout):
  packing         a slot's trajectories packed end to end into one row with document masking (only its
                  tail is padding); a slot holds max(1, data.batch_tokens / (dp x grad_accum) / cost) of
                  them, cost = L + L + K (H + T): the longest ones, alike, the worst case for a budget
  student         the row split over cp (load-balanced chunks i and 2 cp - 1 - i): t = rows x L / cp
                  tokens; A t trained (assistant turns run through a rollout); the targets of the whole
                  trajectories in this rank's chunks and at most min(K T, the rest) more per chunk
                  (`student_targets`: all of them with one trajectory a slot, 1/cp of them with many)
  teacher         prefix-shared: one pass over the packed prefix row (split like the student's: t tokens,
                  the prefix taken as the whole trajectory) fills a KV cache, then item rows of H + T
                  tokens attend to it; item k of the slot runs whole on cp rank k % cp, so a rank holds
                  ceil(rows K / cp) items and their T targets each on the teacher side
What is counted, on top of planning/memory/pretrain.py's terms for the student at t tokens per row:
  teacher_copy    posttrain.teacher = initial / ema: a second model sharded like the student (fp32
                  master shards, no gradient, no optimizer state); live: none
  logits          the student's head and losses, run in chunks of posttrain.head_chunk rows with the logits
                  recomputed in backward (models/output_head.py): the largest chunk's logits, their
                  gradient and what the losses create over them (the trained rows' fp32 log-softmax for
                  RL and SFT, the target rows' feedback KL in posttrain.mode), the head weight gradient's
                  fp32 accumulator [V, D] and the gradient of its input [t, D] (replaces pretraining's
                  logits term)
  teacher_data    the teacher's data of the local targets, kept through the student's pass: full
                  [m, V] fp32, topk m (K ids + K log-probs + tail), sampled m fp32
  teacher_pass    the teacher's forward (no grad; planning/memory/teacher.py): a block of its prefix pass or
                  its item pass (working set, dispatch, the KV cache of the whole prefix row, gathered
                  under cp) or its head at the targets of its items (their logits [items x T, V], the
                  targets' teacher data and entropy, the all-gather of that data over cp: every rank
                  receives cp x the longest list)
The loss-path terms (logits, teacher_pass's vocabulary part) are measured like the activations: the
runtime's own functions (runtime/posttrain/feedback.py, runtime/posttrain/objective.py, models/output_head.py) run on small
logits [256, 2048] under torch's MemTracker with the job's fractions, dtype and vocabulary chunk, scaled
by the real chunk's (or targets') rows x V.
Peak = params + optimizer state + teacher_copy + runtime + the largest moment: the teacher's pass, the
student's forward/backward peak with teacher_data alive, or the optimizer step (grads + muon_step); the
gradient shards count in each moment that has them (with grad_accum = 1 not before the head's backward).
"""

import dataclasses
import math

import torch
from torch import nn

from planning.memory import pretrain as E
from planning.memory import teacher as TM
from models.output_head import OutputHead
from runtime.posttrain import feedback
from runtime.posttrain.objective import FeedbackObjective, teacher_data
from runtime.posttrain.rollout_batch import RolloutMicroBatch, RolloutStep

PROBE_T, PROBE_V = 256, 2048  # the loss-path probe's logits [tokens, vocabulary]


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    rollout_tokens: int  # L: the longest trajectory
    feedback_items: int  # K: feedback items per trajectory
    hint_tokens: int  # H: tokens of one hint
    turn_tokens: int  # T: tokens of one flagged turn
    assistant_fraction: float  # A: trained tokens / tokens

    def teacher_tokens(self) -> int:
        """Teacher positions of one trajectory: the trajectory once, then each item's hint + turn."""
        return self.rollout_tokens + self.feedback_items * (self.hint_tokens + self.turn_tokens)

    def item_tokens(self) -> int:
        """Positions of one item row: its hint and its flagged turn (the prefix comes from the cache)."""
        return self.hint_tokens + self.turn_tokens

    def cost(self) -> int:
        return self.rollout_tokens + self.teacher_tokens()


# ---- the micro-batch one rank holds -------------------------------------------------------------

def rows_per_micro_batch(job, shape: RolloutShape) -> int:
    """Trajectories of the longest length in one slot: the step's budget over the slots, at least one."""
    slots = job.layout.dp * job.config.training.grad_accum
    return max(1, job.config.data.batch_tokens // slots // shape.cost())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class RowsJob(E.Job):
    """A Job whose micro-batch is `rows` rows of `length` tokens (padded to 2 cp), split over cp:
    planning/memory/pretrain.py's terms then read the post-training micro-batch."""
    rows: int = 1
    length: int = 1
    split: bool = True  # False: each row whole on this rank (the teacher's item rows)

    @property
    def tokens(self) -> tuple[int, int]:
        if not self.split:
            return self.rows, self.length
        return self.rows, _round_up(self.length, 2 * self.layout.cp) // self.layout.cp


def as_rows(job, rows: int, length: int) -> RowsJob:
    return RowsJob(**{f.name: getattr(job, f.name) for f in dataclasses.fields(E.Job)}, rows=rows, length=length)


def counts(job, shape: RolloutShape) -> dict:
    """Per rank and micro-batch: rows, student tokens t, trained n, targets m on the student side, item
    rows and targets on the teacher side, teacher tokens (the prefix row's and the item rows')."""
    rows, cp = rows_per_micro_batch(job, shape), job.layout.cp
    t = math.prod(as_rows(job, rows, shape.rollout_tokens).tokens)
    items = -(-rows * shape.feedback_items // cp)  # item k of the slot is forwarded whole by cp rank k % cp
    return {"rows": rows, "student_tokens": t, "teacher_tokens": t + items * shape.item_tokens(),
            "trained_tokens": int(shape.assistant_fraction * t), "target_tokens": student_targets(job, shape, rows, t),
            "items": items, "teacher_targets": items * shape.turn_tokens}


def student_targets(job, shape: RolloutShape, rows: int, t: int) -> int:
    """Targets whose student position one cp rank holds. The slot's trajectories are packed end to end into
    one row; cp rank i holds its chunks i and 2 cp - 1 - i, each c = rows L / (2 cp) contiguous positions
    (runtime/posttrain/rollout_batch.py). With the slot's trajectories alike (each the longest, its flagged turns at
    the same places), a chunk of c = q L + r positions holds q whole trajectories' K T targets and at most
    min(K T, r) more: all of a trajectory's targets may sit in one rank's chunks (one trajectory a slot,
    turns flagged near its end), but a row of many trajectories spreads them over the cp ranks."""
    L, KT, cp = shape.rollout_tokens, shape.feedback_items * shape.turn_tokens, job.layout.cp
    q, r = divmod(_round_up(rows * L, 2 * cp) // (2 * cp), L)
    return min(KT * rows, t, 2 * (q * KT + min(KT, r)))


# ---- the loss path, measured on small logits ----------------------------------------------------

class _Model(nn.Module):
    """Stands in for the model in the loss-path probes: hidden states [1, PROBE_T, 1] as a non-leaf output and
    the runtime's output head (models/output_head.py) of width 1 over PROBE_V (its weight, gradient and the
    chunked backward's fp32 accumulator are negligible here; `student_peak` counts them at the real width)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.h = nn.Parameter(torch.randn(PROBE_T, 1, generator=g).to(dtype))
        self.output = OutputHead(1, PROBE_V).to(dtype)
        with torch.no_grad():
            self.output.weight.copy_(torch.randn(PROBE_V, 1, generator=g))

    def forward(self, inputs_BS, positions_S, documents=None, head: bool = True):
        h_BSD = (self.h * 1)[None]
        return self.output(h_BSD) if head else h_BSD

    def head_losses(self, h_BSD, parts, chunk):
        return self.output(h_BSD.flatten(0, 1), parts, chunk)

    def logits_at(self, h_BSD, flat_n):
        return self.output(h_BSD.flatten(0, 1)[flat_n])


def _probe_batch(n: int, m: int) -> tuple[RolloutMicroBatch, RolloutStep]:
    """One row of PROBE_T tokens: n trained tokens, m targets, all their teacher data on this rank (the
    fields the student's loss reads; the teacher's rows are probed apart, `teacher_head_bytes`)."""
    g = torch.Generator().manual_seed(0)
    i64, f32 = torch.int64, torch.float32
    flat = lambda k: torch.arange(k, dtype=i64)  # noqa: E731
    labels = lambda k: torch.randint(0, PROBE_V, (k,), generator=g)  # noqa: E731
    none = dict.fromkeys(RolloutMicroBatch._fields)
    mb = RolloutMicroBatch(**{
        **none, "inputs_BS": torch.zeros(1, PROBE_T, dtype=i64), "positions_S": flat(PROBE_T),
        "pad_BS": torch.zeros(1, PROBE_T, dtype=torch.bool), "trained_flat_n": flat(n), "labels_n": labels(n),
        "advantages_n": torch.ones(n, dtype=f32), "old_logp_n": torch.zeros(n, dtype=f32),
        "has_old_n": torch.zeros(n, dtype=torch.bool), "teacher_flat_m": flat(m), "teacher_labels_m": labels(m),
        "target_flat_m": flat(m), "target_labels_m": labels(m), "positions": PROBE_T, "padding": 0})
    return mb, RolloutStep([mb], trained_tokens=max(n, 1), target_tokens=max(m, 1), tokens=PROBE_T,
                           teacher_tokens=PROBE_T)


def _teacher_losses(objective: FeedbackObjective, model: nn.Module, mb: RolloutMicroBatch):
    """What runtime/posttrain/objective.py FeedbackObjective._teacher does after the teacher's blocks, on one rank: the head
    at the targets only (`logits_at`), their teacher data and entropy (runtime/posttrain/objective.py teacher_data,
    runtime/posttrain/feedback.py entropy), the targets' logits alive throughout."""
    logits_mV = model.logits_at(model(mb.inputs_BS, mb.positions_S, head=False), mb.teacher_flat_m)
    return teacher_data(logits_mV, mb.teacher_labels_m, objective.config), feedback.entropy(logits_mV).sum()


def _peak(fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker  # private, checked on torch 2.13.0

    tracker = MemTracker()
    with tracker:
        fn()
    return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def _probe_objective(job, head_chunk: int = PROBE_T) -> FeedbackObjective:
    """The objective with the vocabulary chunk and top-k scaled to the probe's vocabulary."""
    p, V = job.config.posttrain, job.config.model.vocab_size
    return FeedbackObjective(dataclasses.replace(
        p, vocab_chunk=max(1, round(p.vocab_chunk * PROBE_V / V)), head_chunk=head_chunk,
        top_k=max(1, round(p.top_k * PROBE_V / V)) if p.top_k < V else PROBE_V))


def student_loss_bytes(job, n: int, m: int) -> float:
    """Peak bytes of the student's loss path at the real vocabulary: the largest chunk of the chunked head
    (models/output_head.py: min(head_chunk, n) trained rows, then min(head_chunk, m) target rows), its
    logits, their gradient and the losses over them. Measured on the runtime's student pass
    (runtime/posttrain/objective.py FeedbackObjective._student) with the probe's vocabulary and one chunk of PROBE_T rows
    standing for the larger real chunk (the smaller in proportion), scaled by real / probe logits."""
    dtype = torch.bfloat16 if job.c == 2 else torch.float32
    chunk = job.config.posttrain.head_chunk
    rows_n, rows_m = min(chunk, n), min(chunk, m)
    rows = max(rows_n, rows_m, 1)
    objective, model = _probe_objective(job), _Model(dtype)
    mb, step = _probe_batch(round(PROBE_T * rows_n / rows), round(PROBE_T * rows_m / rows))
    with torch.no_grad():
        data, _ = _teacher_losses(objective, model, mb) if mb.target_flat_m.numel() else ([], None)
    scale = rows * job.config.model.vocab_size / (PROBE_T * PROBE_V)
    return _peak(lambda: objective._student(model, mb, data, step)) * scale


def teacher_head_bytes(job) -> float:
    """Bytes per teacher logit (targets x V): the head at the targets, their teacher data and entropy
    (`_teacher_losses`, as runtime/posttrain/objective.py FeedbackObjective._teacher on one rank: before any all-gather)."""
    dtype = torch.bfloat16 if job.c == 2 else torch.float32
    objective, model = _probe_objective(job), _Model(dtype)
    mb, _ = _probe_batch(0, PROBE_T)
    with torch.no_grad():
        return _peak(lambda: _teacher_losses(objective, model, mb)) / (PROBE_T * PROBE_V)


def teacher_data_bytes(job, m: int) -> int:
    """Bytes of the teacher data of m targets (what runtime/posttrain/objective.py teacher_data returns)."""
    p, V = job.config.posttrain, job.config.model.vocab_size
    if p.mode == "full":
        return m * V * 4
    if p.mode == "sampled":
        return m * 4
    k = min(p.top_k, V)
    return m * (k * (4 + 8) + (4 if k < V else 0))


# ---- moments -------------------------------------------------------------------------------------

def forward_buffers(job) -> list[int]:
    """Per unit u (execution order), FSDP bytes while u runs its forward: u and the next
    training.fsdp_prefetch units (at least 1) unsharded in param_dtype."""
    sizes = E.unit_sizes(job.config.model, job.layout)
    depth = max(1, job.config.training.fsdp_prefetch)
    return [sum(sizes[u:u + 1 + depth]) * job.c for u in range(len(sizes))]


def teacher_pass(job, shape: RolloutShape, n: dict) -> dict:
    """Bytes at the largest moment of the prefix-shared teacher's forward (no grad; planning/memory/teacher.py):
    a block of its prefix pass or of its item pass (the block's FSDP units, its input, working set and
    dispatch, with the KV cache) or its head, which runs on the item rows only (its unit, their logits with
    the targets' data and entropy, the all-gather of that data over cp: every rank receives cp x the
    longest list). `teacher_pass` holds the teacher's own tensors: the cache, or the head's."""
    cfg, c, cp = job.config.model, job.c, job.layout.cp
    prefix = as_rows(job, n["rows"], shape.rollout_tokens)
    items = dataclasses.replace(as_rows(job, n["items"], shape.item_tokens()), split=False)
    cache = TM.kv_cache_bytes(job, _round_up(n["rows"] * shape.rollout_tokens, 2 * cp))  # whole rows, cp too
    buffers = forward_buffers(job)  # embedding, blocks, head

    def block(rows: RowsJob, cached: int) -> dict:
        n_seq, s_local = rows.tokens
        return {"fsdp_buffers": max(buffers[1:-1]), "activations": n_seq * s_local * cfg.dim * c,
                "recompute": TM.working(job, n_seq, s_local, cached), "dispatch": E.dispatch(rows),
                "teacher_pass": cache}

    m = n["teacher_targets"]
    head = teacher_head_bytes(job) * m * cfg.vocab_size
    gather = (cp + 1) * teacher_data_bytes(job, m) if cp > 1 else 0  # received + padded
    head = {"fsdp_buffers": buffers[-1], "activations": 0, "recompute": 0, "dispatch": 0, "teacher_pass": head + gather}
    moment = max((block(prefix, 0), block(items, shape.rollout_tokens), head), key=lambda d: sum(d.values()))
    return {**moment, "ep_kept": 0, "logits": 0, "teacher_data": 0}


def student_peak(job, shape: RolloutShape, n: dict) -> tuple[str, dict]:
    """The largest moment of the student's forward/backward, the teacher data alive throughout (the
    moments of planning/memory/pretrain.step_peak without paired micro-batches or recompute ahead, which
    post-training refuses, and with the post-training losses). The head runs in chunks of
    posttrain.head_chunk rows (models/output_head.py), so no moment holds the row's logits:
      losses   the head's backward, a chunk at a time: every block's activations, the head's unit unsharded
               (and the units FSDP prefetches before it), its weight gradient's fp32 accumulator [V, D] with a
               chunk's product added to it (compute dtype), the
               gradient of its input [t, D], the measured loss path of the largest chunk
      head     the end of the head's backward: its FSDP buffers (unsharded weight, its gradient, the
               reduce-scatter input); the fp32 accumulator is alive while it is cast to the gradient and
               freed before the reduce-scatter input exists, so it counts only beyond that input
      block l  blocks 0..l saved, block l's recompute, FSDP buffers and dispatch, the embedding's output (the
               final norm's fp32 copy and output, which planning/memory/pretrain.step_peak still counts there, are
               freed by the head's backward)"""
    student = as_rows(job, n["rows"], shape.rollout_tokens)
    cfg, c = job.config.model, job.c
    kept_L, recompute_L, edges, _ = E.activations(student)
    buffers, disp, kept = E.fsdp_buffers(student), E.dispatch(student), E.kept_rows(student)
    t, moe = n["student_tokens"], [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    sizes, depth = E.unit_sizes(cfg, job.layout), max(1, job.config.training.fsdp_prefetch)
    accumulator = cfg.vocab_size * cfg.dim * (4 + c)  # fp32, and each chunk's product [V, D] added to it
    loss_path = student_loss_bytes(job, n["trained_tokens"], n["target_tokens"]) + accumulator + t * cfg.dim * c
    embedded = t * cfg.dim * c  # the embedding's output; the final norm's tensors are gone once the head's backward ran
    every = {"activations": sum(kept_L) + edges, "recompute": 0, "dispatch": 0, "ep_kept": kept * sum(moe)}
    moments = {"losses": {"fsdp_buffers": (sizes[-1] + sum(sizes[-1 - depth:-1])) * c, **every, "logits": loss_path},
               "head": {"fsdp_buffers": buffers[-1], **every,
                        "logits": max(0, accumulator - sizes[-1] * E.DTYPE_BYTES[job.config.training.reduce_dtype])}}
    for l in range(cfg.n_layers):
        moments[f"block {l}"] = {"fsdp_buffers": buffers[l + 1], "activations": sum(kept_L[:l + 1]) + embedded,
                                 "recompute": recompute_L[l], "dispatch": disp if moe[l] else 0,
                                 "ep_kept": kept * sum(moe[:l + 1]), "logits": 0}
    at = max(moments, key=lambda k: sum(moments[k].values()))
    data = teacher_data_bytes(job, n["target_tokens"]) if shape.feedback_items else 0
    return at, {**moments[at], "teacher_data": data, "teacher_pass": 0}


def estimate(job, shape: RolloutShape) -> dict:
    """planning/memory/pretrain.estimate's result for a post-training job, with its parts and counts. The
    gradient shards are a part of each moment: with training.grad_accum = 1 none exist yet while the
    teacher runs and until the head's backward has reduce-scattered (each step starts with them freed)."""
    n = counts(job, shape)
    state = E.sharded_state(job)
    copy = state["params"] if job.config.posttrain.teacher != "live" else 0
    moments = {"teacher pass": teacher_pass(job, shape, n)} if shape.feedback_items else {}
    at, moment = student_peak(job, shape, n)
    moments[f"student {at}"] = moment
    before_grads = job.config.training.grad_accum == 1 and at in ("losses", "head")
    for name, m in moments.items():
        m["grads"] = 0 if job.config.training.grad_accum == 1 and (name == "teacher pass" or before_grads) \
            else state["grads"]
    moments["optimizer step"] = {"grads": state["grads"], "muon_step": E.muon_step(job)}
    at = max(moments, key=lambda k: sum(moments[k].values()))
    parts = {"params": state["params"], "optimizer": state["optimizer"], "teacher_copy": copy,
             "runtime": E.runtime_gib(job.device) * E.GIB, **moments[at]}
    total = sum(parts.values())
    device_gib = E.device_gib(job.device)
    fits = device_gib is None or total / E.GIB <= device_gib
    return {"per_rank_gib": {k: v / E.GIB for k, v in parts.items()}, "total_gib": total / E.GIB,
            "device_gib": device_gib, "fits": fits, "suggestions": [] if fits else suggestions(job, shape, parts, total),
            "peak_at": at, "rank": job.rank, "world": job.layout.world_size, "routing_skew": job.routing_skew,
            "micro_batch": {"sequences": n["rows"], "tokens_per_sequence": n["student_tokens"] // n["rows"]},
            "posttrain": {**n, "shape": dataclasses.asdict(shape), "teacher": job.config.posttrain.teacher,
                          "mode": job.config.posttrain.mode}}


def suggestions(job, shape: RolloutShape, parts: dict, total: int) -> list[str]:
    p, out = job.config.posttrain, [f"needs {total / E.GIB - E.device_gib(job.device):.1f} GiB less per rank"]
    if parts.get("logits", 0) + parts.get("teacher_pass", 0) > 0.25 * total:
        out.append(f"a larger parallel.cp (the losses over the logits hold {parts.get('logits', 0) / E.GIB:.1f} GiB, "
                   f"the teacher's pass {parts.get('teacher_pass', 0) / E.GIB:.1f}; both fall as 1/cp)")
    if p.mode == "full" and job.layout.cp > 1:
        out.append("posttrain.mode=topk (full gathers [targets, vocabulary] fp32 over cp)")
    if p.teacher != "live":
        out.append(f"posttrain.teacher=live (the {p.teacher} teacher's copy is {parts['teacher_copy'] / E.GIB:.1f} GiB)")
    if job.config.training.activation_checkpoint != "full":
        out.append("training.activation_checkpoint=full (keeps one block input per layer)")
    return out
