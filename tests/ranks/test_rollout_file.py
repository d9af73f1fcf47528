"""runtime/posttrain/rollout_file.py: the line index (built once, reused, rebuilt when the file changes, refused
when it is another file's), ranks validating a share each, and reading by offset; RolloutLoader planning
a step from the gathered numbers, so a rank reads only its own micro-batches' lines.

Oracle: runtime/posttrain/rollouts.py read_rollouts, the sequential reader (the whole file in memory, line after
line), for the trajectories, their numbers and the first bad line's message; for a step, the step built
by parsing every trajectory of it (as RolloutLoader.batch did before)."""

import json
import os
import shutil

import numpy as np
import pytest

from multirank import run_ranks
from posttrain_cases import many_feedback_record
from runtime.errors import RunError
from runtime.posttrain import rollout_file
from runtime.posttrain.rollout_batch import RolloutLoader, RolloutStep, build_micro_batch
from runtime.posttrain.rollout_file import RolloutFile, index_path, line_offsets
from runtime.posttrain.rollouts import deal, read_rollouts

VOCAB, MAX_LEN = 256, 256


def _record(n: int, k: int) -> dict:
    """system [0, 5), assistant [5, n): n tokens; every other one with a hint, every third with log-probs."""
    record = {"tokens": [(k + 3 * j) % VOCAB for j in range(n)], "advantage": 0.25 * k,
              "turns": [{"role": "system", "start": 0, "end": 5}, {"role": "assistant", "start": 5, "end": n}]}
    if k % 2:
        record["feedback"] = [{"turn": 1, "hint": [k % VOCAB, 7]}]
    if k % 3 == 0:
        record["logprobs"] = [-0.5] * n
    return record


def _file(path, lines: list[str], newline_at_end: bool = True) -> str:
    path.write_text("\n".join(lines) + ("\n" if newline_at_end else ""))
    return str(path)


def _lines(count: int) -> list[str]:
    """JSON lines of 10 to 80 tokens, with blank lines among them."""
    out = []
    for k in range(count):
        out.append(json.dumps(_record(10 + (k * 37) % 71, k)))
        if k % 5 == 4:
            out.append("   ")
    return out


def _same(a, b) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and a.turns == b.turns and a.advantage == b.advantage
            and (a.logprobs is None) == (b.logprobs is None)
            and (a.logprobs is None or np.array_equal(a.logprobs, b.logprobs))
            and [(f.turn, f.hint.tolist(), f.at) for f in a.feedback] == [(f.turn, f.hint.tolist(), f.at)
                                                                         for f in b.feedback])


@pytest.mark.parametrize("newline_at_end", [True, False])
def test_trajectories_and_numbers_equal_the_sequential_reader(tmp_path, newline_at_end):
    path = _file(tmp_path / "r.jsonl", _lines(23), newline_at_end)
    expected = read_rollouts(path, VOCAB, MAX_LEN)
    rollouts = RolloutFile(path, VOCAB, MAX_LEN)
    assert len(rollouts) == len(expected) == 23
    assert all(_same(rollouts[i], t) for i, t in enumerate(expected))
    for name, of in (("cost", lambda t: t.cost()), ("tokens", lambda t: len(t.tokens)),
                     ("teacher", lambda t: t.teacher_cost()), ("trained", lambda t: t.trained_tokens()),
                     ("target", lambda t: t.target_tokens()), ("feedback", lambda t: len(t.feedback))):
        assert getattr(rollouts.stats, name).tolist() == [of(t) for t in expected], name


def _mixed_feedback_lines(count: int) -> list[str]:
    """Trajectories of 20 to 90 tokens with 0, 1, 2 (one hint before its turn: `at`) or one per
    assistant turn (posttrain_cases.many_feedback_record) feedback items, in turn; blank lines among them."""
    out = []
    for k in range(count):
        n = 20 + (k * 37) % 71
        record = many_feedback_record(k, n, VOCAB) if k % 4 == 3 else _record(n, k)
        if k % 4 == 0:
            record.pop("feedback", None)
        elif k % 4 == 2:
            record["turns"] = record["turns"][:1] + [{"role": "assistant", "start": 5, "end": 12},
                                                     {"role": "assistant", "start": 12, "end": n}]
            record["feedback"] = [{"turn": 1, "hint": [3], "at": 2}, {"turn": 2, "hint": [4, 5]}]
        out.append(json.dumps(record))
        if k % 7 == 6:
            out.append("")
    return out


def _step_by_parsing(trajs, plan, step, dp, dp_rank, cp, cp_rank, grad_accum) -> RolloutStep:
    """The oracle: the step as a rank built it by parsing every trajectory of the step (row counts from
    each slot's trajectories, totals from their methods)."""
    ids = plan.step(step)
    slots = deal(ids, plan.costs, grad_accum * dp)
    n_rows = max(1, max(len(s) for s in slots))
    n_prefix = max(sum(bool(trajs[i].feedback) for i in s) for s in slots)
    n_items = max(-(-sum(len(trajs[i].feedback) for i in s) // cp) for s in slots)
    micro = [build_micro_batch([trajs[i] for i in slots[m * dp + dp_rank]], n_rows, n_prefix, n_items, cp, cp_rank)
             for m in range(grad_accum)]
    step_trajs = [trajs[i] for i in ids]
    return RolloutStep(micro, sum(t.trained_tokens() for t in step_trajs), sum(t.target_tokens() for t in step_trajs),
                       sum(t.cost() for t in step_trajs), sum(t.teacher_cost() for t in step_trajs))


def _assert_same_step(a: RolloutStep, b: RolloutStep) -> None:
    assert a[1:] == b[1:] and len(a.micro_batches) == len(b.micro_batches)
    for x, y in zip(a.micro_batches, b.micro_batches):
        assert _flat(x) == _flat(y)


@pytest.mark.parametrize("dp, cp, grad_accum", [(1, 1, 1), (2, 1, 2), (4, 2, 1), (3, 2, 2), (1, 4, 1)])
def test_a_step_planned_from_the_numbers_equals_the_step_built_by_parsing(tmp_path, dp, cp, grad_accum):
    """Row counts and totals from the gathered numbers (RolloutFile.stats, or TrajectoryStats of the
    trajectories in memory) give every rank the step it built by parsing all of the step's trajectories:
    the same totals and micro-batches (steps of ~10 trajectories with 0 to 8 feedback items)."""
    path = _file(tmp_path / "r.jsonl", _mixed_feedback_lines(30))
    trajs = read_rollouts(path, VOCAB, MAX_LEN)
    assert {0, 1, 2} <= {len(t.feedback) for t in trajs} and max(len(t.feedback) for t in trajs) >= 3
    data = type("Data", (), {"path": path, "batch_tokens": 1200})()
    for d in range(dp):
        for c in range(cp):
            layout = dict(vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_degree=dp, dp_rank=d, cp_degree=cp, cp_rank=c,
                          grad_accum=grad_accum)
            loaders = [RolloutLoader(data, 5, **layout), RolloutLoader(data, 5, **layout, trajectories=trajs)]
            for step in range(4):
                expected = _step_by_parsing(trajs, loaders[0].plan, step, dp, d, cp, c, grad_accum)
                for loader in loaders:
                    _assert_same_step(loader.batch(step), expected)


def _overwrite_lines_but(path: str, bounds: np.ndarray, keep: set[int]) -> None:
    """Every line of the file but those in `keep` becomes as many bytes of malformed JSON (the offsets stay),
    and the file keeps its mtime: only the CRC of a line read can tell (runtime/posttrain/rollout_file.py)."""
    stat = os.stat(path)
    with open(path, "r+b") as f:
        for line in sorted(set(range(len(bounds) - 1)) - keep):
            f.seek(bounds[line])
            f.write(b"#" * int(bounds[line + 1] - bounds[line] - 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_rank_reads_only_its_own_micro_batches_lines(tmp_path):
    """dp=4, grad_accum=2: after validation, every line of the file but those of this rank's micro-batches
    in steps 0-2 is overwritten with malformed JSON, and the rank still builds those steps as it did
    from the intact file. A rank that parsed the other ranks' trajectories of a step (to count feedback
    items or sum tokens) would stop at one of those lines."""
    lines = _mixed_feedback_lines(30)
    intact = _file(tmp_path / "r.jsonl", lines)
    dp, grad_accum, steps = 4, 2, range(3)
    for rank in range(dp):
        layout = dict(vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_degree=dp, dp_rank=rank, grad_accum=grad_accum)
        reference = RolloutLoader(type("Data", (), {"path": intact, "batch_tokens": 1200})(), 5, **layout)
        path = _file(tmp_path / f"rank{rank}.jsonl", lines)
        loader = RolloutLoader(type("Data", (), {"path": path, "batch_tokens": 1200})(), 5, **layout)
        slots = [deal(loader.plan.step(t), loader.plan.costs, dp * grad_accum) for t in steps]
        own = {i for s in slots for m in range(grad_accum) for i in s[m * dp + rank]}
        assert {i for s in slots for slot in s for i in slot} - own  # other ranks' trajectories in these steps
        _overwrite_lines_but(path, loader.rollouts.bounds, {int(loader.rollouts.lines[i]) for i in own})
        with pytest.raises(ValueError, match="malformed JSON"):
            read_rollouts(path, VOCAB, MAX_LEN)
        for t in steps:
            _assert_same_step(loader.batch(t), reference.batch(t))


def _flat(fields) -> list:
    """A micro-batch's values as comparable lists (tensors, lists, ints; Documents field by field)."""
    out = []
    for v in fields:
        if isinstance(v, tuple):  # Documents (its block mask None off the flex path)
            out += _flat(v)
        else:
            out.append(v.tolist() if hasattr(v, "tolist") else v)
    return out


def test_index_is_built_once_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch):
    scans = []
    scan = rollout_file._scan
    monkeypatch.setattr(rollout_file, "_scan", lambda p: scans.append(p) or scan(p))
    lines = _lines(6)
    path = _file(tmp_path / "r.jsonl", lines)
    first = line_offsets(path)
    assert os.path.exists(index_path(path)) and scans == [path]
    assert np.array_equal(line_offsets(path), first) and len(scans) == 1  # reused
    assert first.tolist() == np.cumsum([0] + [len(s) + 1 for s in lines]).tolist()
    _file(tmp_path / "r.jsonl", lines + [lines[0]])  # appended: another size
    assert len(line_offsets(path)) == len(first) + 1 and len(scans) == 2
    stat = os.stat(path)
    _file(tmp_path / "r.jsonl", [lines[1]] + [lines[0]] + lines[2:] + [lines[0]])  # same size and mtime, other head
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and len(scans) == 2
    assert line_offsets(path)[1] == len(lines[1]) + 1 and len(scans) == 3


def test_index_of_another_file_or_not_an_index_is_one_line(tmp_path):
    a = _file(tmp_path / "a.jsonl", _lines(4))
    b = _file(tmp_path / "b.jsonl", _lines(9))
    line_offsets(a)
    shutil.copy(index_path(a), index_path(b))
    size_a, size_b = os.path.getsize(a), os.path.getsize(b)
    with pytest.raises(ValueError) as info:
        line_offsets(b)
    assert str(info.value) == (f"data.path: {index_path(b)} is the index of another file ('a.jsonl', {size_a:,} "
                               f"bytes), not of 'b.jsonl' ({size_b:,} bytes); delete it and it is rebuilt")
    with open(index_path(b), "w") as f:
        f.write("not an index")
    with pytest.raises(ValueError, match=r"^data.path: \S+b.jsonl.index.npz is not an index of a rollout file "
                                         r"\(\w+\); delete it and it is rebuilt$"):
        line_offsets(b)


def _validate_on_ranks(rank, world, path):
    """(lines this rank parsed while validating, its trajectories' line numbers and costs, or the error)."""
    seen = []
    parse = rollout_file.parse_line
    rollout_file.parse_line = lambda raw, number, *a: seen.append(number) or parse(raw, number, *a)
    try:
        rollouts = RolloutFile(path, VOCAB, MAX_LEN)
    except RunError as e:
        return seen, str(e)
    finally:
        rollout_file.parse_line = parse
    return seen, (rollouts.lines.tolist(), rollouts.stats.cost.tolist())


def test_ranks_validate_a_share_each_and_agree_with_one_process(tmp_path):
    path = _file(tmp_path / "r.jsonl", _lines(40))
    single = RolloutFile(path, VOCAB, MAX_LEN)
    results = run_ranks(_validate_on_ranks, 3, path, timeout=60)
    shares = [seen for seen, _ in results]
    n_lines = len(line_offsets(path)) - 1
    assert sorted(sum(shares, [])) == list(range(1, n_lines + 1)) and all(len(s) < n_lines / 2 for s in shares)
    assert all(out == (single.lines.tolist(), single.stats.cost.tolist()) for _, out in results)


@pytest.mark.parametrize("bad_at", [3, 45])
def test_a_bad_line_in_one_share_is_the_same_one_line_on_every_rank(tmp_path, bad_at):
    """The sequential reader's message for the file's first bad line, whichever rank's share holds it
    (line 3: rank 0's; 45: rank 2's, the last of the file), raised on all three ranks."""
    lines = _lines(40)
    lines[bad_at - 1] = lines[bad_at - 1].replace('"advantage": ', '"advantage": "high", "x": ')
    path = _file(tmp_path / "r.jsonl", lines)
    with pytest.raises(ValueError) as info:
        read_rollouts(path, VOCAB, MAX_LEN)
    assert f"line {bad_at}: " in str(info.value)
    results = run_ranks(_validate_on_ranks, 3, path, timeout=60)
    assert [out for _, out in results] == [str(info.value)] * 3
    owner = next(r for r, (seen, _) in enumerate(results) if bad_at in seen)
    assert owner == (0 if bad_at == 3 else 2)
