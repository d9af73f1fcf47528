"""Weighted mixtures of token sources (`[[data.sources]]`): which source and which window every row of
every step reads, a pure function of (seed, step, sources, weights, batch_size, seq_len), never of the layout.

Letters: S = sources, B = data.batch_size (global rows of a step), L = data.seq_len.

  - Rows per source: the cumulative rows C[t, s] of source s in steps < t follow the weights as closely as
    whole rows allow: each step hands its B rows out by largest remainder of the deficits
    (t + 1) * B * w_s - C[t, s] (Megatron's BlendedDataset does the same per sample), so |C[t, s] - t*B*w_s|
    stays below 1 for every t. The table grows lazily with the steps asked for (about 20 us a step).
  - Row order inside the step: the step's rows of each source, shuffled by a generator seeded by (seed, step).
  - Windows: source s is cut into n_s = (tokens - 1) // L windows of L + 1 tokens at stride L (every token is a
    label once per epoch; windows cross documents, see data.document_mask). The k-th row that source s
    supplies reads window perm_e[k mod n_s] of epoch e = k // n_s, perm_e a permutation seeded by (seed, s, e):
    a source that runs out wraps around into a new shuffled epoch, and the loader says so once.

Held-out evaluation reads the last eval.holdout of each source separately (`eval_loss/<name>`); the
overall `eval_loss` is their mean weighted like the training mixture (runtime/train.py).
"""

import math

import numpy as np

_MIX_STREAM = 0x313C  # mixed into the seeds of the row order and the epoch permutations


class Allocation:
    """Cumulative rows per source: `cumulative(t)` [S] int64 = rows of each source in steps < t."""

    def __init__(self, weights: list[float], batch_size: int):
        self.w = np.asarray(weights, dtype=np.float64) / math.fsum(weights)
        self.batch_size = batch_size
        self._table = [np.zeros(len(weights), dtype=np.int64)]  # [t] -> C[t]

    def cumulative(self, step: int) -> np.ndarray:
        while len(self._table) <= step:
            t, before = len(self._table) - 1, self._table[-1]
            self._table.append(before + self._apportion((t + 1) * self.batch_size * self.w - before))
        return self._table[step]

    def counts(self, step: int) -> np.ndarray:
        """Rows of each source in step `step`, [S], summing to batch_size."""
        return self.cumulative(step + 1) - self.cumulative(step)

    def first_step_beyond(self, source: int, rows: int) -> int:
        """The first step whose rows of `source` go past `rows` (its epoch ends there); the table must reach it."""
        column = np.array([c[source] for c in self._table])
        return int(np.searchsorted(column, rows, side="right")) - 1

    def _apportion(self, deficit: np.ndarray) -> np.ndarray:
        """batch_size rows in proportion to the positive deficits: floors, then largest remainders."""
        q = np.maximum(deficit, 0.0)
        n = np.floor(q).astype(np.int64)
        extra = self.batch_size - int(n.sum())
        order = np.argsort(-(q - n), kind="stable")  # largest remainder first, ties to the lower index
        if extra >= 0:
            n[order[:extra]] += 1
        else:
            n[[i for i in order[::-1] if n[i] > 0][:-extra]] -= 1
        return n


class Mixture:
    """Rows of a step for a list of (name, tokens [N_s], weight): `draws(step)` says, for each of the B
    global rows, which source and which window start it reads."""

    def __init__(self, names: list[str], token_counts: list[int], weights: list[float], batch_size: int,
                 seq_len: int, seed: int, say=None):
        self.names, self.seq_len, self.seed, self.batch_size = names, seq_len, seed, batch_size
        self.windows = [(n - 1) // seq_len for n in token_counts]
        self.allocation = Allocation(weights, batch_size)
        self.say, self._noted, self._perms = say, set(), {}

    def draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index [B], window start [B]) of every global row of `step`; pure in (seed, step)."""
        before, counts = self.allocation.cumulative(step), self.allocation.counts(step)
        rng = np.random.default_rng([_MIX_STREAM, self.seed, step])
        source_B = rng.permutation(np.repeat(np.arange(len(counts)), counts))
        start_B = np.empty(self.batch_size, dtype=np.int64)
        for s in np.flatnonzero(counts):
            rows = np.flatnonzero(source_B == s)
            k = before[s] + np.arange(len(rows))  # this source's draw numbers
            start_B[rows] = self._window(s, k) * self.seq_len
            self._note_wrap(s, int(k[-1]))
        return source_B, start_B

    def _window(self, s: int, k: np.ndarray) -> np.ndarray:
        n = self.windows[s]
        out = np.empty_like(k)
        for epoch in np.unique(k // n):
            sel = k // n == epoch
            out[sel] = self._perm(s, int(epoch))[k[sel] % n]
        return out

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        if (s, epoch) not in self._perms:
            if len(self._perms) > 2 * len(self.windows):  # keep memory bounded: epochs move forward
                self._perms.clear()
            rng = np.random.default_rng([_MIX_STREAM, self.seed, s, epoch])
            self._perms[s, epoch] = rng.permutation(self.windows[s])
        return self._perms[s, epoch]

    def _note_wrap(self, s: int, last_draw: int) -> None:
        if last_draw < self.windows[s] or s in self._noted:
            return
        self._noted.add(s)
        if self.say is not None:
            wrapped = self.allocation.first_step_beyond(s, self.windows[s])
            self.say(f"data: source {self.names[s]!r} ran out of its {self.windows[s]:,} windows of "
                     f"{self.seq_len + 1} tokens at step {wrapped}; it wraps around in a new shuffled epoch")

    def tokens_by_source(self, step: int) -> dict[str, int]:
        """Cumulative label tokens of each source over steps 0..step (all ranks together)."""
        rows = self.allocation.cumulative(step + 1)
        return {name: int(r) * self.seq_len for name, r in zip(self.names, rows)}


def mixture_eval_loss(sources: tuple, losses: dict[str, float]) -> float:
    """The overall held-out loss of a mixture: the sources' `eval_loss/<name>` weighted like training."""
    total = math.fsum(s.weight for s in sources)
    return math.fsum(s.weight / total * losses[f"eval_loss/{s.label()}"] for s in sources)
