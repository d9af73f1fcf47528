"""The feedback experiment (benchmarks/feedback_experiment.py) in miniature: the whole on-policy loop
(pretraining through launch/pretrain.py, play, score, records, one optimizer step of the posttrain
objective, measurement) for every arm; and one feedback step on a turn that called an unavailable tool
moves the student's probability of that tool's name the way the hint moves the teacher's (down, when
the hint makes the name less likely)."""

import json
import random

import pytest
import torch
import torch.distributed as dist

from benchmarks.feedback_experiment import (ARMS, MINIATURE, ExperimentConfig, Learner, arm_config, kl_untargeted,
                                            pretrain_base, run)
from examples.tool_env import GOALS, new_episode, rollout_record, step


@pytest.fixture(scope="module")
def miniature_base(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("feedback_base"))
    return work, pretrain_base(ExperimentConfig(**MINIATURE), work)


def test_miniature_loop_runs_every_arm_from_the_same_start(miniature_base):
    work, _ = miniature_base
    result = json.loads(json.dumps(run(ExperimentConfig(**MINIATURE), work, say=lambda _: None)))
    assert set(result["arms"]) == set(ARMS) and result["seeds"] == 1
    first = {}
    for arm, curves in result["arms"].items():
        assert curves["steps"] == [0, 1]
        for key in ("invalid_call_rate", "success_rate", "kl_untargeted"):
            assert len(curves[key]) == 2 and all(v >= 0 for v in curves[key])
            assert curves["spread"][key] == [curves[key], curves[key]]  # one seed: min = max = mean
        assert curves["kl_untargeted"][0] == 0.0  # measured before any step: the policy is its start
        first[arm] = (curves["invalid_call_rate"][0], curves["success_rate"][0])
    assert len(set(first.values())) == 1  # same weights, tasks and sampling streams at step 0 in every arm


def _name_logprob(model, episode, turn: int, hint: str = "") -> float:
    """log P(the called tool's name | the context before it), at assistant turn `turn` (optionally with
    the hint line inserted before the turn, as the teacher sees it)."""
    before = "".join(line for _, line in episode.turns[:turn]) + hint
    line = episode.turns[turn][1]
    prefix = before + "A: call "
    name = line[len("A: call "):-1]
    tokens = torch.tensor(list((prefix + name).encode("latin-1")))
    with torch.no_grad():
        model.eval()
        logp = torch.log_softmax(model(tokens[None], torch.arange(len(tokens)))[0].float(), -1)
        model.train()
    idx = torch.arange(len(prefix) - 1, len(tokens) - 1)
    return float(logp[idx, tokens[len(prefix):]].sum())


@pytest.mark.parametrize("hint_effect", ["lowers", "raises"])
def test_one_feedback_step_moves_the_called_name_the_way_the_hint_does(miniature_base, hint_effect):
    """Episodes open with a call to a tool that is not available. `feedback_only` takes one optimizer step
    on those whose teacher (the same model with the hint before the turn) gives the called name less
    probability than the student does ("lowers"), and, as the control, on those where it gives more
    ("raises"). On the miniature's barely trained base either is a coin flip per episode; on the
    experiment's base, which reads the hint, "lowers" is the rule. The student's summed log-probability
    of the names at the flagged turns must move the same way as the teacher's. The hand-written turns
    are trained as on-policy (no behaviour log-probs: ratio 1)."""
    work, base = miniature_base
    cfg = ExperimentConfig(**MINIATURE)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        learner = Learner(arm_config("feedback_only", 0, base, cfg, work))
        episodes = []
        for seed in range(16):
            e = new_episode(random.Random(seed))
            step(e, f"A: call {next(t for t in GOALS[e.goals[0]] if t not in e.tools)}\n")
            teacher, student = _name_logprob(learner.model, e, 2, e.hint()), _name_logprob(learner.model, e, 2)
            if (teacher < student) == (hint_effect == "lowers"):
                episodes.append(e)
        assert len(episodes) >= 4, len(episodes)
        before = sum(_name_logprob(learner.model, e, 2) for e in episodes)
        stats = learner.step(episodes, [None] * len(episodes))
        after = sum(_name_logprob(learner.model, e, 2) for e in episodes)
        assert stats["target_tokens"] == sum(len(e.turns[2][1]) - 3 for e in episodes) and stats["feedback_kl"] > 0
        assert (after < before) == (hint_effect == "lowers"), (before, after)
    finally:
        dist.destroy_process_group()


def test_kl_untargeted_covers_the_generated_tokens_of_untargeted_turns_only():
    """Against an independent definition: the turn ranges of `rollout_record` (generated tokens, not the
    "A: " header the environment writes), KL(p || q) by torch's kl_div, on two random next-byte models."""
    class Bigram(torch.nn.Module):  # next-byte logits from the current byte
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Embedding(256, 256)

        def forward(self, tokens, positions):
            return self.logits(tokens)

    torch.manual_seed(0)
    model, start = Bigram(), Bigram()
    episodes = []
    for seed in range(3):
        e = new_episode(random.Random(seed))
        goal = GOALS[e.goals[0]]
        step(e, f"A: call {next(t for t in goal if t not in e.tools)}\n")  # targeted: left out
        step(e, f"A: call {next(t for t in goal if t in e.tools)}\n")
        episodes.append(e)
    total, count = 0.0, 0
    for e in episodes:
        record = rollout_record(e, with_feedback=False)
        tokens = torch.tensor(record["tokens"])
        with torch.no_grad():
            logp, logq = (torch.log_softmax(m(tokens[None], None)[0], -1) for m in (model, start))
        for i, turn in enumerate(record["turns"]):
            if turn["role"] == "assistant" and i not in e.invalid_turns:
                rows = torch.arange(turn["start"], turn["end"]) - 1  # token j is predicted at j - 1
                total += float(torch.nn.functional.kl_div(logq[rows], logp[rows], log_target=True, reduction="sum"))
                count += len(rows)
    assert count > 0 and all(e.invalid_turns for e in episodes)
    assert kl_untargeted(model, start, episodes) == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("bad,message", [({"teacher": "x"}, "teacher='x': expected one of"),
                                         ({"seeds": 0}, "seeds=0 must be >= 1"),
                                         ({"lr": 0.0}, "lr=0.0 a finite number > 0")])
def test_bad_settings_are_one_line_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        ExperimentConfig(**bad)
