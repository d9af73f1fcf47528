"""The rollouts a post-training run reads: the file validated once and read through the descriptor
opened for that validation, its line index, each trajectory's numbers, the step plan, and each step's
trajectories for this rank (runtime/posttrain/rollouts.py has the format, the checks of a line and the plan).
The batcher (runtime/posttrain/rollout_batch.py) asks `Rollouts.step` once a step; this file reads and parses.

  index       `<file>.index.npz` beside the file: the byte offset where every line starts (and the
              file's size at the end), with the file's name, size, mtime and a SHA-256 of its first
              MiB. Built by a chunked byte scan (no JSON parsed), once: a later run whose file still
              has that size, mtime and head reuses it; a changed file rebuilds it (written atomically,
              so ranks that build it at once write the same bytes in turn); an unwritable folder
              keeps it in memory. An index naming another file, or one that is not an index, is
              refused in one line (it is not ours to overwrite).
  validation  rank r of W parses and validates the lines that start in bytes [r*size/W,
              (r+1)*size/W) of the file, one line at a time, and notes each trajectory's numbers
              (`TrajectoryStats`: what a step's plan and totals need) and a CRC-32 of its line's bytes.
              One all-gather of those numbers and of each rank's first error, which every rank reaches
              whatever it found, so no rank waits on one that stopped: the lowest failing rank's error
              (the file's first bad line, as a sequential read reports it) is raised on every rank.
  reading     a step's trajectories are read by offset from the descriptor opened before validation and
              parsed again (a few most recent stay cached, by tokens): a rank holds the index and the
              numbers, 8 bytes per line and 64 per trajectory (its line, six numbers, its CRC), never
              the file. A step's plan comes from the numbers, so a rank parses only its own
              micro-batches' trajectories.
  identity    the file is read as validated or not at all. The descriptor keeps a file that is replaced
              (renamed over, deleted) readable as it was; a file rewritten in place is caught at the
              next step: its size or mtime (fstat of the descriptor) differs, or a line read has
              another CRC than at validation. Each step the ranks agree on it (one all-reduce of a flag
              on the group given, gloo: no device sync), and every rank stops with the same line
              naming the file and what changed (RunError, exit status 2): never a traceback, never
              bytes that were not validated. The checkpoint records the file's identity (`record`);
              a resume names what changed since (`changes`).

Without a process group the one process validates the whole file, one line at a time.
"""

import hashlib
import os
import zlib
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from runtime.errors import RunError
from runtime.syncs import host_side
from runtime.posttrain.rollouts import StepPlan, Trajectory, deal, parse_line

HEAD_BYTES = 1 << 20  # the head hashed into the index's key
SCAN_BYTES = 1 << 24  # bytes read at a time while scanning for line ends
CACHE_TOKENS = 1 << 22  # tokens of recently parsed trajectories kept (a step's, typically)


class TrajectoryStats(NamedTuple):
    """Each trajectory's numbers (int64 [n] each), from a file's validation or from trajectories in
    memory: the step plan (costs), the slots' row counts and the step's totals come from these, so
    building a step parses only this rank's trajectories."""
    cost: np.ndarray  # tokens forwarded: student and teacher (Trajectory.cost, the budget's unit)
    tokens: np.ndarray  # student tokens
    teacher: np.ndarray  # tokens the teacher forwards (Trajectory.teacher_cost)
    trained: np.ndarray  # trained tokens, the L_rl denominator
    target: np.ndarray  # target tokens, the L_feedback denominator
    feedback: np.ndarray  # feedback items (a trajectory with any has a teacher prefix row)

    @staticmethod
    def row(t: Trajectory) -> tuple[int, ...]:
        return t.cost(), len(t.tokens), t.teacher_cost(), t.trained_tokens(), t.target_tokens(), len(t.feedback)

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> "TrajectoryStats":
        return cls.from_rows(np.array([cls.row(t) for t in trajectories], dtype=np.int64))

    @classmethod
    def from_rows(cls, rows_NK: np.ndarray) -> "TrajectoryStats":
        """From [n, len(fields)] int64 rows, one per trajectory."""
        return cls(*np.ascontiguousarray(rows_NK.reshape(-1, len(cls._fields)).T))


def index_path(path: str) -> str:
    return path + ".index.npz"


def _key(path: str) -> np.ndarray:
    """(size, mtime_ns, the first 8 bytes of the head's SHA-256 as an int64) of the file."""
    stat = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).digest()
    return np.array([stat.st_size, stat.st_mtime_ns, int.from_bytes(head[:8], "little", signed=True)], dtype=np.int64)


def _scan(path: str) -> np.ndarray:
    """int64 [lines + 1]: the offset of every line's first byte, then the file's size (a last line
    without a newline counts; an empty file has no line)."""
    starts, pos = [np.zeros(1, dtype=np.int64)], 0
    with open(path, "rb") as f:
        while chunk := f.read(SCAN_BYTES):
            starts.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10).astype(np.int64) + pos + 1)
            pos += len(chunk)
    bounds = np.concatenate(starts)
    return bounds if bounds[-1] == pos else np.append(bounds, pos)


def _read_index(path: str, key: np.ndarray) -> np.ndarray | None:
    """The cached line offsets if the index is of this file as it is now; None if absent or stale;
    ValueError naming the index if it is not an index of this file."""
    where = index_path(path)
    if not os.path.exists(where):
        return None
    try:
        with np.load(where, allow_pickle=False) as saved:
            name, saved_key, bounds = str(saved["name"]), saved["key"], saved["bounds"]
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise ValueError(f"data.path: {where} is not an index of a rollout file ({type(e).__name__}); delete it "
                         f"and it is rebuilt") from None
    if name != os.path.basename(path):
        raise ValueError(f"data.path: {where} is the index of another file ({name!r}, {saved_key[0]:,} bytes), not "
                         f"of {os.path.basename(path)!r} ({key[0]:,} bytes); delete it and it is rebuilt")
    return bounds if np.array_equal(saved_key, key) else None


def line_offsets(path: str) -> np.ndarray:
    """int64 [lines + 1] line offsets of the rollout file (module docstring: the index); ValueError
    naming data.path when the file cannot be read or the index is not this file's."""
    try:
        key = _key(path)
        bounds = _read_index(path, key)
        if bounds is None:
            bounds = _scan(path)
            if not np.array_equal(_key(path), key):
                raise ValueError(f"data.path: {path} changed while its line index was built; try again")
            _write_index(path, key, bounds)
    except OSError as e:
        raise ValueError(f"data.path: cannot read rollouts file {path!r}: {e.strerror}") from None
    return bounds


def _write_index(path: str, key: np.ndarray, bounds: np.ndarray) -> None:
    """Atomically (a file of this process, renamed); nothing when the folder is not writable."""
    tmp = f"{index_path(path)}.{os.getpid()}.tmp.npz"
    try:
        np.savez(tmp, name=np.array(os.path.basename(path)), key=key, bounds=bounds)
        os.replace(tmp, index_path(path))
    except OSError:
        pass
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _validate(fd: int, path: str, bounds: np.ndarray, lines: range, vocab_size: int,
              max_seq_len: int) -> tuple[np.ndarray, str | None]:
    """(int64 [n, 2 + len(TrajectoryStats._fields)]: line index, CRC-32 of the line and numbers of
    each trajectory in `lines`, the first error or None); one line in memory at a time."""
    rows = []
    for line in lines:
        raw = _read_line(fd, bounds, line)
        try:
            t = parse_line(raw, line + 1, path, vocab_size, max_seq_len)
        except ValueError as e:
            return _table(rows), str(e)
        if t is not None:
            rows.append((line, zlib.crc32(raw), *TrajectoryStats.row(t)))
    return _table(rows), None


def _read_line(fd: int, bounds: np.ndarray, line: int) -> bytes:
    return os.pread(fd, int(bounds[line + 1] - bounds[line]), int(bounds[line]))


def _table(rows: list[tuple[int, ...]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 2 + len(TrajectoryStats._fields))


def _share(bounds: np.ndarray, rank: int, world: int) -> range:
    """The lines starting in this rank's byte share of the file."""
    size = int(bounds[-1])
    lo, hi = (int(np.searchsorted(bounds[:-1], r * size // world)) for r in (rank, rank + 1))
    return range(lo, hi if rank + 1 < world else len(bounds) - 1)


def _world(group=None) -> tuple[int, int]:
    """(rank, world size) in `group` (the default group when None), (0, 1) without a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(share, group=None) -> list:
    """Every rank's `share` (any picklable value), in rank order. Collective on `group` (one all-gather)
    when a process group exists."""
    if _world(group)[1] == 1:
        return [share]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, share, group=group)
    return out


def agree(error: str | None, group=None) -> str | None:
    """The lowest rank's error among every rank's `error`, on every rank (None if none has one).
    Collective on `group`: one all-reduce of a flag (a CPU tensor: give a gloo group), and an
    all-gather of the messages only when some rank has one."""
    if _world(group)[1] == 1:
        return error
    flag = torch.tensor([error is not None], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    with host_side():
        failed = bool(flag.numpy()[0])
    return next((e for e in _gather(error, group) if e is not None), None) if failed else None


class PlannedStep(NamedTuple):
    ids: list[int]  # the step's trajectories (`StepPlan.step`)
    slots: list[list[int]]  # dealt to grad_accum x dp slots (`deal`)
    trajectories: list[list[Trajectory]]  # of the slots asked for (this rank's), in that order


class Rollouts:
    """Trajectories by index, their numbers (`stats`) and the step plan of (seed, data.batch_tokens)."""

    def __init__(self, stats: TrajectoryStats, seed: int, batch_tokens: int):
        self.stats = stats
        self.plan = StepPlan(stats.cost.tolist(), seed, batch_tokens)

    def __len__(self) -> int:
        return len(self.stats.cost)

    def __getitem__(self, i: int) -> Trajectory:
        return self.step_trajectories([[i]])[0][0]

    def step(self, t: int, n_slots: int, mine: list[int], group=None) -> PlannedStep:
        """Step `t`'s trajectories dealt to `n_slots` slots, and those of the slots `mine`, read and parsed.
        Collective on `group` for a file (the ranks agree that it is unchanged; RunError otherwise)."""
        ids = self.plan.step(t)
        slots = deal(ids, self.plan.costs, n_slots)
        return PlannedStep(ids, slots, self.step_trajectories([slots[s] for s in mine], group))

    def step_trajectories(self, slots: list[list[int]], group=None) -> list[list[Trajectory]]:
        raise NotImplementedError

    def describe(self) -> str:
        """What is read, for the start-up line."""
        raise NotImplementedError

    def budget_note(self) -> str | None:
        """One line when trajectories cost more than data.batch_tokens, each of them then a step of its own
        over the budget (None when the budget bounds every step)."""
        budget, cost = self.plan.batch_tokens, self.stats.cost
        over = np.flatnonzero(cost > budget)
        if not len(over):
            return None
        i = int(over[np.argmax(cost[over])])
        return (f"note: data.batch_tokens={budget:,} is below the cost of {len(over):,} trajectories (the largest, "
                f"{self.name(i)}: {int(cost[i]):,} = {int(self.stats.tokens[i]):,} student + "
                f"{int(self.stats.teacher[i]):,} teacher tokens); each is a step of its own, over the budget: raise "
                f"data.batch_tokens to {int(cost[i]):,} to make it a bound on every step")

    def name(self, i: int) -> str:
        """Trajectory `i` as a user finds it."""
        return f"trajectory {i}"

    def record(self) -> dict:
        """What a checkpoint records of the rollouts (its marker, JSON)."""
        return {}

    def changes(self, saved: dict) -> str | None:
        """One line saying how the rollouts differ from those a checkpoint (`saved`, its marker) recorded."""
        return None


class InMemoryRollouts(Rollouts):
    """Trajectories given in memory (e.g. fresh on-policy rollouts)."""

    def __init__(self, trajectories: list[Trajectory], seed: int, batch_tokens: int):
        super().__init__(TrajectoryStats.of(trajectories), seed, batch_tokens)
        self.trajectories = trajectories

    def step_trajectories(self, slots: list[list[int]], group=None) -> list[list[Trajectory]]:
        return [[self.trajectories[i] for i in slot] for slot in slots]

    def describe(self) -> str:
        return "(in memory)"


class RolloutFile(Rollouts):
    """A rollout file, validated, read through the descriptor opened for that (module docstring). A bad
    file, or a file that changes while the run reads it: RunError (exit status 2) naming data.path,
    identically on every rank. `group`: validation's all-gather (default: the default group)."""

    def __init__(self, path: str, vocab_size: int, max_seq_len: int, *, seed: int = 0, batch_tokens: int = 1,
                 group=None):
        self.path, self.vocab_size, self.max_seq_len = path, vocab_size, max_seq_len
        rank, world = _world(group)
        self._fd, share = None, (_table([]), None)
        try:
            self._fd = os.open(path, os.O_RDONLY)
            self._seen = _stat(self._fd)
            self.bounds = line_offsets(path)
            error = self._changed()  # the index is of the file as it was opened
            if error is None and int(self.bounds[-1]) != self._seen[0]:  # another file renamed over the path
                error = _changed_line(path, f"{self._seen[0]:,} -> {int(self.bounds[-1]):,} bytes")
            if error is None:
                share = _validate(self._fd, path, self.bounds, _share(self.bounds, rank, world), vocab_size,
                                  max_seq_len)
                error = self._changed()
            share = share if error is None else (_table([]), error)
        except OSError as e:
            share = (_table([]), f"data.path: cannot read rollouts file {path!r}: {e.strerror}")
        except ValueError as e:  # the index is another file's, or the file changed while it was built
            share = (_table([]), str(e))
        shares = _gather(share, group)
        error = next((e for _, e in shares if e is not None), None)
        if error is not None:
            self.close()
            raise RunError(error)
        table = np.concatenate([rows for rows, _ in shares])
        if not len(table):
            self.close()
            raise RunError(f"data.path: rollouts file {path} holds no trajectory")
        self.lines, self.crc = table[:, 0].copy(), table[:, 1].copy()
        super().__init__(TrajectoryStats.from_rows(table[:, 2:]), seed, batch_tokens)
        self.digest = hashlib.sha256(self.bounds.tobytes() + self.lines.tobytes() + self.crc.tobytes()).hexdigest()
        self._cache: OrderedDict[int, Trajectory] = OrderedDict()
        self._cached_tokens = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def _changed(self) -> str | None:
        """What changed in the file since it was opened (size, mtime), or None."""
        now = _stat(self._fd)
        if now == self._seen:
            return None
        (size, mtime), (new_size, new_mtime) = self._seen, now
        what = (f"{size:,} -> {new_size:,} bytes" if size != new_size else
                f"same size, modified {(new_mtime - mtime) / 1e9:+.3f} s later" if new_mtime != mtime else "")
        return _changed_line(self.path, what)

    def step_trajectories(self, slots: list[list[int]], group=None) -> list[list[Trajectory]]:
        error = self._changed()
        out = []
        try:
            out = [[self._trajectory(i) for i in slot] for slot in slots] if error is None else out
        except _Changed as e:
            error = str(e)
        error = agree(error, group)
        if error is not None:
            raise RunError(error)
        return out

    def _trajectory(self, i: int) -> Trajectory:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        line = int(self.lines[i])
        raw = _read_line(self._fd, self.bounds, line)
        if zlib.crc32(raw) != self.crc[i]:  # rewritten in place, within the same size and mtime
            raise _Changed(_changed_line(self.path, f"line {line + 1} holds other bytes than at validation"))
        t = parse_line(raw, line + 1, self.path, self.vocab_size, self.max_seq_len)
        self._cache[i] = t
        self._cached_tokens += len(t.tokens)
        while self._cached_tokens > CACHE_TOKENS and len(self._cache) > 1:
            self._cached_tokens -= len(self._cache.popitem(last=False)[1].tokens)
        return t

    def describe(self) -> str:
        return self.path

    def name(self, i: int) -> str:
        return f"line {int(self.lines[i]) + 1} of {self.path}"

    def record(self) -> dict:
        return {"rollouts": {"path": os.path.abspath(self.path), "bytes": int(self.bounds[-1]),
                             "trajectories": len(self), "tokens": int(self.stats.tokens.sum()),
                             "feedback_items": int(self.stats.feedback.sum()), "sha256": self.digest}}

    def changes(self, saved: dict) -> str | None:
        old, new = saved.get("rollouts"), self.record()["rollouts"]
        if not isinstance(old, dict) or old.get("sha256") == new["sha256"]:
            return None
        diffs = [f"{old[k]:,} -> {new[k]:,} {k.replace('_', ' ')}"
                 for k in ("trajectories", "tokens", "feedback_items", "bytes") if k in old and old[k] != new[k]]
        where = "" if old.get("path") == new["path"] else f" ({old.get('path')} -> {new['path']})"
        return (f"rollouts changed since the checkpoint{where}: {', '.join(diffs) or 'same counts, other content'}; "
                f"the steps from here are planned over the file as it is now")


class _Changed(Exception):
    pass


def _stat(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _changed_line(path: str, what: str) -> str:
    return (f"data.path: {path} changed while post-training reads it ({what}); a run reads only the file it "
            f"validated at start: restore it, or write changes to a new file (or rename one over it) and relaunch, "
            f"which validates it and names what changed")
