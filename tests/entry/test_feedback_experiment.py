"""The feedback experiment (experiments/feedback_experiment.py) in miniature: the whole on-policy loop
(pretraining through launch/pretrain.py, play, score, records, one optimizer step of the posttrain
objective, measurement) for every arm; and one feedback step on a turn that called an unavailable tool
moves the student's probability of that tool's name the way the hint moves the teacher's (down, when
the hint makes the name less likely). Episodes come from the experiment's environments
(experiments/tool_env.py, experiments/long_tool_env.py)."""

import json
import random

import pytest
import torch
import torch.distributed as dist

from experiments.feedback_experiment import (ARMS, MINIATURE, ExperimentConfig, Learner, arm_config, kl_untargeted,
                                             main, merge, precheck, pretrain_base, run, run_arm, summarize)
from experiments.tool_env import GOALS, new_episode, rollout_record, step


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


# ---- the long-horizon environment (--env long) ----------------------------------------------------

LONG_MINIATURE = dict(MINIATURE, env="long", transcripts=30, pretrain_steps=2, seeds=1, eval_episodes=2,
                      line_tokens=2)  # the untrained base rarely ends a line: 2 tokens keep its 30 rounds short


@pytest.fixture(scope="module")
def long_work(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("feedback_long"))
    pretrain_base(ExperimentConfig(**LONG_MINIATURE), work)
    return work


def test_long_quick_runs_end_to_end_through_the_cli(long_work, tmp_path):
    """`--env long --quick` through main() (the CLI, the JSON), shrunk to a miniature by explicit flags."""
    out = tmp_path / "long.json"
    rc = main(["--env", "long", "--quick", "--work", long_work, "--json", str(out), "--arms", "reward_only,feedback",
               *[f"--{k.replace('_', '-')}={v}" for k, v in LONG_MINIATURE.items() if k not in ("env", "seeds")],
               "--seeds=1"])
    result = json.loads(out.read_text())
    assert rc == 0 and list(result["arms"]) == ["reward_only", "feedback"] and result["config"]["env"] == "long"
    for curves in result["arms"].values():
        assert curves["steps"] == [0, 1] and curves["kl_untargeted"][0] == 0.0
        for key in ("invalid_call_rate", "redundant_call_rate", "success_rate", "kl_untargeted"):
            assert len(curves[key]) == 2 and all(v >= 0 for v in curves[key])
    steps0 = [(c["invalid_call_rate"][0], c["redundant_call_rate"][0]) for c in result["arms"].values()]
    assert steps0[0] == steps0[1]
    assert len(result["precheck"]) == 1 and result["seconds"] > 0


@pytest.mark.parametrize("teacher,mode", [("ema", "topk")])
def test_an_arm_repeated_gives_identical_numbers(long_work, teacher, mode):
    """Determinism for a seed, on the variant with the most moving parts (EMA teacher, top-k KL)."""
    cfg = ExperimentConfig(**{**LONG_MINIATURE, "teacher": teacher, "mode": mode})
    base = pretrain_base(cfg, long_work)
    first, second = (run_arm("feedback", 0, base, cfg, long_work) for _ in range(2))
    assert first == second


def test_precheck_against_a_direct_computation():
    """precheck's KL and name log-probabilities against a plain re-derivation on a bigram model (the
    teacher context = the text before the turn's header, the hint, the turn), per behaviour."""
    from experiments.long_tool_env import new_episode as long_episode, step as long_step

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Embedding(256, 256)

        def forward(self, tokens, positions):
            return self.logits(tokens)

    torch.manual_seed(0)
    model = Bigram()
    e = long_episode(random.Random(0))
    right = next(t for t in e.tools if t in GOALS[e.goals[0]])
    long_step(e, f"A: call {next(t for t in GOALS[e.goals[0]] if t not in e.tools)}\n")
    long_step(e, f"A: call {right}\n")
    long_step(e, f"A: call {right}\n")
    got = precheck(model, [e])
    assert set(got) == {"invalid", "redundant"}
    for turn, hint in e.feedback_hints():
        before = "".join(line for _, line in e.turns[:turn])
        line = e.turns[turn][1]
        with torch.no_grad():
            def logp(context):
                tokens = torch.tensor(list((context + line).encode()))
                return torch.log_softmax(model.logits(tokens), -1)[len(context) + 2:len(context) + len(line) - 1]
            s, t = logp(before), logp(before + hint)
            ids = torch.tensor(list(line.encode()))[3:]
            kl = float(torch.nn.functional.kl_div(t, s, log_target=True, reduction="sum"))
            name = slice(5, len(line) - 4)
            name_s = float(s.gather(1, ids[:, None])[name].sum())
            name_t = float(t.gather(1, ids[:, None])[name].sum())
        b = "redundant" if turn in e.redundant_turns else "invalid"
        assert got[b]["turns"] == 1
        assert got[b]["kl_per_token"] == pytest.approx(kl / len(ids), rel=1e-5)
        assert got[b]["name_logprob_change"] == pytest.approx(name_t - name_s, rel=1e-5, abs=1e-6)


def test_merge_joins_arms_and_seed_ranges_and_refuses_other_settings():
    def result(first, seeds, arm="feedback", lr=0.002):
        runs = [{"steps": [0], "invalid_call_rate": [0.1 * (first + k)]} for k in range(seeds)]
        return {"arms": {arm: summarize(runs)}, "seeds": seeds, "seconds": 1.0, "precheck": [{"s": first + k}
                                                                                          for k in range(seeds)],
                "config": {"first_seed": first, "seeds": seeds, "lr": lr, "arms": [arm]}}
    merged = merge([result(2, 1), result(0, 2), result(0, 3, "reward_only")])
    assert merged["seeds"] == 3 and list(merged["arms"]) == ["feedback", "reward_only"]
    assert merged["arms"]["feedback"]["invalid_call_rate"] == [pytest.approx(0.1)]
    assert merged["arms"]["feedback"]["spread"]["invalid_call_rate"] == [[0.0], [0.2]]
    assert merged["precheck"] == [{"s": 0}, {"s": 1}, {"s": 2}]
    with pytest.raises(ValueError, match="other than arms, first_seed"):
        merge([result(0, 1), result(1, 1, lr=0.1)])
    with pytest.raises(ValueError, match="first_seed=2, expected 1"):
        merge([result(0, 1), result(2, 1)])
    partial = merge([result(0, 1), result(0, 2, "reward_only")])
    assert partial["seeds_per_arm"] == {"feedback": 1, "reward_only": 2} and partial["seeds"] == 2


@pytest.mark.parametrize("flags,message", [(["--ema-decay=0.5"], "--ema-decay=0.5 has no effect here"),
                                           (["--top-k=8"], "--top-k=8 has no effect here"),
                                           (["--p-redundant=0.2"], "--p-redundant=0.2 has no effect"),
                                           (["--env=medium"], "env='medium': expected one of")])
def test_bad_flags_are_one_line_and_exit_2(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--json", str(tmp_path / "x.json"), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
