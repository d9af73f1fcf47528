"""The tool-use environment (examples/tool_env.py): its rules on hand-written assistant lines, the
pretraining transcripts, the rollout records, and episodes played by a model through the KV-cache
generator."""

import random

import pytest

from examples.tool_env import (GOALS, MAX_ASSISTANT_TURNS, new_episode, play, rollout_record, step, transcript)
from models import Transformer, preset
from runtime.generate import SamplingConfig


def _episode():
    episode = new_episode(random.Random(3))
    return episode, {goal: next(t for t in episode.tools if t in GOALS[goal]) for goal in GOALS}


def test_rules_reward_and_invalid_turns():
    episode, right = _episode()
    first, second = episode.goals
    missing = next(t for t in GOALS[first] if t not in episode.tools)
    other = next(t for t in episode.tools if t not in (right[first], right[second]))
    for line in (f"A: call {missing}\n", f"A: call {other}\n", f"A: call {right[first]}\n", f"A: call {right[second]}\n",
                 "A: done\n"):
        step(episode, line)
    answers = [line for role, line in episode.turns if role == "tool"]
    assert answers == ["T: Tool not found\n", "T: wrong tool\n", "T: ok\n", "T: ok\n"]
    assert episode.success and episode.done and episode.invalid_turns == [2]


def test_done_too_early_fails_and_turns_are_limited():
    episode, right = _episode()
    step(episode, f"A: call {right[episode.goals[0]]}\n")
    step(episode, "A: done\n")
    assert episode.done and not episode.success
    episode, _ = _episode()
    for _ in range(MAX_ASSISTANT_TURNS):
        step(episode, "A: call nothing")  # cut line: a bad call, the newline goes to the tool turn
    assert episode.done and not episode.success and episode.turns[-1] == ("tool", "\nT: bad call\n")


def test_transcripts_succeed_and_hold_the_behaviour_to_fix():
    rng = random.Random(0)
    texts = [transcript(rng, p_invalid=0.3, p_reminder=0.2) for _ in range(400)]
    not_found = sum(text.count("Tool not found") for text in texts)
    first_calls = 2 * len(texts)
    assert 0.15 < not_found / first_calls < 0.35  # 0.3 of the un-reminded first calls (0.8 of them)
    for text in texts:
        lines = text.splitlines()
        for before, after in zip(lines, lines[1:]):
            if before.startswith("R: Reminder"):  # a reminded call is always to an available tool
                assert after.split()[2] in lines[0].split()[2:]


def test_rollout_record_has_the_hint_on_invalid_turns():
    episode, right = _episode()
    missing = next(t for t in GOALS[episode.goals[0]] if t not in episode.tools)
    step(episode, f"A: call {missing}\n")
    record = rollout_record(episode, logprobs={2: [-0.5] * len(f"A: call {missing}\n")}, advantage=-1.0)
    turn = record["turns"][2]
    assert turn["role"] == "assistant" and bytes(record["tokens"][turn["start"]:turn["end"]]).decode() == \
        f"A: call {missing}\n"
    assert record["feedback"] == [{"turn": 2, "hint": list(episode.hint().encode())}]
    assert len(record["logprobs"]) == len(record["tokens"]) and record["logprobs"][turn["start"]] == -0.5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_plays_episodes_to_the_end(temperature):
    model = Transformer(preset("debug"))
    model.init_weights(seed=0)
    rng = random.Random(1)
    episodes = [new_episode(rng) for _ in range(3)]
    logprobs = play(model, episodes, SamplingConfig(temperature=temperature, max_new_tokens=16), seed=0)
    for episode, per_turn in zip(episodes, logprobs):
        assert episode.done
        record = rollout_record(episode, per_turn)
        assert len(record["logprobs"]) == len(record["tokens"])
        for i, (role, line) in enumerate(episode.turns):
            if role == "assistant":  # generated tokens only, each with its behaviour log-prob
                assert len(per_turn[i]) == len(line.encode("latin-1")) and all(lp <= 0 for lp in per_turn[i])
