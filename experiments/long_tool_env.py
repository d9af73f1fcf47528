"""The long-horizon tool-use environment: the protocol of experiments/tool_env.py over many goals, where a
mistake costs a turn of a generous budget and the reward (task success) barely sees it.

    S: tools: storm hours adder press    system: this episode's tools, one per goal kind, shuffled
    U: task: wthr math news ... time     user: N_GOALS goals in order (adjacent goals differ in kind)
    A: call storm                        assistant: a call, or "A: done"
    T: ok next math                      tool: "ok next <goal>" (the next goal, or "done"), "wrong tool"
    A: call storm                              or "Tool not found", padded to one width
    T: wrong tool                        <- redundant: repeats the call that just answered ok
    A: call tally
    T: Tool not found                    <- invalid: the tool is not in the list; the episode goes on
    A: call adder                        (the 4th assistant turn)
    S: tools: storm hours adder press    system: the list again after every RESTATE-th assistant line,
    T: ok next news                              before the tool's answer
    ...
    A: done

Rules (`step`):
- A call to a listed tool of the current goal's kind reaches the goal ("ok next <goal>"); another
  listed tool answers "wrong tool"; a tool not in the list answers "Tool not found". Every answer is
  padded to the width of "Tool not found", so episodes that behave alike keep equal-length contexts
  and are generated as one batch (runtime/generate.py takes equal-length prompts).
- Two behaviours are flagged for feedback; the reward sees neither:
    invalid    a call to a tool that is not available;
    redundant  a call to the tool whose call last answered ok: its answer is already in the context
               (and, since adjacent goals differ in kind, it is never the tool the next goal needs).
- After every RESTATE-th assistant line (unless the episode ended) the system line is repeated, before
  the tool's answer (after it when the line was cut without its newline), so the tool list is never more
  than RESTATE turns (~140 tokens) back and the answer naming the next goal stays right before the next
  call: a small model cannot look the list up ~1,000 tokens back (docs/feedback_long.md, "Base policy").
  It depends on the turn count only, so episodes that behave alike keep equal-length contexts.
- The episode ends at "A: done" or after MAX_ASSISTANT_TURNS assistant turns. Reward = success = every
  goal reached, then "done", within the budget: N_GOALS + 1 turns plus SLACK spare ones.

Bound on what one wrong call does to the reward: a wrong call (invalid, redundant or wrong tool) changes
no state but the turn count. So in an episode with at most SLACK - 1 other wrong turns, adding one
wrong call anywhere leaves the reward exactly unchanged (the same goals are reached by the same later
calls, one turn later, still within the budget); only an episode that already spent all SLACK spare
turns can lose its reward (1 -> 0) to one more (tests/unit/test_long_tool_env.py checks both sides).

Feedback: an invalid turn gets "R: Reminder: available tools: ...", a redundant turn gets
"R: Reminder: do not repeat a call that answered ok", each inserted just before that turn.

`transcript()` writes pretraining data in which both behaviours exist, and in which a reminder line is
always followed by a call that avoids the reminded mistake (so the hint-conditioned teacher knows better).
"""

import random
from dataclasses import dataclass, field

from experiments.tool_env import GOALS, NOT_FOUND, OK, WRONG, Episode, play as play_rounds
from experiments.tool_env import answer_line as tool_env_answer_line, step as tool_env_step

N_GOALS = 19
SLACK = 10  # spare assistant turns for wrong calls
MAX_ASSISTANT_TURNS = N_GOALS + 1 + SLACK  # 30: N_GOALS calls, "done", SLACK wrong calls
RESTATE = 4  # the system line (the tool list) is repeated after every RESTATE assistant turns
WIDTH = len(NOT_FOUND)  # every tool answer is padded to this width
REPEAT_HINT = "R: Reminder: do not repeat a call that answered ok\n"


@dataclass
class LongEpisode(Episode):
    """An Episode of this environment: also the redundant turns and the tool of the last ok."""

    redundant_turns: list[int] = field(default_factory=list)  # indices into turns
    last_ok: str = ""  # the tool whose call last answered ok

    def targeted_turns(self) -> list[int]:
        return sorted(self.invalid_turns + self.redundant_turns)

    def feedback_hints(self) -> list[tuple[int, str]]:
        hints = [(t, self.hint()) for t in self.invalid_turns] + [(t, REPEAT_HINT) for t in self.redundant_turns]
        return sorted(hints)

    def wrong_turns(self) -> int:
        """Assistant turns that reached no goal and were not the final "done"."""
        return self.assistant_turns() - self.reached - int(self.done and self.turns[-1][1] == "A: done\n")


def new_episode(rng: random.Random, n_goals: int = N_GOALS) -> LongEpisode:
    tools = [rng.choice(synonyms) for synonyms in GOALS.values()]
    rng.shuffle(tools)
    goals = [rng.choice(sorted(GOALS))]
    while len(goals) < n_goals:
        goals.append(rng.choice([g for g in sorted(GOALS) if g != goals[-1]]))
    episode = LongEpisode(tools=tuple(tools), goals=tuple(goals))
    episode.turns = [("system", f"S: tools: {' '.join(tools)}\n"), ("user", f"U: task: {' '.join(goals)}\n")]
    return episode


def answer_line(answer: str, complete: bool = True) -> str:
    """tool_env's tool turn with the answer padded to one width (equal-behaving episodes stay one batch)."""
    return tool_env_answer_line(f"{answer:<{WIDTH}}", complete)


def step(episode: LongEpisode, line: str) -> None:
    """Apply one assistant line (exactly as generated) and the environment's answer (see the rules).
    A line without its newline (cut at the token limit) is a bad call. The protocol is tool_env's."""
    tool_env_step(episode, line, answer_fn=_answer, format_answer=answer_line, max_turns=MAX_ASSISTANT_TURNS)
    if not episode.done and episode.assistant_turns() % RESTATE == 0:
        at = len(episode.turns) - 1 if line.endswith("\n") else len(episode.turns)  # before the answer
        episode.turns.insert(at, ("system", episode.turns[0][1]))


def _answer(episode: LongEpisode, tool: str, turn: int) -> str:
    if tool not in episode.tools:
        episode.invalid_turns.append(turn)
        return NOT_FOUND
    if tool == episode.last_ok:
        episode.redundant_turns.append(turn)
    if episode.reached < len(episode.goals) and tool in GOALS[episode.goals[episode.reached]]:
        episode.reached += 1
        episode.last_ok = tool
        following = episode.goals[episode.reached] if episode.reached < len(episode.goals) else "done"
        return f"{OK} next {following}"
    return WRONG


def transcript(rng: random.Random, p_invalid: float, p_reminder: float, p_redundant: float,
               n_goals: int = N_GOALS) -> str:
    """A demonstration episode for pretraining. Before each goal's right call: after an ok, a reminder
    not to repeat (p_reminder) or else a redundant repeat (p_redundant); then the tools reminder
    (p_reminder) or else a call to an unavailable synonym (p_invalid). A reminder is always followed by
    a call that avoids the reminded mistake."""
    episode = new_episode(rng, n_goals)
    for goal in episode.goals:
        right = next(t for t in episode.tools if t in GOALS[goal])
        if episode.last_ok and not episode.done:
            if rng.random() < p_reminder:
                episode.turns.append(("system", REPEAT_HINT))
            elif rng.random() < p_redundant:
                step(episode, f"A: call {episode.last_ok}\n")
        if not episode.done:
            if rng.random() < p_reminder:
                episode.turns.append(("system", episode.hint()))
            elif rng.random() < p_invalid:
                step(episode, f"A: call {rng.choice([t for t in GOALS[goal] if t != right])}\n")
        if not episode.done:
            step(episode, f"A: call {right}\n")
    if not episode.done:
        step(episode, "A: done\n")
    return episode.text()


def play(model, episodes: list[LongEpisode], sampling, *, seed: int, first_id: int = 0) -> list[dict[int, list[float]]]:
    """experiments/tool_env.py `play` with this environment's rules and turn budget (one batched generate call
    per round and context length; KV cache within the call)."""
    return play_rounds(model, episodes, sampling, seed=seed, first_id=first_id, step_fn=step,
                       max_turns=MAX_ASSISTANT_TURNS)
