"""A small multi-turn tool-use environment over the byte-level tokenizer (token id = byte), where a
model can call a tool that is not available, and a hint can tell it which ones are.

Protocol, one line per turn, a role tag first. The assistant's tag "A: " is the chat template's role
header: the environment writes it and the model generates the rest of the line (so a model never
writes another role's line, such as a reminder, in its own turn).

    S: tools: storm hours adder press    system: this episode's tools, one per goal kind, shuffled
    U: task: wthr math news              user: the goals to reach, in order
    A: call storm                        assistant: a call, or "A: done"
    T: ok                                tool: "ok", "wrong tool" or "Tool not found"
    A: call tally
    T: Tool not found
    A: call adder
    T: ok
    A: call press
    T: ok
    A: done

Every goal kind has several tools (synonyms); an episode makes exactly one of each kind available.
A call to the available tool of the next goal reaches it ("ok"); another available tool answers
"wrong tool"; a tool not in the episode's list answers "Tool not found". The reward is task success:
1 if the assistant says "done" after reaching every goal in order, within MAX_ASSISTANT_TURNS turns: one
wrong call costs nothing, a second one fails the episode, so the reward moves only a little with the
mistake that the feedback targets.

Feedback rule: every assistant turn that called an unavailable tool gets the hint
"R: Reminder: available tools: ..." (the episode's list), inserted just before that turn.

`transcript()` writes the pretraining data that makes the behaviour to fix exist: the first call for a
goal goes to an unavailable synonym with probability `p_invalid` (then the right one follows, unless the
turn limit ended the episode), and a turn preceded by a reminder line always calls an available tool (so
a hint-conditioned teacher knows better than the student).
"""

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from runtime.generate import generate

# Goal kinds and their tools. Names have equal lengths (4 and 5 bytes) so that episodes that behave alike
# have equal-length contexts and are generated as one batch; every tool starts with its own letter, so
# the first byte of a call decides it.
GOALS = {"wthr": ("cloud", "storm", "rainy"), "math": ("adder", "tally", "euler"),
         "time": ("watch", "hours", "dials"), "news": ("press", "blogs", "flash")}
N_GOALS = 3
MAX_ASSISTANT_TURNS = 5  # N_GOALS calls + "done" leaves room for one wrong call
HEADER = "A: "  # the assistant's role header, written by the environment
NOT_FOUND, WRONG, OK = "Tool not found", "wrong tool", "ok"


@dataclass
class Episode:
    """One episode's state: the text so far as (role, line) turns, and what the assistant did."""

    tools: tuple[str, ...]  # available, in the order the system turn lists them
    goals: tuple[str, ...]
    turns: list[tuple[str, str]] = field(default_factory=list)
    reached: int = 0  # goals reached so far
    invalid_turns: list[int] = field(default_factory=list)  # indices into turns: calls to unavailable tools
    done: bool = False
    success: bool = False

    def hint(self) -> str:
        return f"R: Reminder: available tools: {' '.join(self.tools)}\n"

    def text(self) -> str:
        return "".join(line for _, line in self.turns)

    def assistant_turns(self) -> int:
        return sum(role == "assistant" for role, _ in self.turns)

    def targeted_turns(self) -> list[int]:
        """Turn indices that feedback targets (here: calls to unavailable tools)."""
        return list(self.invalid_turns)

    def feedback_hints(self) -> list[tuple[int, str]]:
        """(turn, hint line) for every targeted turn."""
        return [(t, self.hint()) for t in self.invalid_turns]


def new_episode(rng: random.Random, n_goals: int = N_GOALS) -> Episode:
    tools = [rng.choice(synonyms) for synonyms in GOALS.values()]
    rng.shuffle(tools)
    goals = tuple(rng.sample(sorted(GOALS), n_goals))
    episode = Episode(tools=tuple(tools), goals=goals)
    episode.turns = [("system", f"S: tools: {' '.join(tools)}\n"), ("user", f"U: task: {' '.join(goals)}\n")]
    return episode


def answer_line(answer: str, complete: bool = True) -> str:
    """The tool turn; after a line cut at the token limit it starts with the newline the line lacks."""
    return f"{'' if complete else chr(10)}T: {answer}\n"


def step(episode: Episode, line: str, *, answer_fn=None, format_answer=answer_line,
         max_turns: int = MAX_ASSISTANT_TURNS) -> None:
    """Apply one assistant line (exactly as generated) and the environment's answer. A line without its
    newline (cut at the token limit) is a bad call; the tool turn then starts with the newline, so the
    assistant turn holds only generated tokens. `answer_fn`, `format_answer`, `max_turns`: another
    environment's rules on the same protocol (experiments/long_tool_env.py)."""
    episode.turns.append(("assistant", line))
    complete, words = line.endswith("\n"), line.split()
    if complete and words == ["A:", "done"]:
        episode.done, episode.success = True, episode.reached == len(episode.goals)
        return
    if complete and len(words) == 3 and words[:2] == ["A:", "call"]:
        answer = (answer_fn or _answer)(episode, words[2], len(episode.turns) - 1)
    else:
        answer = "bad call"
    episode.turns.append(("tool", format_answer(answer, complete)))
    if episode.assistant_turns() >= max_turns:
        episode.done = True


def _answer(episode: Episode, tool: str, turn: int) -> str:
    if tool not in episode.tools:
        episode.invalid_turns.append(turn)
        return NOT_FOUND
    if episode.reached < len(episode.goals) and tool in GOALS[episode.goals[episode.reached]]:
        episode.reached += 1
        return OK
    return WRONG


def transcript(rng: random.Random, p_invalid: float, p_reminder: float, n_goals: int = N_GOALS) -> str:
    """A demonstration episode for pretraining (see the module docstring)."""
    episode = new_episode(rng, n_goals)
    for goal in episode.goals:
        right = next(t for t in episode.tools if t in GOALS[goal])
        reminded = rng.random() < p_reminder
        if not reminded and rng.random() < p_invalid:
            step(episode, f"A: call {rng.choice([t for t in GOALS[goal] if t != right])}\n")
        if reminded:
            episode.turns.append(("system", episode.hint()))
        if not episode.done:
            step(episode, f"A: call {right}\n")
    if not episode.done:
        step(episode, "A: done\n")
    return episode.text()


def rollout_record(episode: Episode, logprobs: dict[int, list[float]] | None = None, advantage: float = 0.0,
                   with_feedback: bool = True) -> dict:
    """The episode as a rollout line for `data.source = "rollouts"` (runtime/posttrain/rollouts.py): byte tokens,
    turn ranges, advantage, the behaviour log-probs of the generated tokens (`logprobs[turn index]`, one
    per byte of the turn's line after the header; 0 elsewhere) and the hint on every turn that called an
    unavailable tool. An assistant turn's range holds the generated tokens only; its header belongs to
    no turn (template tokens, never trained), and the hint goes before the header (`at`)."""
    tokens, turns, token_logprobs, header_at = [], [], [], {}
    for i, (role, line) in enumerate(episode.turns):
        data = list(line.encode("latin-1"))
        skip = len(HEADER) if role == "assistant" else 0
        header_at[i] = len(tokens)
        turns.append({"role": role, "start": len(tokens) + skip, "end": len(tokens) + len(data)})
        tokens += data
        token_logprobs += [0.0] * skip + (logprobs or {}).get(i, [0.0] * (len(data) - skip))
    record = {"tokens": tokens, "turns": turns, "advantage": advantage}
    if logprobs is not None:
        record["logprobs"] = token_logprobs
    if with_feedback:
        record["feedback"] = [{"turn": t, "hint": list(hint.encode("latin-1")), "at": header_at[t]}
                              for t, hint in episode.feedback_hints()]
    return record


def play(model, episodes: list[Episode], sampling, *, seed: int, first_id: int = 0, step_fn=step,
         max_turns: int = MAX_ASSISTANT_TURNS) -> list[dict[int, list[float]]]:
    """Let the model play `episodes` to the end (in place); returns each episode's behaviour log-probs per
    assistant turn (of the generated tokens after the header, for `rollout_record`).

    Each round, every unfinished episode needs one assistant line: the context plus the header is the
    prompt, and episodes whose prompts have the same length are generated as one batch
    (runtime/generate.py needs equal-length prompts), stopping at a newline. Sequence ids (first_id + episode index, times the round) make every line's sampling stream
    distinct and independent of the batching. `step_fn` and `max_turns` are the environment's rules
    (experiments/long_tool_env.py passes its own). On a sharded model every rank must pass the same
    episodes: the number of generate calls (each collective) depends on them."""
    sampling = dataclasses.replace(sampling, stop_tokens=(ord("\n"),))  # one line per assistant turn
    logprobs: list[dict[int, list[float]]] = [{} for _ in episodes]
    for round_ in range(max_turns):
        active = [i for i, e in enumerate(episodes) if not e.done]
        by_length: dict[int, list[int]] = {}
        for i in active:
            by_length.setdefault(len(episodes[i].text()), []).append(i)
        for group in by_length.values():
            prompts = torch.tensor([list((episodes[i].text() + HEADER).encode("latin-1")) for i in group])
            ids = [(first_id + i) * max_turns + round_ for i in group]
            out = generate(model, prompts, sampling, seed=seed, sequence_ids=ids)
            for row, i in enumerate(group):
                n = int(out.lengths_B[row])
                line = bytes(out.tokens_BN[row, :n].tolist()).decode("latin-1")
                logprobs[i][len(episodes[i].turns)] = out.logprobs_BN[row, :n].tolist()
                step_fn(episodes[i], HEADER + line)
    return logprobs
