"""Rollout files: validation (one line naming the file line, exit 2 on every rank before any collective)
and batching (the same trajectories per step whatever the layout; every trained and target token
lands on exactly one rank, with the step's global counts)."""

import json

import numpy as np
import pytest

from launch.posttrain import main
from entry_point import run_pretrain
from runtime.posttrain.rollout_batch import RolloutLoader, _owner
from runtime.posttrain.rollouts import read_rollouts

VOCAB, MAX_LEN = 256, 256


def _traj(n=40, **over) -> dict:
    """system [0,10) user [10,20) assistant [20,30) tool [30,35) assistant [35,n)."""
    record = {"tokens": [(7 * j) % VOCAB for j in range(n)],
              "turns": [{"role": "system", "start": 0, "end": 10}, {"role": "user", "start": 10, "end": 20},
                        {"role": "assistant", "start": 20, "end": 30}, {"role": "tool", "start": 30, "end": 35},
                        {"role": "assistant", "start": 35, "end": n}],
              "advantage": 0.5, "logprobs": [-1.0] * n,
              "feedback": [{"turn": 2, "hint": [1, 2, 3]}]}
    record.update(over)
    return record


def _write(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


BAD = {  # name: (lines of the file, expected text in the one-line error)
    "malformed_json": ([_traj(), '{"tokens": [1, 2,'], "line 2: malformed JSON"),
    "turn_out_of_bounds": ([_traj(n=30, turns=[{"role": "assistant", "start": 20, "end": 31}])],
                           "line 1: turns[0]: range [20, 31) is out of bounds"),
    "turns_overlap": ([_traj(), _traj(turns=[{"role": "user", "start": 0, "end": 12},
                                             {"role": "assistant", "start": 10, "end": 20}], feedback=[])],
                      "line 2: turns[0] [0, 12) and turns[1] [10, 20) overlap"),
    "feedback_on_user_turn": ([_traj(feedback=[{"turn": 1, "hint": [5]}])],
                              "line 1: feedback[0].turn=1 is a user turn"),
    "teacher_too_long": ([_traj(n=250, feedback=[{"turn": 4, "hint": [9] * 7}])],
                         "teacher sequence (turn end 250 + hint 7 = 257 tokens) is longer than model.max_seq_len=256"),
    "hint_after_turn_start": ([_traj(feedback=[{"turn": 2, "hint": [5], "at": 21}])],
                              "line 1: feedback[0].at=21 must be a token index in [0, turn start 20]"),
    "logprobs_wrong_length": ([_traj(), _traj(), _traj(logprobs=[-1.0] * 39)],
                              "line 3: logprobs: expected one per token (40), got 39"),
    "empty_file": ([], "holds no trajectory"),
    "token_out_of_vocab": ([_traj(tokens=[300] * 40)], "token id 300 outside [0, model.vocab_size=256)"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_rollouts_name_the_line(tmp_path, name):
    lines, expected = BAD[name]
    with pytest.raises(ValueError, match=None) as err:
        read_rollouts(_write(tmp_path / "r.jsonl", lines), VOCAB, MAX_LEN)
    message = str(err.value)
    assert expected in message and "\n" not in message and message.startswith("data.path"), message


@pytest.mark.parametrize("name", ["malformed_json", "teacher_too_long", "empty_file"])
def test_bad_rollouts_exit_2_on_every_rank_with_rank0s_line(tmp_path, capfd, name):
    """Each rank validates its share of the lines (runtime/posttrain/rollout_file.py) and one all-gather that every
    rank reaches agrees on the first bad line: every rank stops, rank 0 prints the one line (the bad
    line of malformed_json is in rank 1's share, that of teacher_too_long in rank 0's)."""
    path = _write(tmp_path / "r.jsonl", BAD[name][0])
    codes, _ = run_pretrain(tmp_path, 2, ["--data.source=rollouts", f"--data.path={path}"], timeout=60, entry=main)
    assert codes == [2, 2]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("data.path")]
    assert len(lines) == 1 and BAD[name][1] in lines[0], lines


def _mixed_file(tmp_path) -> str:
    """Lengths 20..90, some without logprobs or feedback, one with a turn starting at token 0."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(13):
        n = int(rng.integers(40, 91))
        over = {"logprobs": None} if i % 3 == 0 else {}
        record = _traj(n=n, **over, **({} if i % 2 == 0 else {"feedback": []}))
        records.append({k: v for k, v in record.items() if v is not None})
    records.append(_traj(n=20, turns=[{"role": "assistant", "start": 0, "end": 20}],
                         feedback=[{"turn": 0, "hint": [4, 4]}]))
    return _write(tmp_path / "mixed.jsonl", records)


class _Data:
    def __init__(self, path, batch_tokens):
        self.path, self.batch_tokens = path, batch_tokens


def _rank_views(path, dp, cp, step, grad_accum=1):
    views = []
    for d in range(dp):
        for c in range(cp):
            loader = RolloutLoader(_Data(path, 400), seed=3, vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_rank=d,
                                   dp_degree=dp, cp_rank=c, cp_degree=cp, grad_accum=grad_accum)
            views.append(((d, c), loader.batch(step)))
    return views


def _global_tokens(views):
    """(trained (label, advantage) multiset, target labels multiset) gathered from every rank's tensors."""
    trained, targets, teacher_side = [], [], 0
    for _, step in views:
        for mb in step.micro_batches:
            trained += sorted(zip(mb.labels_n.tolist(), mb.advantages_n.tolist()))
            targets += mb.target_labels_m.tolist()
            teacher_side += len(mb.teacher_flat_m)
    return sorted(trained), sorted(targets), teacher_side


@pytest.mark.parametrize("dp, cp, grad_accum", [(2, 1, 1), (4, 2, 1), (2, 2, 2), (1, 4, 1)])
def test_every_token_lands_once_whatever_the_layout(tmp_path, dp, cp, grad_accum):
    path = _mixed_file(tmp_path)
    for step in range(3):
        (_, single), = _rank_views(path, 1, 1, step)
        views = _rank_views(path, dp, cp, step, grad_accum)
        assert all(v.trained_tokens == single.trained_tokens and v.target_tokens == single.target_tokens
                   for _, v in views)
        assert _global_tokens(views)[:2] == _global_tokens([((0, 0), single)])[:2]
        assert _global_tokens(views)[2] == single.target_tokens  # each teacher position on one rank
        assert len(_global_tokens(views)[0]) == single.trained_tokens
        assert len({len(v.micro_batches) for _, v in views}) == 1
        for _, v in views:  # every rank runs the same number of forwards with the same row counts
            rows = [mb.inputs_BS.shape[0] for mb in v.micro_batches]
            assert rows == [mb.inputs_BS.shape[0] for mb in views[0][1].micro_batches]


def test_steps_follow_the_seed_and_the_budget(tmp_path):
    path = _mixed_file(tmp_path)
    costs = lambda loader, t: [loader.rollouts[i].cost() for i in loader.plan.step(t)]  # noqa: E731
    a = RolloutLoader(_Data(path, 400), seed=3, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    b = RolloutLoader(_Data(path, 400), seed=4, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    steps_a = [a.plan.step(t) for t in range(6)]
    assert steps_a == [RolloutLoader(_Data(path, 400), seed=3, vocab_size=VOCAB, max_seq_len=MAX_LEN).plan.step(t)
                       for t in range(6)]
    assert steps_a != [b.plan.step(t) for t in range(6)]
    for t in range(6):
        assert sum(costs(a, t)) <= 400 or len(costs(a, t)) == 1
    visited = [i for s in steps_a for i in s]
    assert len(visited) >= len(a.rollouts) and sorted(visited[:len(a.rollouts)]) == list(range(len(a.rollouts)))  # epochs


def test_cp_split_puts_student_and_teacher_positions_on_different_ranks(tmp_path):
    """Feedback item k of a slot is forwarded whole by cp rank k % cp, its targets' student positions
    follow the balanced split: with cp=2 some targets' teacher data must move (steps 0-3)."""
    path = _mixed_file(tmp_path)
    views = [view for step in range(4) for view in _rank_views(path, 1, 2, step)]
    moved = sum(int((mb.source_rank_m != c).sum()) for (_, c), v in views for mb in v.micro_batches)
    assert moved > 0


def test_the_start_up_line_names_trajectories_over_the_budget(tmp_path):
    path = _mixed_file(tmp_path)
    loader = RolloutLoader(_Data(path, 400), seed=3, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    costs = [loader.rollouts[i].cost() for i in range(len(loader.rollouts))]
    budget = sorted(costs)[len(costs) // 2]  # half the trajectories are over it
    over = [c for c in costs if c > budget]
    line = RolloutLoader(_Data(path, budget), seed=3, vocab_size=VOCAB, max_seq_len=MAX_LEN).describe()
    assert f"except {len(over)} trajectories over data.batch_tokens (up to {max(over)} tokens)" in line, line
    assert "except" not in RolloutLoader(_Data(path, max(costs)), seed=3, vocab_size=VOCAB,
                                         max_seq_len=MAX_LEN).describe()
