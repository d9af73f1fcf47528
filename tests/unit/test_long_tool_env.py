"""The long-horizon tool-use environment (experiments/long_tool_env.py): its rules on hand-written assistant
lines (a wrong call continues the episode, the turn budget, the redundant call's detection), the bound
on what one wrong call does to the reward, the pretraining transcripts, the rollout records, and
batched play against each episode played alone."""

import random

import pytest

from experiments.long_tool_env import (MAX_ASSISTANT_TURNS, N_GOALS, REPEAT_HINT, RESTATE, SLACK, WIDTH, new_episode,
                                       play, step, transcript)
from experiments.tool_env import GOALS, HEADER, rollout_record
from runtime.generate import SamplingConfig
from runtime.posttrain.rollouts import trajectory_from_record
from seeded_models import seeded_model


def _right(episode) -> dict[str, str]:
    return {goal: next(t for t in episode.tools if t in GOALS[goal]) for goal in GOALS}


def _missing(episode, goal: str) -> str:
    return next(t for t in GOALS[goal] if t not in episode.tools)


def _answers(episode) -> list[str]:
    return [line for role, line in episode.turns if role == "tool"]


def test_a_wrong_call_continues_and_answers_are_padded_to_one_width():
    episode = new_episode(random.Random(0))
    right, first, second = _right(episode), episode.goals[0], episode.goals[1]
    step(episode, f"A: call {_missing(episode, first)}\n")
    assert not episode.done and episode.invalid_turns == [2] and episode.reached == 0
    step(episode, f"A: call {right[first]}\n")
    assert episode.reached == 1 and not episode.done
    assert _answers(episode) == ["T: Tool not found\n", f"T: {'ok next ' + second:<{WIDTH}}\n"]
    assert len({len(a) for a in _answers(episode)}) == 1 and len(episode.goals) == N_GOALS
    assert all(a != b for a, b in zip(episode.goals, episode.goals[1:]))  # adjacent goals differ in kind


def _play_script(episode, wrong: dict[int, str]) -> None:
    """Reach every goal in order, with a wrong call of kind wrong[k] ("invalid", "redundant", "wrong")
    before goal k, then say done."""
    right = _right(episode)
    for k, goal in enumerate(episode.goals):
        kind = wrong.get(k)
        if kind == "invalid":
            step(episode, f"A: call {_missing(episode, goal)}\n")
        elif kind == "redundant":
            step(episode, f"A: call {episode.last_ok}\n")
        elif kind == "wrong":
            step(episode, f"A: call {next(t for t in episode.tools if t not in GOALS[goal] and t != episode.last_ok)}\n")
        if episode.done:
            return
        step(episode, f"A: call {right[goal]}\n")
    if not episode.done:
        step(episode, "A: done\n")


def test_the_turn_budget():
    episode = new_episode(random.Random(1))
    for _ in range(MAX_ASSISTANT_TURNS):
        step(episode, f"A: call {_missing(episode, episode.goals[0])}\n")
    assert episode.done and not episode.success and episode.assistant_turns() == MAX_ASSISTANT_TURNS == 30
    full = new_episode(random.Random(2))  # SLACK wrong calls: the last turn of the budget is "done"
    _play_script(full, {k: "invalid" for k in range(SLACK)})
    assert full.success and full.assistant_turns() == MAX_ASSISTANT_TURNS and full.wrong_turns() == SLACK


def test_the_redundant_call_is_detected_and_only_it():
    episode = new_episode(random.Random(3))
    right, goals = _right(episode), episode.goals
    step(episode, f"A: call {right[goals[0]]}\n")
    step(episode, f"A: call {right[goals[0]]}\n")  # repeats the call that answered ok
    assert episode.redundant_turns == [4] and episode.invalid_turns == [] and _answers(episode)[-1].startswith(
        "T: wrong tool")
    spare = next(t for t in episode.tools if t not in (right[goals[0]], right[goals[1]]))
    step(episode, f"A: call {spare}\n")  # a wrong tool that is not a repeat
    step(episode, f"A: call {_missing(episode, goals[1])}\n")  # invalid, not redundant
    step(episode, f"A: call {right[goals[0]]}\n")  # still the last ok's tool: redundant after other mistakes
    assert episode.turns[9] == episode.turns[0]  # the tool list again after RESTATE = 4 assistant lines
    assert episode.redundant_turns == [4, 11] and episode.invalid_turns == [8] and episode.reached == 1
    assert episode.targeted_turns() == [4, 8, 11]
    hints = dict(episode.feedback_hints())
    assert hints == {4: REPEAT_HINT, 8: episode.hint(), 11: REPEAT_HINT}


def test_the_tool_list_is_restated_every_restate_turns_and_never_after_the_end():
    """The system line comes again right after every RESTATE-th assistant line (before the tool's
    answer), whatever the turns were, so every assistant turn has the list at most RESTATE turns back
    and the answer right before it; nothing follows the last turn."""
    for seed, wrong in ((9, {}), (10, {k: "invalid" for k in range(3, 9)})):
        episode = new_episode(random.Random(seed))
        _play_script(episode, wrong)
        assert episode.success
        assistant, since_list = 0, 0
        for i, (role, line) in enumerate(episode.turns[2:], start=2):
            if role == "system":
                assert line == episode.turns[0][1] and assistant % RESTATE == 0 and since_list == RESTATE
                assert episode.turns[i - 1][0] == "assistant" and episode.turns[i + 1][0] == "tool"
                since_list = 0
            elif role == "assistant":
                assistant, since_list = assistant + 1, since_list + 1
                assert since_list <= RESTATE and (i == 2 or episode.turns[i - 1][0] == "tool")  # the answer: right before
        assert episode.turns[-1] == ("assistant", "A: done\n")
        assert sum(role == "system" for role, _ in episode.turns) == 1 + (episode.assistant_turns() - 1) // RESTATE


@pytest.mark.parametrize("kind", ["invalid", "redundant", "wrong"])
def test_one_wrong_call_leaves_the_reward_unchanged_until_the_slack_is_spent(kind):
    """The bound of the module docstring, on every insertion point: with m < SLACK other wrong calls,
    one more changes the reward by exactly 0; with m = SLACK it costs the whole reward (1 -> 0)."""
    rng = random.Random(4)
    for _ in range(5):
        seed = rng.randrange(10**6)
        m = rng.randrange(SLACK)
        others = dict.fromkeys(rng.sample(range(1, N_GOALS), m), "invalid")
        base = new_episode(random.Random(seed))
        _play_script(base, others)
        assert base.success and base.wrong_turns() == m
        for k in range(1, N_GOALS):
            if k in others:
                continue
            episode = new_episode(random.Random(seed))
            _play_script(episode, {**others, k: kind})
            assert episode.success and episode.reached == N_GOALS and episode.wrong_turns() == m + 1
    full = dict.fromkeys(range(1, SLACK + 1), "invalid")
    episode = new_episode(random.Random(5))
    _play_script(episode, full)
    assert episode.success
    episode = new_episode(random.Random(5))
    _play_script(episode, {**full, SLACK + 1: kind})
    assert episode.done and not episode.success  # the budget ends it before "done"


def test_transcripts_hold_both_behaviours_and_reminders_are_followed():
    rng = random.Random(0)
    texts = [transcript(rng, p_invalid=0.2, p_reminder=0.1, p_redundant=0.1) for _ in range(200)]
    not_found = sum(text.count("Tool not found") for text in texts) / (N_GOALS * len(texts))
    repeats = sum(text.count("wrong tool") for text in texts) / ((N_GOALS - 1) * len(texts))
    assert 0.13 < not_found < 0.23 and 0.06 < repeats < 0.12  # 0.2 * 0.9 and 0.1 * 0.9 (un-reminded)
    for text in texts:
        lines = text.splitlines()
        tools = lines[0].split()[2:]
        assert all(line == lines[0] for line in lines[1:] if line.startswith("S: "))
        lines = lines[:1] + [line for line in lines[1:] if not line.startswith("S: ")]  # a call, then its answer
        assert lines[-1] == "A: done" or sum(line.startswith("A: ") for line in lines) == MAX_ASSISTANT_TURNS
        last_ok = ""
        for before, after, answer in zip(lines, lines[1:], lines[2:]):
            if before.startswith("R: Reminder: available") and after.startswith("A: call"):
                assert after.split()[2] in tools
            if before == REPEAT_HINT.strip():
                assert after.split()[2] != last_ok
            if after.startswith("A: call") and answer.startswith("T: ok"):
                last_ok = after.split()[2]


def test_rollout_record_has_each_behaviours_hint():
    episode = new_episode(random.Random(6))
    right, first = _right(episode), episode.goals[0]
    step(episode, f"A: call {_missing(episode, first)}\n")
    step(episode, f"A: call {right[first]}\n")
    step(episode, f"A: call {right[first]}\n")
    record = rollout_record(episode)
    header = {i: record["turns"][i]["start"] - len(HEADER) for i in (2, 6)}
    assert record["feedback"] == [{"turn": 2, "hint": list(episode.hint().encode()), "at": header[2]},
                                  {"turn": 6, "hint": list(REPEAT_HINT.encode()), "at": header[6]}]
    traj = trajectory_from_record(record, 256, 1536)
    assert bytes(traj.teacher_tokens(traj.feedback[1]).tolist()).decode() == \
        "".join(line for _, line in episode.turns[:6]) + REPEAT_HINT + f"A: call {right[first]}\n"


def test_the_longest_episode_and_a_hint_fit_the_model():
    """30 turns of a 12-token bad line (no newline: "bad call"), the experiment's limit, with the tool
    list restated 7 times, plus a hint: within the long model's max_seq_len (1536)."""
    episode = new_episode(random.Random(7))
    while not episode.done:
        step(episode, HEADER + "x" * 12)
    assert sum(role == "system" for role, _ in episode.turns) == 1 + (MAX_ASSISTANT_TURNS - 1) // RESTATE == 8
    assert len(episode.text()) + len(episode.hint()) <= 1536


def test_batched_play_equals_each_episode_played_alone():
    """Episodes are batched by context length; each one's lines and log-probs must be those it gets
    when played alone (its own sampling stream: first_id names it). Lines of at most 2 tokens (an
    untrained model rarely ends a line) keep the 30 rounds short."""
    model = seeded_model("debug")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=2)
    rng = random.Random(8)
    episodes = [new_episode(rng, n_goals=3) for _ in range(2)]
    logprobs = play(model, episodes, sampling, seed=1)
    for i, episode in enumerate(episodes):
        alone = new_episode(random.Random(0), n_goals=3)
        alone.tools, alone.goals, alone.turns = episode.tools, episode.goals, list(episode.turns[:2])
        alone_logprobs = play(model, [alone], sampling, seed=1, first_id=i)
        assert alone.turns == episode.turns and alone.done
        for turn, values in logprobs[i].items():
            assert alone_logprobs[0][turn] == pytest.approx(values, abs=1e-5)
