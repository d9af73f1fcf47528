"""Where checkpoints live and how a complete one is marked, and the `[checkpoint]` section (no torch:
the config tree and `posttrain.init_from`'s checks read them before torch loads; runtime/checkpoint/checkpoint.py
writes and loads the checkpoints and re-exports these names).

Layout: `<run.dir>/checkpoints/step_<N>/` holds DCP shard files, `.metadata` and a `COMPLETE` marker (a
JSON object: step, world size and what must match to resume); only directories named `step_<N>` that
hold the marker are complete.
"""

import json
import os
import re
from dataclasses import dataclass
from typing import Literal

from runtime.errors import RunError

MARKER = "COMPLETE"


class Unloadable(RunError):
    """A complete-looking checkpoint whose files do not load (truncated, missing, garbled)."""


STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval: int = 100  # save every N optimizer steps; the last step and a SIGTERM always save (0 = only those)
    keep: int = 2  # complete checkpoints to keep, newest first; older ones are deleted (0 = keep all)
    keep_every: int = 0  # also keep forever every checkpoint whose step is a multiple of this (0 = none; a multiple of interval, needs keep > 0)
    mode: Literal["sync", "async"] = "async"  # async: copy the state to host memory (pinned on CUDA), write it in the background while training continues (runtime/checkpoint/checkpointer.py)

    def __post_init__(self):
        if self.interval < 0 or self.keep < 0:
            raise ValueError(f"checkpoint.interval={self.interval} and checkpoint.keep={self.keep} must be >= 0")
        if self.keep_every < 0:
            raise ValueError(f"checkpoint.keep_every={self.keep_every} must be >= 0")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"checkpoint.mode={self.mode!r} must be 'sync' or 'async'")
        if self.keep_every and self.keep == 0:
            raise ValueError(f"checkpoint.keep_every={self.keep_every} has no effect with checkpoint.keep=0 "
                             f"(every checkpoint is kept)")
        if self.keep_every and (self.interval == 0 or self.keep_every % self.interval):
            raise ValueError(f"checkpoint.keep_every={self.keep_every} must be a multiple of checkpoint.interval="
                             f"{self.interval}, or those steps are never saved")

    def kept(self, steps: list[int]) -> set[int]:
        """Of the complete checkpoints' `steps`, the ones retention keeps: the `keep` newest and the
        multiples of `keep_every` (keep=0: all)."""
        if self.keep == 0:
            return set(steps)
        newest = set(sorted(steps)[-self.keep:])
        return newest | {s for s in steps if self.keep_every and s % self.keep_every == 0}

    def due(self, step: int) -> bool:
        """Whether to save after `step` optimizer steps are done."""
        return self.interval > 0 and step > 0 and step % self.interval == 0


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_step(path: str) -> int:
    """N of a `.../step_<N>` checkpoint directory."""
    match = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    assert match, path
    return int(match.group(1))


def complete_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints under `directory`, oldest first; `.tmp` and unmarked directories are skipped."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if STEP_DIR.match(name) and os.path.isfile(os.path.join(path, MARKER)):
            found.append(path)
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint under `directory`, or None."""
    complete = complete_checkpoints(directory)
    return complete[-1] if complete else None


def read_meta(path: str) -> dict:
    """The marker of a complete checkpoint: {"step", "world_size", **meta}; Unloadable if unreadable."""
    marker = os.path.join(path, MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise Unloadable(f"{marker}: unreadable {MARKER} marker ({' '.join(str(e).split())[:160]})") from None
    if not isinstance(meta, dict):
        raise Unloadable(f"{marker}: unreadable {MARKER} marker (not a JSON object)")
    return meta
