"""feedback_kl against an outside computation: `transformers`' DeepseekV3ForCausalLM forward of each
trajectory and of each feedback item's teacher sequence tokens[:at] + hint + tokens[at:end], one
sequence per forward, fp32 logits, the KL summed in fp64 and averaged over every target token once.

Several trajectories of different lengths (padded rows), several flagged turns each, hints of several
lengths, some inserted before their turn (`at`), the default token budget (larger than the file)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import hf_config, random_hf_model  # noqa: E402
from models.hf.checkpoint import load_pretrained  # noqa: E402
from runtime.data.config import DataConfig  # noqa: E402
from runtime.posttrain.config import PosttrainConfig  # noqa: E402
from runtime.posttrain.objective import FeedbackObjective  # noqa: E402
from runtime.posttrain.rollout_batch import RolloutLoader  # noqa: E402

VOCAB, MAX_LEN = 96, 512
LENGTHS = (57, 23, 41, 30)
# fp32 both sides, sums ordered differently: measured <= 6e-7 relative. A trajectory counted twice in
# a step, a target off by one position or a wrong denominator moves it by > 1e-3.
RTOL = 1e-5


def _trajectory(i: int, n: int) -> dict:
    """Turns of 5-8 tokens alternating user / assistant; feedback on every assistant turn, hints of
    1-4 tokens, every other one inserted 2 tokens before its turn."""
    g = torch.Generator().manual_seed(10 + i)
    tokens = torch.randint(0, VOCAB, (n,), generator=g).tolist()
    turns, start = [], 0
    while start < n:
        end = min(n, start + 5 + len(turns) % 4)
        turns.append({"role": "assistant" if len(turns) % 2 else "user", "start": start, "end": end})
        start = end
    feedback = [{"turn": k, "hint": [5, 6, 7, 8][:1 + k % 4], "at": turns[k]["start"] - 2 * (k % 4 == 1)}
                for k in range(1, len(turns), 2)]
    return {"tokens": tokens, "turns": turns, "advantage": 0.5, "feedback": feedback}


RECORDS = [_trajectory(i, n) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module", params=[1.0, 8.0], ids=["spread", "peaked"])
def models(request, tmp_path_factory):
    """(transformers model, ours loaded from its saved directory); `peaked` scales the output head."""
    hf = random_hf_model(hf_config(max_position_embeddings=MAX_LEN))
    with torch.no_grad():
        hf.lm_head.weight.mul_(request.param)
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return hf, load_pretrained(str(path))


@torch.no_grad()
def _oracle_kl(hf) -> float:
    """Mean over every target token of KL(student || teacher), each sequence alone through transformers."""
    terms = []
    for r in RECORDS:
        student = torch.log_softmax(hf(input_ids=torch.tensor([r["tokens"]])).logits[0].double(), -1)
        for item in r["feedback"]:
            turn, hint, at = r["turns"][item["turn"]], item["hint"], item["at"]
            teacher_seq = r["tokens"][:at] + hint + r["tokens"][at:turn["end"]]
            teacher = torch.log_softmax(hf(input_ids=torch.tensor([teacher_seq])).logits[0].double(), -1)
            for j in range(max(turn["start"], 1), turn["end"]):
                s, t = student[j - 1], teacher[j + len(hint) - 1]
                terms.append((s.exp() * (s - t)).sum())
    return torch.stack(terms).mean().item()


def _step(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    data = DataConfig(source="rollouts", path=str(path))  # the default budget: more than the file holds
    return RolloutLoader(data, seed=0, vocab_size=VOCAB, max_seq_len=MAX_LEN).batch(0)


def test_feedback_kl_equals_transformers(models, tmp_path):
    hf, ours = models
    step = _step(tmp_path)
    assert step.target_tokens == sum(r["turns"][f["turn"]]["end"] - r["turns"][f["turn"]]["start"]
                                     for r in RECORDS for f in r["feedback"])  # every target once
    objective = FeedbackObjective(PosttrainConfig(rl_coef=0.0))
    metrics = objective.forward_backward(ours, step, torch.device("cpu"))[2]
    assert metrics["feedback_kl"] == pytest.approx(_oracle_kl(hf), rel=RTOL)
