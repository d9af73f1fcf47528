"""runtime/rollout_file.py: the line index (built once, reused, rebuilt when the file changes, refused
when it is another file's), ranks validating a share each, and reading by offset.

Oracle: runtime/rollouts.read_rollouts, the sequential reader (the whole file in memory, line after
line), for the trajectories, their numbers and the first bad line's message."""

import json
import os
import shutil

import numpy as np
import pytest

from multirank import run_ranks
from runtime import rollout_file
from runtime.errors import RunError
from runtime.rollout_batch import RolloutLoader
from runtime.rollout_file import RolloutFile, index_path, line_offsets
from runtime.rollouts import read_rollouts

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
    assert rollouts.costs() == [t.cost() for t in expected]
    assert rollouts.token_count() == sum(len(t.tokens) for t in expected)
    for name, of in (("trained", lambda t: t.trained_tokens()), ("target", lambda t: t.target_tokens()),
                     ("feedback", lambda t: len(t.feedback))):
        assert rollouts.stats[name].tolist() == [of(t) for t in expected], name


def test_loader_batches_equal_those_of_the_trajectories_in_memory(tmp_path):
    path = _file(tmp_path / "r.jsonl", _lines(23))
    data = type("Data", (), {"path": path, "batch_tokens": 300})()
    from_file = RolloutLoader(data, 5, vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_degree=2, dp_rank=1, grad_accum=2)
    in_memory = RolloutLoader(data, 5, vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_degree=2, dp_rank=1, grad_accum=2,
                              trajectories=read_rollouts(path, VOCAB, MAX_LEN))
    for step in range(6):
        a, b = from_file.batch(step), in_memory.batch(step)
        assert a[1:] == b[1:]
        for x, y in zip(a.micro_batches, b.micro_batches):
            assert _flat(x) == _flat(y)


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
    return seen, (rollouts.lines.tolist(), rollouts.costs())


def test_ranks_validate_a_share_each_and_agree_with_one_process(tmp_path):
    path = _file(tmp_path / "r.jsonl", _lines(40))
    single = RolloutFile(path, VOCAB, MAX_LEN)
    results = run_ranks(_validate_on_ranks, 3, path, timeout=60)
    shares = [seen for seen, _ in results]
    n_lines = len(line_offsets(path)) - 1
    assert sorted(sum(shares, [])) == list(range(1, n_lines + 1)) and all(len(s) < n_lines / 2 for s in shares)
    assert all(out == (single.lines.tolist(), single.costs()) for _, out in results)


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
