"""A rollout file read at scale: an index of line offsets, each rank validating its share, and
trajectories parsed on demand by offset (runtime/posttrain/rollouts.py has the format and the checks of a line).

  index       `<file>.index.npz` beside the file: the byte offset where every line starts (and the
              file's size at the end), with the file's name, size, mtime and a SHA-256 of its first
              MiB. Built by a chunked byte scan (no JSON parsed), once: a later run whose file still
              has that size, mtime and head reuses it; a changed file rebuilds it (written atomically,
              so ranks that build it at once write the same bytes in turn); an unwritable folder
              keeps it in memory. An index naming another file, or one that is not an index, is
              refused in one line (it is not ours to overwrite).
  validation  rank r of W parses and validates the lines that start in bytes [r*size/W,
              (r+1)*size/W) of the file, one line at a time, and notes each trajectory's numbers
              (`TrajectoryStats`: what a step's plan and totals need). One all-gather of those
              numbers and of each rank's first error, which every rank reaches whatever it found, so
              no rank waits on one that stopped: the lowest failing rank's error (the file's first
              bad line, as a sequential read reports it) is raised on every rank.
  reading     `rollouts[i]` reads trajectory i's line by its offset and parses it again (a few most
              recent stay cached, by tokens): a rank holds the index and the numbers, 8 bytes per
              line and 56 per trajectory (its line and six numbers), never the file. A step's plan
              comes from the numbers, so a rank parses only its own micro-batches' trajectories
              (runtime/posttrain/rollout_batch.py).

Without a process group the one process validates the whole file, one line at a time.
"""

import hashlib
import os
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch.distributed as dist

from runtime.errors import RunError
from runtime.posttrain.rollouts import Trajectory, parse_line

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


def _validate(path: str, bounds: np.ndarray, lines: range, vocab_size: int,
              max_seq_len: int) -> tuple[np.ndarray, str | None]:
    """(int64 [n, 1 + len(TrajectoryStats._fields)]: line index and numbers of each trajectory in
    `lines`, the first error or None); one line in memory at a time."""
    rows = []
    with open(path, "rb") as f:
        for line in lines:
            f.seek(bounds[line])
            try:
                t = parse_line(f.read(int(bounds[line + 1] - bounds[line])), line + 1, path, vocab_size, max_seq_len)
            except ValueError as e:
                return _table(rows), str(e)
            if t is not None:
                rows.append((line, *TrajectoryStats.row(t)))
    return _table(rows), None


def _table(rows: list[tuple[int, ...]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 1 + len(TrajectoryStats._fields))


def _share(bounds: np.ndarray, rank: int, world: int) -> range:
    """The lines starting in this rank's byte share of the file."""
    size = int(bounds[-1])
    lo, hi = (int(np.searchsorted(bounds[:-1], r * size // world)) for r in (rank, rank + 1))
    return range(lo, hi if rank + 1 < world else len(bounds) - 1)


def _gather(share: tuple[np.ndarray, str | None]) -> list[tuple[np.ndarray, str | None]]:
    """Every rank's share, in rank order. Collective on the default group (one all-gather) when a
    process group exists."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [share]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, share)
    return out


class RolloutFile:
    """The validated trajectories of a rollout file, by index (module docstring). A bad file: RunError
    (exit status 2) naming data.path and the line, identically on every rank."""

    def __init__(self, path: str, vocab_size: int, max_seq_len: int):
        self.path, self.vocab_size, self.max_seq_len = path, vocab_size, max_seq_len
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        try:
            self.bounds = line_offsets(path)
            share = _validate(path, self.bounds, _share(self.bounds, rank, world), vocab_size, max_seq_len)
        except ValueError as e:  # the file changed or vanished since the entry point's check
            share = (_table([]), str(e))
        shares = _gather(share)
        error = next((e for _, e in shares if e is not None), None)
        if error is not None:
            raise RunError(error)
        table = np.concatenate([rows for rows, _ in shares])
        if not len(table):
            raise RunError(f"data.path: rollouts file {path} holds no trajectory")
        self.lines = table[:, 0].copy()
        self.stats = TrajectoryStats.from_rows(table[:, 1:])
        self._cache: OrderedDict[int, Trajectory] = OrderedDict()
        self._cached_tokens = 0

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> Trajectory:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        line = int(self.lines[i])
        with open(self.path, "rb") as f:
            f.seek(self.bounds[line])
            t = parse_line(f.read(int(self.bounds[line + 1] - self.bounds[line])), line + 1, self.path,
                           self.vocab_size, self.max_seq_len)
        self._cache[i] = t
        self._cached_tokens += len(t.tokens)
        while self._cached_tokens > CACHE_TOKENS and len(self._cache) > 1:
            self._cached_tokens -= len(self._cache.popitem(last=False)[1].tokens)
        return t
