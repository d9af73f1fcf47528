"""The tool-use environment (experiments/tool_env.py): its rules on hand-written assistant lines, the
pretraining transcripts, the rollout records, and episodes played by a model through the KV-cache
generator."""

import random

import pytest

from experiments.tool_env import GOALS, HEADER, new_episode, play, rollout_record, step, transcript
from runtime.generate import SamplingConfig
from runtime.posttrain.rollouts import trajectory_from_record
from seeded_models import seeded_model


def _episode():
    episode = new_episode(random.Random(3))
    return episode, {goal: next(t for t in episode.tools if t in GOALS[goal]) for goal in GOALS}


def test_rules_reward_and_invalid_turns():
    episode, right = _episode()
    first, second, third = episode.goals
    missing = next(t for t in GOALS[first] if t not in episode.tools)
    for line in (f"A: call {missing}\n", f"A: call {right[first]}\n", f"A: call {right[second]}\n",
                 f"A: call {right[third]}\n", "A: done\n"):
        step(episode, line)
    answers = [line for role, line in episode.turns if role == "tool"]
    assert answers == ["T: Tool not found\n", "T: ok\n", "T: ok\n", "T: ok\n"]
    assert episode.success and episode.done and episode.invalid_turns == [2]


def test_a_tool_of_another_goal_is_the_wrong_tool_and_a_second_mistake_fails():
    episode, right = _episode()
    spare = next(kind for kind in GOALS if kind not in episode.goals)  # the listed tool no goal needs
    step(episode, f"A: call {right[spare]}\n")
    assert episode.turns[-1] == ("tool", "T: wrong tool\n") and episode.invalid_turns == []
    episode, right = _episode()
    first, second, third = episode.goals
    missing = [t for t in GOALS[first] if t not in episode.tools]
    for line in (f"A: call {missing[0]}\n", f"A: call {missing[1]}\n", f"A: call {right[first]}\n",
                 f"A: call {right[second]}\n", f"A: call {right[third]}\n"):
        step(episode, line)
    assert episode.done and not episode.success and episode.invalid_turns == [2, 4]


def test_transcripts_hold_the_behaviour_to_fix():
    rng = random.Random(0)
    texts = [transcript(rng, p_invalid=0.3, p_reminder=0.2) for _ in range(400)]
    not_found = sum(text.count("Tool not found") for text in texts)
    first_calls = 3 * len(texts)
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
    record = rollout_record(episode, logprobs={2: [-0.5] * len(f"call {missing}\n")}, advantage=-1.0)
    turn = record["turns"][2]
    assert turn["role"] == "assistant" and bytes(record["tokens"][turn["start"]:turn["end"]]).decode() == \
        f"call {missing}\n"  # the generated tokens; the header "A: " before them belongs to no turn
    header = turn["start"] - len(HEADER)
    assert bytes(record["tokens"][header:turn["start"]]).decode() == HEADER == "A: "
    assert record["turns"][1]["end"] == header
    assert record["feedback"] == [{"turn": 2, "hint": list(episode.hint().encode()), "at": header}]
    assert len(record["logprobs"]) == len(record["tokens"]) and record["logprobs"][turn["start"]] == -0.5
    assert record["logprobs"][header:turn["start"]] == [0.0] * 3
    traj = trajectory_from_record(record, 256, 512)  # the teacher reads the hint line, then "A: call ..."
    assert bytes(traj.teacher_tokens(traj.feedback[0]).tolist()).decode() == \
        episode.turns[0][1] + episode.turns[1][1] + episode.hint() + f"A: call {missing}\n"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_plays_episodes_to_the_end(temperature):
    model = seeded_model("debug")
    rng = random.Random(1)
    episodes = [new_episode(rng) for _ in range(3)]
    logprobs = play(model, episodes, SamplingConfig(temperature=temperature, max_new_tokens=16), seed=0)
    for episode, per_turn in zip(episodes, logprobs):
        assert episode.done
        record = rollout_record(episode, per_turn)
        assert len(record["logprobs"]) == len(record["tokens"])
        for i, (role, line) in enumerate(episode.turns):
            if role == "assistant":  # generated tokens only, each with its behaviour log-prob
                assert line.startswith(HEADER)
                assert len(per_turn[i]) == len(line) - len(HEADER) and all(lp <= 0 for lp in per_turn[i])
