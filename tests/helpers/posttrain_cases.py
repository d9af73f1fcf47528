"""Shared post-training fixtures: a small rollout file's records and the data config that reads all of it;
trajectories with many flagged turns."""

import torch

HINT = [82, 101, 109, 105, 110, 100, 58, 32]  # "Remind: "


def records() -> list[dict]:
    """Two trajectories; feedback on one assistant turn of each (the second one's starts at token 0); the
    first hint goes 3 tokens before its turn (`at`, as before a role header)."""
    t1 = {"tokens": [(11 * j + 3) % 256 for j in range(60)],
          "turns": [{"role": "system", "start": 0, "end": 12}, {"role": "assistant", "start": 12, "end": 25},
                    {"role": "tool", "start": 25, "end": 31}, {"role": "assistant", "start": 31, "end": 60}],
          "advantage": 1.0, "feedback": [{"turn": 3, "hint": HINT, "at": 28}]}
    t2 = {"tokens": [(5 * j + 1) % 256 for j in range(33)],
          "turns": [{"role": "assistant", "start": 0, "end": 9}, {"role": "user", "start": 9, "end": 20},
                    {"role": "assistant", "start": 20, "end": 33}],
          "advantage": -0.5, "logprobs": [-5.0] * 33, "feedback": [{"turn": 0, "hint": HINT[:3]}]}
    return [t1, t2]


class Data:
    def __init__(self, path):
        self.path, self.batch_tokens = path, 200  # both trajectories (cost 173), no repeat


def many_feedback_record(i: int, n: int, vocab: int) -> dict:
    """A trajectory of n tokens in turns of 5-8 alternating user / assistant (the first one assistant
    when i is odd, so a flagged turn may start at token 0); feedback on every assistant turn, hints of
    1-4 tokens, every other one inserted 2 tokens before its turn (`at`)."""
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
    turns, start = [], 0
    while start < n:
        end = min(n, start + 5 + len(turns) % 4)
        turns.append({"role": "assistant" if (len(turns) + i) % 2 else "user", "start": start, "end": end})
        start = end
    feedback = [{"turn": k, "hint": [5, 6, 7, 8][:1 + k % 4],
                 "at": max(0, turns[k]["start"] - 2 * (k % 4 == 1))}
                for k in range(len(turns)) if turns[k]["role"] == "assistant"]
    return {"tokens": tokens, "turns": turns, "advantage": 0.5, "feedback": feedback}
