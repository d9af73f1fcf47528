"""This rank's tensors of each post-training step: student rows, teacher rows, and where every trained
and target token lives. `RolloutLoader.batch` asks the rollouts once a step for the step's plan and this
rank's trajectories (runtime/posttrain/rollout_file.py), then builds each slot's tensors here.

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
                Then the items: `hint + tokens[at:end]` of item k at RoPE positions at, at+1, ...,
                attending to its trajectory's cached tokens[:at] and to itself. Item k of the slot is
                forwarded whole by cp rank k % cp, its items packed in one item row [1, Si]: in the
                row's positions, item after item, its cached prefix (`item_cache_IT`: T slots gathered
                from the prefix cache at `item_cache_positions_T`) then its own tokens (at
                `item_positions_S`), the document mask (`item_doc_IL`, one document per item) keeping
                each item to its own prefix and tokens; no padding but a row of one token on a cp rank
                without items. `pack=False`: one item per row, its prefix right-aligned in Tp slots (the
                slots before it hidden by the mask), padded to the slot's longest item. Teacher tokens
                per trajectory: A + sum(H + end - at) instead of sum(at + H + end - at) with one full
                row per item. No prefix row and I = 0 on every rank when the step has no feedback.
  trained       flat indices into the local B*S positions of assistant tokens, with label, advantage
                and behaviour log-prob.
  targets       the slot's target tokens in one canonical order. A target's student position j-1 and
                its teacher position (its item's first query + j+H-1-at) may sit on different cp ranks;
                each rank lists the targets it holds on the teacher side (`teacher_flat`, in order) and,
                for those it holds on the student side, which cp rank and list slot their teacher data
                comes from (`source_rank`, `source_slot`). The objective all-gathers that data over cp.
  positions     every position this rank forwards (its student chunks, its prefix chunks, its item rows'
                queries) and how many are padding: `padding_fraction` sums both over every rank, so
                it covers each forwarded position once on any layout.

Letters: B rows, S local positions (L/cp), n trained tokens here, m targets here, P cp ranks, I item
rows, T cached slots of the item rows, L' = T + Si.
"""

from typing import NamedTuple

import numpy as np
import torch

from models.document_attention import Documents
from parallel.context_parallel import load_balanced_positions
from runtime.data.documents import rope_positions
from runtime.posttrain.rollout_file import InMemoryRollouts, RolloutFile, Rollouts
from runtime.posttrain.rollouts import Feedback, Trajectory


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
    item_positions_S: torch.Tensor  # int64 their positions in the item rows (among the cached slots)
    item_cache_IT: torch.Tensor  # int64 into Bp*Lp (whole prefix rows): each item's cached tokens[:at]
    item_cache_positions_T: torch.Tensor  # int64 their positions in the item rows
    item_doc_IL: torch.Tensor  # int64 [I, T + Si] document of every position: its item (packed) or 1, 0 hidden
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
    """One slot's tensors on cp rank `cp_rank` (pure); `pack`: trajectories, teacher prefixes and items
    packed in one row each with document masking, else one per row."""
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
    teacher, first_query, item_pad = _teacher_rows(trajs, n_prefix_rows, n_item_rows, cp, cp_rank, pack)
    here = _local(student, positions_S)
    counted = [here["pad"], teacher["teacher_pad_BS"], torch.as_tensor(item_pad)]
    as_t = torch.as_tensor
    return RolloutMicroBatch(
        inputs_BS=here["inputs"], positions_S=positions_S, pad_BS=here["pad"], documents=here["documents"],
        **trained, **teacher,
        teacher_flat_m=as_t(first_query[item_k[mine_t] // cp] + q[mine_t]), teacher_labels_m=as_t(labels[mine_t]),
        teacher_counts_P=[int((t_owner == r).sum()) for r in range(cp)],
        target_flat_m=as_t(rows_s[mine_s] * S + local[p[mine_s]]), target_labels_m=as_t(labels[mine_s]),
        source_rank_m=as_t(t_owner[mine_s]), source_slot_m=as_t(slot[mine_s]),
        positions=sum(x.numel() for x in counted), padding=sum(int(x.sum()) for x in counted))


def _prefix_length(t: Trajectory) -> int:
    """The teacher's shared prefix of `t`: up to the largest `at` of its items."""
    return max(item.at for item in t.feedback)


def _item_tokens(t: Trajectory, item: Feedback) -> np.ndarray:
    """What the teacher forwards for `item` after its cached prefix tokens[:at]: hint + tokens[at:end]."""
    return np.concatenate([item.hint, t.tokens[item.at:t.turns[item.turn].end]])


def _teacher_rows(trajs: list[Trajectory], n_prefix_rows: int, n_item_rows: int, cp: int, cp_rank: int,
                  pack: bool) -> tuple[dict, np.ndarray, np.ndarray]:
    """(the teacher's tensors of this cp rank, the flat query index where each of its items starts, the
    item rows' padding [I, Si]): prefix rows and item rows (module docstring)."""
    fed = [t for t in trajs if t.feedback]
    prefix = _rows([t.tokens[:_prefix_length(t)] for t in fed], n_prefix_rows, cp, pack)
    Lp = prefix.tokens_BL.shape[1]
    p_positions_S, _ = _local_index(Lp, cp, cp_rank)
    items = [(b, item) for b, t in enumerate(fed) for item in t.feedback][cp_rank::cp]
    segments = [_item_tokens(fed[b], item) for b, item in items]
    cached = [prefix.row_b[b] * Lp + prefix.offset_b[b] + np.arange(item.at) for b, item in items]
    rows = (_packed_items if pack else _item_per_row)(segments, cached, min(n_item_rows, 1) if pack else n_item_rows)
    here = _local(prefix, p_positions_S)
    as_t = torch.as_tensor
    tensors = {"teacher_inputs_BS": here["inputs"], "teacher_positions_S": p_positions_S,
               "teacher_pad_BS": here["pad"], "teacher_documents": here["documents"],
               **{name: as_t(x) for name, x in rows.items() if name.startswith("item_")}}
    return tensors, rows["first_query"], rows["pad_IS"]


def _packed_items(segments: list[np.ndarray], cached: list[np.ndarray], n_rows: int) -> dict:
    """Every item in one row (none when n_rows is 0): item k's cached prefix, then its tokens, then the
    next item's; a row without items holds one padding token, its own document."""
    at = np.array([len(c) for c in cached], dtype=np.int64)
    size = np.array([len(x) for x in segments], dtype=np.int64)
    start = np.cumsum(at + size) - at - size  # where item k's cached prefix starts in the row
    queries = [start[k] + at[k] + np.arange(size[k]) for k in range(len(segments))]
    positions = np.concatenate(queries) if segments else np.zeros(min(n_rows, 1), dtype=np.int64)
    length = int((at + size).sum()) if segments else len(positions)
    doc = np.full(length, len(segments), dtype=np.int64)
    for k in range(len(segments)):
        doc[start[k]:start[k] + at[k] + size[k]] = k
    rope = np.concatenate([at[k] + np.arange(size[k]) for k in range(len(segments))] or [positions * 0])
    tokens = np.concatenate(segments) if segments else positions * 0
    cache_positions = np.concatenate([start[k] + np.arange(at[k]) for k in range(len(segments))] or [positions[:0]])
    rows = slice(0, n_rows)
    return {"item_inputs_IS": tokens[None][rows], "item_positions_S": positions,
            "item_cache_IT": np.concatenate(cached or [positions[:0]])[None][rows],
            "item_cache_positions_T": cache_positions, "item_doc_IL": doc[None][rows],
            "item_rope_IS": rope[None][rows], "first_query": np.cumsum(size) - size,
            "pad_IS": (doc[positions] == len(segments))[None][rows]}


def _item_per_row(segments: list[np.ndarray], cached: list[np.ndarray], n_rows: int) -> dict:
    """One item per row (the reference layout): its cached prefix right-aligned in Tp slots (those before
    it hidden: document 0), its tokens (document 1) and padding to the longest item (document 2)."""
    Tp = max((len(c) for c in cached), default=0) + 1  # >= 1 slot: every query sees a key
    Si = max((len(x) for x in segments), default=1)
    tokens_IS = np.zeros((n_rows, Si), dtype=np.int64)
    cache_IT = np.zeros((n_rows, Tp), dtype=np.int64)
    doc_IL = np.zeros((n_rows, Tp + Si), dtype=np.int64)
    rope_IS = np.tile(np.arange(Si), (n_rows, 1))
    for i, (seg, c) in enumerate(zip(segments, cached)):
        tokens_IS[i, :len(seg)] = seg
        cache_IT[i, Tp - len(c):] = c
        doc_IL[i, Tp - len(c):Tp + len(seg)], doc_IL[i, Tp + len(seg):] = 1, 2
        rope_IS[i] += len(c)
    return {"item_inputs_IS": tokens_IS, "item_positions_S": Tp + np.arange(Si), "item_cache_IT": cache_IT,
            "item_cache_positions_T": np.arange(Tp), "item_doc_IL": doc_IL, "item_rope_IS": rope_IS,
            "first_query": Si * np.arange(len(segments)), "pad_IS": doc_IL[:, Tp:] != 1}


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
                 trajectories: list[Trajectory] | None = None, rollouts: Rollouts | None = None, group=None,
                 pack: bool = True):
        """Reads `rollouts` (runtime/posttrain/rollout_file.py), else `trajectories` (in memory, e.g. fresh on-policy
        rollouts), else opens `data.path` (this rank validating its share; RunError naming the file and the
        line). `group`: where the ranks agree each step that the file is unchanged (gloo; None: no process
        group). `pack=False`: one trajectory (and teacher item) per row, padded (the layout packing
        replaced, kept as the tests' reference)."""
        if rollouts is None and trajectories is not None:
            rollouts = InMemoryRollouts(trajectories, seed, data.batch_tokens)
        elif rollouts is None:
            rollouts = RolloutFile(data.path, vocab_size, max_seq_len, seed=seed, batch_tokens=data.batch_tokens)
        self.rollouts, self.group = rollouts, group
        self.plan, self.stats = rollouts.plan, rollouts.stats
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
        return (f"rollouts data.path={self.rollouts.describe()}: {tokens:,} tokens, {len(costs):,} trajectories, "
                f"{steps}")

    def batch(self, step: int) -> RolloutStep:
        """The step's micro-batches for this rank; a pure function of (file, seed, batch_tokens, step).
        One call to the rollouts gives the step's slots and this rank's trajectories (collective on
        `group` for a file); the row counts every rank shares and the step's totals come from the
        trajectories' numbers (`self.stats`)."""
        mine = [m * self.dp + self.dp_rank for m in range(self.grad_accum)]
        planned = self.rollouts.step(step, self.grad_accum * self.dp, mine, self.group)
        items = self.stats.feedback
        n_rows = max(1, max(len(s) for s in planned.slots))
        n_prefix = max(int((items[s] > 0).sum()) for s in planned.slots)
        n_items = max(-(-int(items[s].sum()) // self.cp) for s in planned.slots)
        micro = [build_micro_batch(trajs, n_rows, n_prefix, n_items, self.cp, self.cp_rank, self.pack)
                 for trajs in planned.trajectories]
        st, ids = self.stats, planned.ids
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

    def record(self) -> dict:
        """What a checkpoint records of the data read (the rollout file's identity)."""
        return self.rollouts.record()

    def changes(self, saved: dict) -> str | None:
        """A line naming how the rollouts changed since the checkpoint `saved` (its marker), or None."""
        return self.rollouts.changes(saved)
