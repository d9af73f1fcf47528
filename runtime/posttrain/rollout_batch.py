"""This rank's tensors of each post-training step: student rows, teacher rows, and where every trained
and target token lives (runtime/posttrain/rollouts.py says which trajectories make up a step and its slots).

A slot (one micro-batch of one dp rank) becomes, on each cp rank of its group:
  student row   [1, S]: the slot's trajectories packed end to end (document masking: attention stays in
                each trajectory, RoPE restarts at each, models/document_attention.py), padded at the
                end to L = a multiple of 2*cp; every rank has one row, so all run the same forwards (an
                empty slot is a row of padding); cp rank i holds the load-balanced chunks i and
                2*cp-1-i (parallel/context_parallel.py). `pack=False`: one trajectory per row, each
                padded to the longest, rows up to the step's largest slot (the reference layout).
  teacher       the prefix-shared teacher: each trajectory with feedback up to A, the largest `at` of
                its items, packed into a prefix row [1, Sp] like the student's and split over cp;
                the teacher's pass over it fills a KV cache of the whole row (under cp: gathered).
                Then one item row [I, Si] per feedback item, `hint + tokens[at:end]` at RoPE positions
                at, at+1, ..., which attends to its trajectory's cached tokens[:at] and to itself
                (`item_cache`, `item_doc`: the cached prefix right-aligned in Tp slots, the slots
                before it hidden by the document mask), padded to the slot's longest item. Item k of
                the slot is forwarded whole by cp rank k % cp. Teacher tokens per trajectory:
                A + sum(H + end - at) instead of sum(at + H + end - at) with one full row per item.
                No prefix row and I = 0 on every rank when the step has no feedback.
  trained       flat indices into the local B*S positions of assistant tokens, with label, advantage
                and behaviour log-prob.
  targets       the slot's target tokens in one canonical order. A target's student position j-1 and
                its teacher position (row of its item, index j+H-1-at) may sit on different cp ranks;
                each rank lists the targets it holds on the teacher side (`teacher_flat`, in order) and,
                for those it holds on the student side, which cp rank and list slot their teacher data
                comes from (`source_rank`, `source_slot`). The objective all-gathers that data over cp.

Letters: B rows, S local positions (L/cp), n trained tokens here, m targets here, P cp ranks, I item
rows, T cached slots of an item row (Tp), L' = Tp + Si.
"""

from typing import NamedTuple

import numpy as np
import torch

from models.document_attention import Documents
from parallel.context_parallel import load_balanced_positions
from runtime.data.documents import rope_positions
from runtime.posttrain.rollout_file import RolloutFile, TrajectoryStats
from runtime.posttrain.rollouts import StepPlan, Trajectory, deal


class RolloutMicroBatch(NamedTuple):
    inputs_BS: torch.Tensor  # int64
    positions_S: torch.Tensor  # int64 global positions of the local tokens
    pad_BS: torch.Tensor  # bool: padding (no trajectory token)
    documents: Documents | None  # packed rows: where each trajectory lies (document masking), else None
    trained_flat_n: torch.Tensor  # int64 into B*S
    labels_n: torch.Tensor  # int64 the trained tokens
    advantages_n: torch.Tensor  # float32
    old_logp_n: torch.Tensor  # float32 behaviour log-probs (0 where has_old is False)
    has_old_n: torch.Tensor  # bool
    teacher_inputs_BS: torch.Tensor  # int64 [Bp, Sp] prefix rows (this rank's chunks)
    teacher_positions_S: torch.Tensor
    teacher_pad_BS: torch.Tensor  # bool
    teacher_documents: Documents | None
    item_inputs_IS: torch.Tensor  # int64 [I, Si] this cp rank's items: hint + tokens[at:end]
    item_positions_S: torch.Tensor  # int64 Tp + arange(Si): after the cached slots
    item_cache_IT: torch.Tensor  # int64 into Bp*Lp (whole prefix rows): each item's cached tokens[:at], right-aligned
    item_doc_IL: torch.Tensor  # int64 [I, Tp + Si] 0 hidden slot, 1 its prefix and tokens, 2 padding
    item_rope_IS: torch.Tensor  # int64 RoPE positions at + arange(Si)
    teacher_flat_m: torch.Tensor  # int64 into I*Si: targets whose teacher position is here, canonical order
    teacher_labels_m: torch.Tensor  # int64 their target tokens (sampled mode)
    teacher_counts_P: list[int]  # how many targets each cp rank holds on the teacher side
    target_flat_m: torch.Tensor  # int64 into B*S: targets whose student position is here
    target_labels_m: torch.Tensor  # int64 the target tokens (sampled mode)
    source_rank_m: torch.Tensor  # int64 cp rank holding each local target's teacher position
    source_slot_m: torch.Tensor  # int64 its index in that rank's teacher list
    positions: int  # positions this rank forwards (student, prefix and item rows)
    padding: int  # of which padding


class RolloutStep(NamedTuple):
    micro_batches: list[RolloutMicroBatch]
    trained_tokens: int  # over the whole step, all ranks: the L_rl denominator
    target_tokens: int  # the L_feedback denominator
    tokens: int  # real tokens forwarded (student + teacher), for tokens/s
    teacher_tokens: int  # real tokens the teacher forwards (prefix rows and item rows)


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _owner(pos: np.ndarray, length: int, cp: int) -> np.ndarray:
    """cp rank holding each global position of a row of `length` (chunk c -> c, mirror 2cp-1-c -> c)."""
    chunk = length // (2 * cp)
    c = pos // chunk
    return np.where(c < cp, c, 2 * cp - 1 - c)


def _local_index(length: int, cp: int, cp_rank: int) -> tuple[torch.Tensor, np.ndarray]:
    """(this rank's positions, local index of every global position or -1)."""
    positions_S = load_balanced_positions(length, cp, cp_rank)
    local = np.full(length, -1, dtype=np.int64)
    local[positions_S.numpy()] = np.arange(len(positions_S))
    return positions_S, local


class _Rows(NamedTuple):
    """Sequences placed in rows: sequence b starts at position offset_b[b] of row row_b[b]."""
    row_b: np.ndarray
    offset_b: np.ndarray
    tokens_BL: np.ndarray
    pad_BL: np.ndarray
    doc_BL: np.ndarray | None  # packed: document index of every position (the tail padding is one more)


def _rows(seqs: list[np.ndarray], n_rows: int, cp: int, pack: bool) -> _Rows:
    """Packed: all sequences end to end in one row (none when n_rows is 0), only its tail is padding.
    Otherwise one sequence per row, each padded at its end to the longest; n_rows rows."""
    lengths = np.array([len(x) for x in seqs], dtype=np.int64)
    if pack:
        row_b, offset_b = np.zeros(len(seqs), dtype=np.int64), np.cumsum(lengths) - lengths
        n_rows, length = min(n_rows, 1), _round_up(int(lengths.sum()), 2 * cp)
    else:
        row_b, offset_b = np.arange(len(seqs)), np.zeros(len(seqs), dtype=np.int64)
        length = _round_up(int(lengths.max(initial=1)), 2 * cp)
    tokens, pad = np.zeros((n_rows, length), dtype=np.int64), np.ones((n_rows, length), dtype=bool)
    doc = np.full((n_rows, length), len(seqs), dtype=np.int64) if pack else None
    for b, seq in enumerate(seqs):
        row, cols = row_b[b], slice(offset_b[b], offset_b[b] + len(seq))
        tokens[row, cols], pad[row, cols] = seq, False
        if pack:
            doc[row, cols] = b
    return _Rows(row_b, offset_b, tokens, pad, doc)


def _local(rows: _Rows, positions_S: torch.Tensor) -> dict:
    """(inputs, pad mask, documents or None) of this rank's positions."""
    pos = positions_S.numpy()
    documents = None if rows.doc_BL is None else Documents(
        torch.as_tensor(rows.doc_BL), torch.as_tensor(rope_positions(rows.doc_BL)[:, pos]))
    return {"inputs": torch.as_tensor(rows.tokens_BL[:, pos]), "pad": torch.as_tensor(rows.pad_BL[:, pos]),
            "documents": documents}


def build_micro_batch(trajs: list[Trajectory], n_rows: int, n_prefix_rows: int, n_item_rows: int,
                      cp: int, cp_rank: int, pack: bool = True) -> RolloutMicroBatch:
    """One slot's tensors on cp rank `cp_rank` (pure); `pack`: trajectories (and teacher prefixes) packed
    in one row with document masking, else one per row."""
    student = _rows([t.tokens for t in trajs], n_rows, cp, pack)
    length = student.tokens_BL.shape[1]
    positions_S, local = _local_index(length, cp, cp_rank)
    S = len(positions_S)
    trained = _trained(trajs, local, S, student)
    item_k, q, rows_s, p, labels = _targets(trajs, student)
    t_owner, s_owner = item_k % cp, _owner(p, length, cp)
    slot = np.zeros(len(q), dtype=np.int64)  # index of each target in its teacher owner's list
    for r in range(cp):
        slot[t_owner == r] = np.arange(int((t_owner == r).sum()))
    mine_t, mine_s = t_owner == cp_rank, s_owner == cp_rank
    teacher, Si = _teacher_rows(trajs, n_prefix_rows, n_item_rows, cp, cp_rank, pack)
    here = _local(student, positions_S)
    counted = [here["pad"], teacher["teacher_pad_BS"], teacher["item_doc_IL"][:, -Si:] != 1]
    as_t = torch.as_tensor
    return RolloutMicroBatch(
        inputs_BS=here["inputs"], positions_S=positions_S, pad_BS=here["pad"], documents=here["documents"],
        **trained, **teacher,
        teacher_flat_m=as_t(item_k[mine_t] // cp * Si + q[mine_t]), teacher_labels_m=as_t(labels[mine_t]),
        teacher_counts_P=[int((t_owner == r).sum()) for r in range(cp)],
        target_flat_m=as_t(rows_s[mine_s] * S + local[p[mine_s]]), target_labels_m=as_t(labels[mine_s]),
        source_rank_m=as_t(t_owner[mine_s]), source_slot_m=as_t(slot[mine_s]),
        positions=sum(x.numel() for x in counted), padding=sum(int(x.sum()) for x in counted))


def _teacher_rows(trajs: list[Trajectory], n_prefix_rows: int, n_item_rows: int, cp: int, cp_rank: int,
                  pack: bool) -> tuple[dict, int]:
    """(the teacher's tensors of this cp rank, Si): prefix rows and item rows (module docstring)."""
    fed = [t for t in trajs if t.feedback]
    prefix = _rows([t.tokens[:t.prefix_length()] for t in fed], n_prefix_rows, cp, pack)
    Lp = prefix.tokens_BL.shape[1]
    p_positions_S, _ = _local_index(Lp, cp, cp_rank)
    items = [(b, t, item) for b, t in enumerate(fed) for item in t.feedback][cp_rank::cp]
    segments = [t.item_tokens(item) for _, t, item in items]
    Tp = max((item.at for _, _, item in items), default=0) + 1  # >= 1 slot: every query sees a key
    Si = max((len(x) for x in segments), default=1)
    tokens_IS = np.zeros((n_item_rows, Si), dtype=np.int64)
    cache_IT = np.zeros((n_item_rows, Tp), dtype=np.int64)
    doc_IL = np.zeros((n_item_rows, Tp + Si), dtype=np.int64)
    rope_IS = np.tile(np.arange(Si), (n_item_rows, 1))
    for i, ((b, _, item), seg) in enumerate(zip(items, segments)):
        hidden = Tp - item.at
        tokens_IS[i, :len(seg)] = seg
        cache_IT[i, hidden:] = prefix.row_b[b] * Lp + prefix.offset_b[b] + np.arange(item.at)
        doc_IL[i, hidden:Tp + len(seg)], doc_IL[i, Tp + len(seg):] = 1, 2
        rope_IS[i] += item.at
    here = _local(prefix, p_positions_S)
    as_t = torch.as_tensor
    return {"teacher_inputs_BS": here["inputs"], "teacher_positions_S": p_positions_S,
            "teacher_pad_BS": here["pad"], "teacher_documents": here["documents"],
            "item_inputs_IS": as_t(tokens_IS), "item_positions_S": Tp + torch.arange(Si),
            "item_cache_IT": as_t(cache_IT), "item_doc_IL": as_t(doc_IL), "item_rope_IS": as_t(rope_IS)}, Si


def _trained(trajs: list[Trajectory], local: np.ndarray, S: int, rows: _Rows) -> dict:
    """Assistant tokens j >= 1 whose position j-1 (in its row: offset + j-1) is on this rank."""
    flat, labels, adv, old, has_old = [], [], [], [], []
    for b, t in enumerate(trajs):
        for turn in t.turns:
            if turn.role != "assistant":
                continue
            j = np.arange(max(turn.start, 1), turn.end)
            j = j[local[rows.offset_b[b] + j - 1] >= 0]
            flat.append(rows.row_b[b] * S + local[rows.offset_b[b] + j - 1])
            labels.append(t.tokens[j])
            adv.append(np.full(len(j), t.advantage))
            old.append(t.logprobs[j] if t.logprobs is not None else np.zeros(len(j)))
            has_old.append(np.full(len(j), t.logprobs is not None))
    return {"trained_flat_n": _cat(flat, torch.int64), "labels_n": _cat(labels, torch.int64),
            "advantages_n": _cat(adv, torch.float32), "old_logp_n": _cat(old, torch.float32),
            "has_old_n": _cat(has_old, torch.bool)}


def _cat(pieces: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(np.concatenate(pieces) if pieces else np.zeros(0), dtype=dtype)


def _targets(trajs: list[Trajectory], rows: _Rows) -> tuple[np.ndarray, ...]:
    """(item index in the slot, index in its item row, student row, position in that row, label) per target."""
    parts, k = [], 0
    for b, t in enumerate(trajs):
        for item in t.feedback:
            start, end = t.turns[item.turn].start, t.turns[item.turn].end
            j = np.arange(max(start, 1), end)
            parts.append(np.stack([np.full(len(j), k), j + len(item.hint) - 1 - item.at,
                                   np.full(len(j), rows.row_b[b]), rows.offset_b[b] + j - 1, t.tokens[j]]))
            k += 1
    cols = np.concatenate(parts, axis=1) if parts else np.zeros((5, 0), dtype=np.int64)
    return tuple(cols.astype(np.int64))


class RolloutLoader:
    """This rank's micro-batches of each post-training step; `state_dict()` is the next step to load."""

    def __init__(self, data, seed: int, *, vocab_size: int, max_seq_len: int, dp_rank: int = 0,
                 dp_degree: int = 1, cp_rank: int = 0, cp_degree: int = 1, grad_accum: int = 1,
                 trajectories: list[Trajectory] | None = None, pack: bool = True):
        """Reads `data.path` by its line index, this rank validating its share (runtime/posttrain/rollout_file.py;
        RunError naming the file and the line), unless `trajectories` are given (in memory, e.g. fresh
        on-policy rollouts). Either way the trajectories' numbers (`self.stats`, one TrajectoryStats
        for both) plan the steps. `pack=False`: one trajectory per row, padded (the layout packing
        replaced, kept as the tests' reference)."""
        self.trajs = trajectories if trajectories is not None else RolloutFile(data.path, vocab_size, max_seq_len)
        self.path = data.path if trajectories is None else "(in memory)"
        self.stats = TrajectoryStats.of(trajectories) if trajectories is not None else self.trajs.stats
        self.plan = StepPlan(self.stats.cost.tolist(), seed, data.batch_tokens)
        self.dp_rank, self.dp, self.cp_rank, self.cp = dp_rank, dp_degree, cp_rank, cp_degree
        self.grad_accum, self.pack = grad_accum, pack
        self.step = 0

    def describe(self) -> str:
        """What this loader reads, for the start-up line."""
        budget, costs = self.plan.batch_tokens, self.plan.costs
        over = [c for c in costs if c > budget]
        steps = (f"at most {budget:,} tokens a step" if not over else
                 f"at most {budget:,} tokens a step, except {len(over):,} trajectories over data.batch_tokens "
                 f"(up to {max(over):,} tokens), each a step of its own")
        tokens = int(self.stats.tokens.sum())
        return f"rollouts data.path={self.path}: {tokens:,} tokens, {len(costs):,} trajectories, {steps}"

    def batch(self, step: int) -> RolloutStep:
        """The step's micro-batches for this rank; a pure function of (file, seed, batch_tokens, step).
        The row counts every rank shares and the step's totals come from the trajectories' numbers
        (`self.stats`): only this rank's slots are parsed."""
        ids = self.plan.step(step)
        slots = deal(ids, self.plan.costs, self.grad_accum * self.dp)
        items = self.stats.feedback
        n_rows = max(1, max(len(s) for s in slots))
        n_prefix = max(int((items[s] > 0).sum()) for s in slots)
        n_items = max(-(-int(items[s].sum()) // self.cp) for s in slots)
        mine = [slots[m * self.dp + self.dp_rank] for m in range(self.grad_accum)]
        micro = [build_micro_batch([self.trajs[i] for i in s], n_rows, n_prefix, n_items, self.cp, self.cp_rank,
                                   self.pack) for s in mine]
        st = self.stats
        trained, target, cost, teacher = (int(x[ids].sum()) for x in (st.trained, st.target, st.cost, st.teacher))
        return RolloutStep(micro, trained, target, cost, teacher)

    def next_step(self) -> RolloutStep:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
