"""Rollout data for post-training (`data.source = "rollouts"`): the format, the checks of a line, and the plan
of the steps (runtime/posttrain/rollout_file.py reads a file through them; rollout_batch.py builds the tensors).

File format (JSON lines, one trajectory per line; blank lines are skipped):
  {"tokens": [int], "turns": [{"role": "system"|"user"|"assistant"|"tool", "start": int, "end": int}],
   "advantage": float, "logprobs": [float], "feedback": [{"turn": int, "hint": [int], "at": int}]}
`turns` are disjoint token ranges [start, end); only assistant tokens are trained, and a trajectory
must have one (at a position >= 1). `advantage` defaults to 0; |advantage| <= 1e6 (advantages are
normalized returns, O(1); beyond that the data is broken, and near 1e19 the gradient norm overflows).
`logprobs[j]` (optional) is the behaviour policy's log-prob of tokens[j]; at trained tokens it must lie
in [-103.28, 1e-3]: a probability of at most 1 (plus rounding) and at least fp32's smallest, 2^-149,
below which no fp32/bf16 sampler can draw a token (a smaller value would make the PPO ratio overflow).
Each feedback item {turn, hint[, at]} (no other keys) names an assistant turn (index into `turns`) and
non-empty hint tokens inserted at token `at` (default: the turn's start; earlier, e.g. before a chat
template's role header that is not part of the generated turn) in the teacher's context:
teacher = tokens[:at] + hint + tokens[at:end]. Lines must be UTF-8 JSON; every problem (including
integers beyond int64 and pathologically nested JSON) is one ValueError naming the file and line.

Which trajectories make up step t (a pure function of the file, the seed and t, never of the layout):
the trajectories are visited epoch after epoch, each epoch in an order drawn from a NumPy generator
seeded by (seed, epoch), and cut greedily into steps of at most `data.batch_tokens` tokens (student
tokens plus the tokens the teacher forwards, `Trajectory.cost`; a trajectory over the budget makes a
step alone). Steps run on across
epoch boundaries, but a step never holds a trajectory twice: it ends where the order comes back to one
it holds (a budget larger than the file makes steps of one epoch each). Otherwise the losses, means over
the step's tokens, would weigh the repeated trajectories more (26 copies of one, 25 of the other).

How a step is split (runtime/posttrain/rollout_batch.py turns a slot into tensors): the step's trajectories, longest
first, are dealt in snake order to grad_accum x dp slots (micro-batch m, dp rank d is slot m*dp + d).
Padding never changes a loss: a slot's trajectories are packed in one row with document masking and
the row is padded at its end (causal attention never looks ahead), and padded positions carry no label. Each rank knows the whole step, so the global token counts that the
losses divide by need no communication.

Token j is predicted at position j-1: a trained token is an assistant token with j >= 1, and the
target tokens of feedback item (turn [s, e), hint of H tokens) are j in [max(s, 1), e), at student
position j-1 and teacher position j+H-1.
"""

import json
import math
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

_ROLLOUT_STREAM = 0x50A7  # mixed into the seed so the epoch order never coincides with other seeded draws
ROLES = ("system", "user", "assistant", "tool")
ADVANTAGE_LIMIT = 1e6
LOGPROB_MIN = math.log(2.0**-149)  # -103.28: fp32's (and bf16's) smallest positive probability
LOGPROB_MAX = 1e-3  # log(1) plus the rounding of a log-prob computed in low precision


class Turn(NamedTuple):
    role: str
    start: int
    end: int


class Feedback(NamedTuple):
    turn: int
    hint: np.ndarray  # int64 token ids
    at: int  # the hint goes before token `at` (<= the turn's start)


@dataclass(frozen=True)
class Trajectory:
    tokens: np.ndarray  # int64 [n]
    turns: tuple[Turn, ...]
    advantage: float
    logprobs: np.ndarray | None  # float64 [n] or None
    feedback: tuple[Feedback, ...]

    def teacher_tokens(self, item: Feedback) -> np.ndarray:
        end = self.turns[item.turn].end
        return np.concatenate([self.tokens[:item.at], item.hint, self.tokens[item.at:end]])

    def item_tokens(self, item: Feedback) -> np.ndarray:
        """What the teacher forwards for `item` after the shared prefix tokens[:at]: hint + tokens[at:end]."""
        return np.concatenate([item.hint, self.tokens[item.at:self.turns[item.turn].end]])

    def prefix_length(self) -> int:
        """Tokens of the teacher's shared prefix pass: the largest `at` of the feedback items (0 without)."""
        return max((f.at for f in self.feedback), default=0)

    def teacher_cost(self) -> int:
        """Tokens the teacher forwards: the shared prefix once, then each item's hint and turn."""
        return self.prefix_length() + sum(len(f.hint) + self.turns[f.turn].end - f.at for f in self.feedback)

    def cost(self) -> int:
        """Tokens forwarded for this trajectory: the student row and the teacher's tokens."""
        return len(self.tokens) + self.teacher_cost()

    def trained_tokens(self) -> int:
        return sum(t.end - max(t.start, 1) for t in self.turns if t.role == "assistant" and t.end > 1)

    def target_tokens(self) -> int:
        return sum(self.turns[f.turn].end - max(self.turns[f.turn].start, 1) for f in self.feedback)


# ---- reading and validating ------------------------------------------------------------------

def read_rollouts(path: str, vocab_size: int, max_seq_len: int) -> list[Trajectory]:
    """Every trajectory of the file, validated; ValueError naming data.path, the line and the numbers."""
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"data.path: cannot read rollouts file {path!r}: {e.strerror}") from None
    out = [t for number, raw in enumerate(lines, start=1)
           if (t := parse_line(raw, number, path, vocab_size, max_seq_len)) is not None]
    if not out:
        raise ValueError(f"data.path: rollouts file {path} holds no trajectory")
    return out


def parse_line(raw: bytes, number: int, path: str, vocab_size: int, max_seq_len: int) -> Trajectory | None:
    """The trajectory of line `number` (its bytes), None for a blank line; ValueError naming data.path and the line."""
    try:
        line = raw.decode("utf-8")
        return _parse(line, vocab_size, max_seq_len) if line.strip() else None
    except UnicodeDecodeError as e:
        raise ValueError(f"data.path: {path} line {number}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                         f"{e.start + 1})") from None
    except ValueError as e:
        raise ValueError(f"data.path: {path} line {number}: {e}") from None


def _parse(line: str, vocab_size: int, max_seq_len: int) -> Trajectory:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # CPython's parser checks its depth: no crash, this error
        raise ValueError("malformed JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise ValueError(f"malformed JSON ({str(e)[:120]})") from None
    return trajectory_from_record(record, vocab_size, max_seq_len)


def trajectory_from_record(record, vocab_size: int, max_seq_len: int) -> Trajectory:
    """One validated trajectory from a decoded record (the file format above, as a dict); ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = set(record) - {"tokens", "turns", "advantage", "logprobs", "feedback"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    tokens = _token_ids(record.get("tokens"), "tokens", vocab_size)
    if not 1 <= len(tokens) <= max_seq_len:
        raise ValueError(f"tokens: {len(tokens)} tokens, must be in [1, model.max_seq_len={max_seq_len}]")
    turns = _turns(record.get("turns"), len(tokens))
    feedback = _feedback(record.get("feedback", []), turns, vocab_size, max_seq_len)
    advantage = _number(record.get("advantage", 0.0), "advantage")
    if abs(advantage) > ADVANTAGE_LIMIT:
        raise ValueError(f"advantage={advantage:g}: |advantage| must be <= {ADVANTAGE_LIMIT:g} (normalize the returns)")
    trajectory = Trajectory(tokens, turns, advantage, _logprobs(record.get("logprobs"), len(tokens)), feedback)
    if trajectory.trained_tokens() == 0:
        raise ValueError("no assistant token to train (an assistant turn with a token at position >= 1)")
    _check_trained_logprobs(trajectory)
    return trajectory


def _check_trained_logprobs(t: Trajectory) -> None:
    """The behaviour log-probs the loss reads (assistant tokens j >= 1) are probabilities' logs."""
    if t.logprobs is None:
        return
    for turn in t.turns:
        if turn.role == "assistant":
            for j in range(max(turn.start, 1), turn.end):
                if not LOGPROB_MIN <= t.logprobs[j] <= LOGPROB_MAX:
                    raise ValueError(f"logprobs[{j}]={t.logprobs[j]:g} (an assistant token) is not the log of a "
                                     f"probability a sampler draws: must be in [{LOGPROB_MIN:.2f}, {LOGPROB_MAX:g}]")


def _token_ids(value, key: str, vocab_size: int) -> np.ndarray:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{key}: expected a list of integer token ids")
    bad = next((t for t in value if not 0 <= t < vocab_size), None)  # Python ints: checked before int64
    if bad is not None:
        shown = str(bad) if len(str(bad)) <= 30 else f"{str(bad)[:12]}... ({len(str(bad))} digits)"
        raise ValueError(f"{key}: token id {shown} outside [0, model.vocab_size={vocab_size})")
    return np.asarray(value, dtype=np.int64)


def _number(value, key: str) -> float:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        raise ValueError(f"{key}: expected a finite number, got an integer of {len(str(abs(value)))} digits")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def _turns(value, n_tokens: int) -> tuple[Turn, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("turns: expected a non-empty list of {role, start, end}")
    turns = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("role") not in ROLES:
            raise ValueError(f"turns[{i}]: expected {{role, start, end}} with role in {list(ROLES)}, got {t!r}")
        start, end = t.get("start"), t.get("end")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise ValueError(f"turns[{i}]: start and end must be integers, got {start!r}, {end!r}")
        if not 0 <= start < end <= n_tokens:
            raise ValueError(f"turns[{i}]: range [{start}, {end}) is out of bounds or empty for {n_tokens} tokens")
        turns.append(Turn(t["role"], start, end))
    order = sorted(range(len(turns)), key=lambda i: turns[i].start)
    for a, b in zip(order, order[1:]):
        if turns[b].start < turns[a].end:
            raise ValueError(f"turns[{a}] [{turns[a].start}, {turns[a].end}) and turns[{b}] "
                             f"[{turns[b].start}, {turns[b].end}) overlap")
    return tuple(turns)


def _logprobs(value, n_tokens: int) -> np.ndarray | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n_tokens:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ValueError(f"logprobs: expected one per token ({n_tokens}), got {got}")
    return np.asarray([_number(v, f"logprobs[{j}]") for j, v in enumerate(value)], dtype=np.float64)


def _feedback(value, turns: tuple[Turn, ...], vocab_size: int, max_seq_len: int) -> tuple[Feedback, ...]:
    if not isinstance(value, list):
        raise ValueError("feedback: expected a list of {turn, hint[, at]}")
    out, seen = [], set()
    for i, item in enumerate(value):
        unknown = sorted(set(item) - {"turn", "hint", "at"}) if isinstance(item, dict) else []
        if unknown:
            raise ValueError(f"feedback[{i}]: unknown keys {unknown} (expected turn, hint and optionally at)")
        turn = item.get("turn") if isinstance(item, dict) else None
        if not isinstance(turn, int) or isinstance(turn, bool) or not 0 <= turn < len(turns):
            raise ValueError(f"feedback[{i}].turn={turn!r} is not a turn index in [0, {len(turns)})")
        if turns[turn].role != "assistant":
            raise ValueError(f"feedback[{i}].turn={turn} is a {turns[turn].role} turn; "
                             f"feedback targets assistant turns")
        if turn in seen:
            raise ValueError(f"feedback[{i}].turn={turn} already has feedback")
        seen.add(turn)
        hint = _token_ids(item.get("hint"), f"feedback[{i}].hint", vocab_size)
        if not len(hint):
            raise ValueError(f"feedback[{i}].hint is empty: the teacher would be the student (nothing to learn)")
        length = turns[turn].end + len(hint)
        if length > max_seq_len:
            raise ValueError(f"feedback[{i}]: the teacher sequence (turn end {turns[turn].end} + hint {len(hint)} "
                             f"= {length} tokens) is longer than model.max_seq_len={max_seq_len}")
        at = item.get("at", turns[turn].start)
        if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at <= turns[turn].start:
            raise ValueError(f"feedback[{i}].at={at!r} must be a token index in [0, turn start {turns[turn].start}]")
        out.append(Feedback(turn, hint, at))
    return tuple(out)


# ---- steps: which trajectories, and which slot each goes to -----------------------------------

class StepPlan:
    """The trajectory ids of every step: a pure function of (costs, seed, batch_tokens)."""

    def __init__(self, costs: list[int], seed: int, batch_tokens: int):
        self.costs, self.seed, self.batch_tokens = costs, seed, batch_tokens
        self._steps: list[list[int]] = []
        self._epoch, self._order, self._cursor = -1, np.zeros(0, dtype=np.int64), 0

    def step(self, t: int) -> list[int]:
        while len(self._steps) <= t:
            self._steps.append(self._next_step())
        return self._steps[t]

    def _next_id(self, peek: bool) -> int:
        if self._cursor == len(self._order):
            self._epoch += 1
            rng = np.random.default_rng([_ROLLOUT_STREAM, self.seed, self._epoch])
            self._order, self._cursor = rng.permutation(len(self.costs)), 0
        i = int(self._order[self._cursor])
        self._cursor += 0 if peek else 1
        return i

    def _next_step(self) -> list[int]:
        """Greedy cut; the step also ends where the order comes back to a trajectory it already holds."""
        ids = [self._next_id(False)]
        held, used = set(ids), self.costs[ids[0]]
        while (nxt := self._next_id(True)) not in held and used + self.costs[nxt] <= self.batch_tokens:
            ids.append(self._next_id(False))
            held.add(nxt)
            used += self.costs[nxt]
        return ids


def deal(ids: list[int], costs: list[int], slots: int) -> list[list[int]]:
    """ids split over `slots`, longest first in snake order (0..n-1, n-1..0, ...): balanced, deterministic."""
    out = [[] for _ in range(slots)]
    for k, i in enumerate(sorted(ids, key=lambda i: (-costs[i], i))):
        lap, pos = divmod(k, slots)
        out[pos if lap % 2 == 0 else slots - 1 - pos].append(i)
    return out
