"""Write a small, deterministic rollout file over the byte-level tokenizer (token id = byte):
`python examples/make_rollouts.py [--out examples/rollouts.jsonl] [--n 32] [--seed 0]`.

Each trajectory is a short tool-use transcript: a system turn listing the episode's tools, a user
request, then assistant calls and tool answers. Some calls go to a tool that is not available; those
assistant turns get the hint "Reminder: available tools: ..." as feedback, and the trajectory a
negative advantage. No `logprobs`: these transcripts were not sampled from a model, so the trainer
uses an importance ratio of 1 (plain policy gradient).
"""

import argparse
import json
import random

TOOLS = ("search", "calc", "weather", "clock", "translate", "maps")
MAX_LEN = 256  # the debug preset's model.max_seq_len, teacher sequence (turn end + hint) included


def _episode(rng: random.Random) -> tuple[list[tuple[str, str]], list[int], list[str]]:
    """(turns as (role, text), indices of assistant turns calling a missing tool, the available tools)."""
    available = sorted(rng.sample(TOOLS, 3))
    turns = [("system", f"tools: {','.join(available)}\n"), ("user", f"task {rng.randint(10, 99)}\n")]
    wrong = []
    for _ in range(rng.randint(2, 3)):
        tool = rng.choice(TOOLS)
        if tool not in available:
            wrong.append(len(turns))
        turns.append(("assistant", f"call {tool}({rng.randint(1, 9)})\n"))
        turns.append(("tool", "ok\n" if tool in available else "Tool not found\n"))
    turns.append(("assistant", "done\n"))
    return turns, wrong, available


def trajectory(rng: random.Random) -> dict:
    turns, wrong, available = _episode(rng)
    tokens, spans = [], []
    for role, text in turns:
        data = list(text.encode())
        spans.append({"role": role, "start": len(tokens), "end": len(tokens) + len(data)})
        tokens += data
    hint = list(f"Reminder: available tools: {','.join(available)}\n".encode())
    feedback = [{"turn": i, "hint": hint} for i in wrong if spans[i]["end"] + len(hint) <= MAX_LEN]
    return {"tokens": tokens, "turns": spans, "advantage": -1.0 if wrong else 1.0, "feedback": feedback}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/rollouts.jsonl")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.n):
            f.write(json.dumps(trajectory(rng)) + "\n")


if __name__ == "__main__":
    main()
