"""The prefix-shared teacher (runtime/posttrain/objective.py prefix_shared_teacher): one pass over each trajectory's
prefix fills a KV cache, each feedback item's hint + turn attends to its cached tokens[:at] and itself.
Reference: the per-item teacher rows tokens[:at] + hint + tokens[at:end], each forwarded alone through
the same model (the teacher's definition), for the `live`, `initial` and `ema` teachers, MLA and GQA,
on one process and on cp=2 gloo ranks. Also: `teacher_tokens` counts the tokens really forwarded."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import Transformer
from multirank import run_ranks
from parallel.context_parallel import apply_context_parallel
from posttrain_cases import many_feedback_record
from runtime.posttrain.objective import FeedbackObjective, PosttrainConfig
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import deal, trajectory_from_record
from seeded_models import seeded_model

VOCAB, MAX_LEN = 256, 256
LENGTHS = (57, 23, 41, 30)  # several rows, several flagged turns each, one turn starting at token 0
# fp32 both sides; the cached prefix and the masked attention only reorder sums: measured <= 9.5e-7
# absolute (one ulp) on log-probs in [-8.5, -3.4], MLA and GQA. Another item's hint seen moves them by
# > 1e-2 (test_an_item_sees_only_its_own_hint).
ATOL = 1e-5


def _trajs():
    return [trajectory_from_record(many_feedback_record(i, n, VOCAB), VOCAB, MAX_LEN) for i, n in enumerate(LENGTHS)]


def _loader(cp: int = 1, cp_rank: int = 0) -> RolloutLoader:
    trajs = _trajs()
    data = type("Data", (), {"batch_tokens": sum(t.cost() for t in trajs)})
    return RolloutLoader(data, seed=0, vocab_size=VOCAB, max_seq_len=MAX_LEN, cp_rank=cp_rank, cp_degree=cp,
                         trajectories=trajs)


def _models(mode: str, name: str) -> tuple[Transformer, Transformer | None, FeedbackObjective]:
    """(student, teacher or None for live, objective in `sampled` mode: its teacher data is the log-prob)."""
    student = seeded_model(name, 0, init="generator")
    teacher = None if mode == "live" else seeded_model(name, 1, init="generator")
    objective = FeedbackObjective(PosttrainConfig(mode="sampled", teacher=mode), teacher=teacher)
    if mode == "ema":
        objective.after_step(student)  # the EMA moves: neither the student's weights nor its start
    return student, teacher, objective


@torch.no_grad()
def _reference(model: Transformer) -> dict[tuple[int, int], float]:
    """Teacher log-prob of every target, keyed by (student row, student position), from per-item rows."""
    loader = _loader()
    (slot,) = deal(loader.plan.step(0), loader.plan.costs, 1)
    out = {}
    for row, i in enumerate(slot):
        t = loader.rollouts[i]
        for item in t.feedback:
            logp = torch.log_softmax(model(torch.as_tensor(t.teacher_tokens(item))[None])[0].float(), -1)
            turn = t.turns[item.turn]
            for j in range(max(turn.start, 1), turn.end):
                out[(row, j - 1)] = logp[j + len(item.hint) - 1, t.tokens[j]].item()
    return out


def _key(mb, row: int, pos: int) -> tuple[int, int]:
    """(trajectory's index in the slot, position in it) of a student position (packed: one row)."""
    if mb.documents is None:
        return row, pos
    doc_L = mb.documents.doc_BL[row]
    return int(doc_L[pos]), pos - int((doc_L < doc_L[pos]).sum())


def _objective_logp(objective, student, step) -> dict[tuple[int, int], float]:
    """The objective's teacher log-probs of this rank's student-side targets, keyed like `_reference`."""
    (mb,) = step.micro_batches
    data, _ = objective._teacher(student, mb)
    S = mb.inputs_BS.shape[1]
    rows, local = mb.target_flat_m // S, mb.target_flat_m % S
    return {_key(mb, int(r), int(mb.positions_S[s])): v for r, s, v in zip(rows, local, data[0].tolist())}


def _check(got: dict, want: dict) -> None:
    assert got.keys() <= want.keys() and got
    worst = max(abs(got[k] - want[k]) for k in got)
    assert worst <= ATOL, worst


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
@pytest.mark.parametrize("mode", ["live", "initial", "ema"])
def test_teacher_logprobs_equal_per_item_rows(mode, name):
    student, teacher, objective = _models(mode, name)
    want = _reference(teacher if teacher is not None else student)
    got = _objective_logp(objective, student, _loader().batch(0))
    assert got.keys() == want.keys()
    _check(got, want)


def test_an_item_sees_only_its_own_hint():
    """The check above can fail: the reference with another item's hint in front differs by > 1e-2."""
    student = seeded_model("debug", 0, init="generator")
    want = _reference(student)
    t = _trajs()[0]
    a, b = t.feedback[0], t.feedback[1]
    turn = t.turns[b.turn]
    both = torch.as_tensor(list(t.tokens[:a.at]) + list(a.hint) + list(t.tokens[a.at:b.at]) + list(b.hint)
                           + list(t.tokens[b.at:turn.end]))
    with torch.no_grad():
        logp = torch.log_softmax(student(both[None])[0], -1)
    shift = len(a.hint) + len(b.hint) - 1
    (slot,) = deal(_loader().plan.step(0), _loader().plan.costs, 1)
    row = slot.index(0)
    worst = max(abs(logp[j + shift, t.tokens[j]].item() - want[(row, j - 1)]) for j in range(turn.start, turn.end))
    assert worst > 1e-2


def test_teacher_tokens_count_what_is_forwarded():
    """Per trajectory: its largest `at` once, then hint + tokens[at:end] per item; the per-item rows
    forwarded at + hint + (end - at) per item. Counted here from the tensors the teacher receives."""
    step = _loader().batch(0)
    (mb,) = step.micro_batches
    n_items = sum(len(t.feedback) for t in _trajs())
    assert mb.item_inputs_IS.shape[0] == 1  # packed: item k is document k of the one item row, padding n_items
    item_tokens = int((mb.item_doc_IL[:, mb.item_positions_S] < n_items).sum())
    forwarded = sum(int(t.prefix_length()) for t in _trajs()) + item_tokens
    per_item = sum(t.turns[f.turn].end + len(f.hint) for t in _trajs() for f in t.feedback)
    assert step.teacher_tokens == forwarded < per_item
    model = seeded_model("debug", 0, init="generator")
    metrics = FeedbackObjective(PosttrainConfig()).forward_backward(model, step, torch.device("cpu"))[2]
    assert metrics["teacher_tokens"] == step.teacher_tokens


def _cp_rank(rank, world, mode, name):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    student, teacher, _ = _models(mode, name)
    for model in (student, teacher):
        if model is not None:
            apply_context_parallel(model, mesh)
    objective = FeedbackObjective(PosttrainConfig(mode="sampled", teacher=mode), cp_group=mesh.get_group(),
                                  teacher=teacher)
    return _objective_logp(objective, student, _loader(world, rank).batch(0))


@pytest.mark.parametrize("mode", ["live", "ema"])
def test_context_parallel_equals_per_item_rows(mode):
    """cp=2: prefix rows split in balanced chunks, their gathered K/V cached on both ranks, items dealt
    to the ranks; every target's teacher log-prob reaches its student-side rank."""
    student, teacher, _ = _models(mode, "debug")
    want = _reference(teacher if teacher is not None else student)
    got = run_ranks(_cp_rank, 2, mode, "debug", timeout=120)
    assert sum(len(g) for g in got) == len(want)
    for g in got:
        _check(g, want)
