"""Chat transcripts with text feedback -> a rollout file for launch/posttrain.py (docs/posttrain_transcripts.md).

    python launch/prepare_rollouts.py --tokenizer DIR --in chats.jsonl --out rollouts.jsonl [--max-len N]

Each input line is one conversation (OpenAI-style messages, as an inference engine logs them):
  {"messages": [{"role": "system|user|assistant|tool", "content": "...", "tool_calls": [...]}, ...],
   "tools": [...], "reward": 1.0, "group": "prompt-17", "advantage": 0.5,
   "feedback": [{"message": 5, "hint": "Reminder: available tools: search, calc"}],
   "logprobs": {"5": [-0.1, ...]}}
It is rendered with the tokenizer directory's own chat template (`transformers` AutoTokenizer, local
files only); runtime/posttrain/transcripts.py derives the token ranges and hints, and says what is refused.
Advantage: `advantage` when given, else from `reward`: `--advantage grpo` (reward minus its group's
mean, over the group's sample std + 1e-6; a group of one gets 0 and is counted) or `raw` (the reward).
`--split-user-turns`: one rollout per user message (runtime/posttrain/transcripts.py user_turns), for templates that
empty the reasoning of turns before the last user message. Every output record is validated as
launch/posttrain.py will read it. Bad input: one line naming the input line, exit status 2, nothing
written (the output appears atomically, after every line passed).
"""

import json
import os
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from launch.precheck import ToolParser  # noqa: E402
from runtime.data import tokenizer_dir  # noqa: E402
from runtime.cli import os_error_message, report  # noqa: E402
from runtime.paths import check_output_file  # noqa: E402
from runtime.posttrain.rollouts import trajectory_from_record  # noqa: E402
from runtime.posttrain.transcripts import (check_logprobs, check_template, insert_hint,  # noqa: E402
                                           parse_conversation, render_conversation, to_record, user_turns)

GRPO_EPS = 1e-6


def load_tokenizer(path: str, trust_remote_code: bool):
    """(tokenizer, end-of-turn token ids) of a local tokenizer directory; ValueError naming --tokenizer."""
    tokenizer = tokenizer_dir.load_transformers(path, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--tokenizer {path} has no chat template (no chat_template in tokenizer_config.json "
                         f"and no chat_template.jinja)")
    check_template(tokenizer, f"--tokenizer {path}")
    return tokenizer, end_of_turn_ids(tokenizer, path)


def end_of_turn_ids(tokenizer, path: str) -> set[int]:
    """The tokenizer's eos token and generation_config.json's eos_token_id(s) (where generation stops)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = tokenizer_dir.generation_ids(path).get("eos_token_id")
    return ids | set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def convert(tokenizer, end_of_turn: set[int], lines: list[str], args) -> tuple[list[dict], Counter]:
    """The rollout records and the counts of the summary; ValueError naming the input line."""
    kept, counts = [], Counter()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        counts["conversations"] += 1
        try:
            conv = _parse_line(line)
            parts = _convert(tokenizer, end_of_turn, conv, args, counts)
        except ValueError as e:
            raise ValueError(f"{args.inp} line {number}: {e}") from None
        kept += [(number, conv, *part) for part in parts]
    records = _with_advantages(kept, args, counts)
    vocab = len(tokenizer)
    for (number, *_), record in zip(kept, records):
        try:
            trajectory_from_record(record, vocab, args.max_len or 1 << 62)
        except ValueError as e:  # a bug here, not the user's: still one line naming the input
            raise ValueError(f"{args.inp} line {number}: the rollout record is invalid ({e})") from None
        counts["tokens"] += len(record["tokens"])
        counts["assistant tokens"] += sum(t["end"] - t["start"] for t in record["turns"] if t["role"] == "assistant")
        counts["flagged turns"] += len(record.get("feedback", []))
    return records, counts


def _parse_line(line: str):
    try:
        return parse_conversation(json.loads(line))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON ({e.msg} at column {e.colno})") from None


def _convert(tokenizer, end_of_turn, conv, args, counts: Counter) -> list[tuple]:
    """(part, rendered, hints) of every rollout the conversation gives (one, or one per user turn with
    --split-user-turns); what is dropped is counted."""
    if not any(m["role"] == "assistant" for m in conv.messages):
        counts["dropped: no assistant message"] += 1
        return []
    if conv.advantage is None and conv.reward is None:
        raise ValueError("neither 'advantage' nor 'reward' is given")
    out = []
    for part, first in user_turns(conv) if args.split_user_turns else [(conv, 0)]:
        if not any(m["role"] == "assistant" for m in part.messages[first:]):
            counts["dropped: user turn without an answer"] += 1
            continue
        rendered = render_conversation(tokenizer, part, end_of_turn, first)
        check_logprobs(part, rendered)
        hints = {i: insert_hint(tokenizer, part, rendered, i, args.hint_role) for i in part.feedback}
        longest = max([len(rendered.tokens)] + [rendered.ranges[i][1] + len(h) for i, (_, h) in hints.items()])
        if args.max_len and longest > args.max_len:
            if not args.drop_long:
                what = (f"{longest} tokens (conversation {len(rendered.tokens)}, teacher sequences with the hint "
                        f"included)" if hints else f"{longest} tokens (the conversation; it has no hint)")
                raise ValueError(f"{what} is longer than --max-len={args.max_len} (or pass --drop-long)")
            counts[f"dropped: longer than --max-len={args.max_len}"] += 1
            continue
        out.append((part, rendered, hints))
    return out


def _with_advantages(kept: list[tuple], args, counts: Counter) -> list[dict]:
    """The records, each advantage `advantage` if given, else from its conversation's reward
    (`--advantage`; grpo: the group statistics count each conversation once, however many rollouts)."""
    convs = {id(conv): conv for _, conv, *_ in kept}
    groups = defaultdict(list)
    for key, conv in convs.items():
        if conv.advantage is None:
            groups[conv.group if conv.group is not None else key].append(conv.reward)
    stats = {g: _mean_std(r) for g, r in groups.items()}
    records = []
    for _, conv, part, rendered, hints in kept:
        advantage = conv.advantage
        if advantage is None and args.advantage == "raw":
            advantage = conv.reward
        elif advantage is None:
            mean, std, size = stats[conv.group if conv.group is not None else id(conv)]
            counts["groups of one (advantage 0)"] += size == 1
            advantage = 0.0 if size == 1 else (conv.reward - mean) / (std + GRPO_EPS)
        records.append(to_record(part, rendered, advantage, hints))
    return records


def _mean_std(rewards: list[float]) -> tuple[float, float, int]:
    """(mean, sample std (n - 1), size) of a group's rewards."""
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    return mean, var ** 0.5, n


def summary(args, records: list[dict], counts: Counter) -> str:
    dropped = {k.removeprefix("dropped: "): v for k, v in counts.items() if k.startswith("dropped: ")}
    why = ", ".join(f"{v} {k}" for k, v in sorted(dropped.items()))
    line = (f"{args.out}: {counts['conversations']} conversations -> {len(records)} rollouts, {counts['tokens']:,} "
            f"tokens ({counts['assistant tokens']:,} assistant), {counts['flagged turns']} flagged turns, "
            f"dropped {sum(dropped.values())}" + (f" ({why})" if why else ""))
    if counts["groups of one (advantage 0)"]:
        line += f"; {counts['groups of one (advantage 0)']} in groups of one (advantage 0)"
    return line


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--in {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def _write(path: str, records: list[dict]) -> None:
    """Atomically: a `.tmp` next to it, renamed once complete."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def parse_args(argv: list[str] | None):
    parser = ToolParser(description=__doc__.splitlines()[0], prefix="error")
    parser.add_argument("--tokenizer", required=True, help="local tokenizer directory with a chat template")
    parser.add_argument("--in", dest="inp", required=True, help="conversations, one JSON object per line")
    parser.add_argument("--out", required=True, help="rollout file for launch/posttrain.py (data.path)")
    parser.add_argument("--max-len", type=int, default=0,
                        help="refuse longer conversations (model.max_seq_len); 0: no limit")
    parser.add_argument("--drop-long", action="store_true",
                        help="drop conversations over --max-len instead of refusing")
    parser.add_argument("--hint-role", choices=("system", "user"), default="system", help="role of the hint message")
    parser.add_argument("--advantage", choices=("grpo", "raw"), default="grpo", help="advantage from the reward")
    parser.add_argument("--split-user-turns", action="store_true",
                        help="one rollout per user message (for templates that empty earlier reasoning)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer directory's own code")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.max_len < 0:
            raise ValueError(f"--max-len={args.max_len} must be >= 0")
        check_output_file("--out", args.out, "rollouts.jsonl",
                          [("the --in file", args.inp), (f"a file of --tokenizer {args.tokenizer}", args.tokenizer)])
        lines = _read_lines(args.inp)
        tokenizer, end_of_turn = load_tokenizer(args.tokenizer, args.trust_remote_code)
        records, counts = convert(tokenizer, end_of_turn, lines, args)
        if not records:
            raise ValueError(f"{args.inp}: no conversation left to write ({counts['conversations']} read)")
        _write(args.out, records)
    except ValueError as e:
        return report(e)
    except OSError as e:  # a failed write (disk full) names no file: then it is the output
        return report(os_error_message(e, args.out))
    print(summary(args, records, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
