"""A long synthetic rollout record, the shape that benchmarks/output_head.py and experiments/teacher_tokens.py
time: `length` tokens in 128 alternating user / assistant turns, the last `flagged` assistant turns
flagged with a `hint`-token hint, random byte tokens (seed 0)."""

import numpy as np


def synthetic_record(length: int, flagged: int = 20, hint: int = 16) -> dict:
    turn = length // 128
    g = np.random.default_rng(0)
    turns = [{"role": "assistant" if k % 2 else "user", "start": k * turn, "end": (k + 1) * turn} for k in range(128)]
    last = [k for k in range(128) if k % 2][-flagged:]
    return {"tokens": g.integers(0, 256, 128 * turn).tolist(), "turns": turns, "advantage": 1.0,
            "feedback": [{"turn": k, "hint": [7] * hint} for k in last]}
