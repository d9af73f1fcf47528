"""Inputs that passed validation and then trained nothing (or nothing finite), and holes in the rollout
reader: each is now one line naming the file and line at start-up, or a Diverged stop (exit 3) instead
of exit 0."""

import json

import pytest

from launch.pretrain import main
from runtime.config_parser import load_config
from runtime.errors import Diverged
from runtime.guards import DivergenceGuard
from runtime.posttrain.rollouts import read_rollouts
from runtime.train import NextToken

VOCAB, MAX_LEN = 256, 64


def _traj(**over):
    n = 12
    record = {"tokens": list(range(1, n + 1)), "turns": [{"role": "user", "start": 0, "end": 4},
                                                          {"role": "assistant", "start": 4, "end": n}],
              "advantage": 0.5, "logprobs": [-1.0] * n, "feedback": [{"turn": 1, "hint": [7, 8]}]}
    record.update(over)
    return json.dumps(record)


def _lines(tmp_path, *lines, raw: bytes = b""):
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes("\n".join(lines).encode() + b"\n" + raw)
    return str(path)


BAD_ROLLOUTS = {  # second line -> the message after "line 2: "
    "advantage_absurd": (_traj(advantage=1e30), "advantage=1e+30: |advantage| must be <= 1e+06"),
    "advantage_huge_int": (_traj(advantage=10**400), "advantage: expected a finite number, got an integer of 401 digits"),
    "logprob_positive": (_traj(logprobs=[-1.0] * 5 + [0.7] + [-1.0] * 6),
                         "logprobs[5]=0.7 (an assistant token) is not the log of a probability"),
    "logprob_absurd": (_traj(logprobs=[-1.0] * 11 + [-1e30]), "logprobs[11]=-1e+30 (an assistant token)"),
    "no_assistant_token": (_traj(turns=[{"role": "user", "start": 0, "end": 12}], feedback=[]),
                           "no assistant token to train"),
    "assistant_only_at_0": (_traj(turns=[{"role": "assistant", "start": 0, "end": 1}], feedback=[]),
                            "no assistant token to train"),
    "empty_hint": (_traj(feedback=[{"turn": 1, "hint": []}]), "feedback[0].hint is empty"),
    "unknown_feedback_key": (_traj(feedback=[{"turn": 1, "hint": [3], "text": "be brief"}]),
                             "feedback[0]: unknown keys ['text']"),
    "token_beyond_int64": (_traj(tokens=[2**70] + list(range(2, 13))), "tokens: token id 1180591620717411303424 outside"),
    "hint_beyond_int64": (_traj(feedback=[{"turn": 1, "hint": [-2**80]}]), "feedback[0].hint: token id -120892581961"),
    "int_too_long_to_parse": ('{"advantage": ' + "9" * 5000 + "}", "malformed JSON (Exceeds the limit"),
    "deeply_nested": ("[" * 100000 + "]" * 100000, "malformed JSON (nested too deeply)"),
}


@pytest.mark.parametrize("case", list(BAD_ROLLOUTS))
def test_bad_rollout_is_one_line_naming_file_and_line(tmp_path, case):
    line, message = BAD_ROLLOUTS[case]
    path = _lines(tmp_path, _traj(), line)
    with pytest.raises(ValueError) as info:
        read_rollouts(path, VOCAB, MAX_LEN)
    text = str(info.value)
    assert "\n" not in text and len(text) < 400, text
    assert text.startswith(f"data.path: {path} line 2: {message}"), text


def test_non_utf8_rollout_line_is_named(tmp_path):
    path = _lines(tmp_path, _traj(), raw=b'{"tokens": [1], "x": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"^data.path: {path} line 2: not UTF-8 \(byte 0xff at column 23\)$"):
        read_rollouts(path, VOCAB, MAX_LEN)


def test_good_rollouts_still_read(tmp_path):
    path = _lines(tmp_path, _traj(), _traj(logprobs=None, feedback=[]), _traj(logprobs=[0.0] * 4 + [-103.0] * 8))
    assert len(read_rollouts(path, VOCAB, MAX_LEN)) == 3


# ---- the divergence guard -------------------------------------------------------------------------

def _pattern(guard, finite, last_at=None):
    for step, ok in enumerate(finite):
        guard.record(step, ok, last=step == last_at)


def test_guard_stops_on_too_large_a_fraction_of_skipped_steps():
    guard = DivergenceGuard(limit=3, fraction=0.25)
    with pytest.raises(Diverged, match=r"^diverged: 3 of the 6 steps up to step 5 .* training.max_nonfinite_fraction=0.25"):
        _pattern(guard, [True, False] * 10)  # never two in a row: the streak rule alone never stops it
    guard = DivergenceGuard(limit=3, fraction=0.25)
    _pattern(guard, [True] * 9 + [False, True] * 2 + [False])  # 3 of 14 skipped: 21%, below 25%


def test_guard_stops_a_run_that_never_took_a_finite_step():
    with pytest.raises(Diverged, match=r"^diverged: all 2 steps up to the last, step 1, had a non-finite"):
        _pattern(DivergenceGuard(limit=10, fraction=0.25), [False, False], last_at=1)
    with pytest.raises(Diverged, match="all 1 steps"):
        _pattern(DivergenceGuard(limit=0), [False], last_at=0)  # 0 turns the streak off, not this
    _pattern(DivergenceGuard(limit=10, fraction=0.25), [False, True], last_at=1)


def test_fraction_is_validated():
    with pytest.raises(ValueError, match=r"training.max_nonfinite_fraction=0.0 must be in \(0, 1\]"):
        load_config(["--training.max_nonfinite_fraction=0"])


class _NaNOn(NextToken):
    """Next-token loss times NaN on the steps `bad(step)` says (the loss of a model the data poisoned)."""

    def __init__(self, config, bad):
        super().__init__(config)
        self.bad, self.step = bad, 0

    def forward_backward(self, model, micro_batches, device):
        loss, tokens, extra = super().forward_backward(model, micro_batches, device)
        self.step += 1
        return (loss * float("nan") if self.bad(self.step - 1) else loss), tokens, extra


ARGS = ["--data.seq_len=16", "--data.batch_size=2", "--training.warmup_steps=1", "--checkpoint.interval=0",
        "--parallel.dp_replicate=1", "--parallel.dp_shard=1", "--parallel.cp=1", "--parallel.edp_replicate=1",
        "--parallel.edp_shard=1", "--parallel.ep=1"]


@pytest.mark.parametrize("steps, limit, bad, message", [
    (3, 10, lambda s: True, "diverged: all 3 steps up to the last, step 2,"),  # fewer steps than the streak limit
    (12, 3, lambda s: s % 2 == 1, "diverged: 3 of the 6 steps up to step 5 had"),  # never a streak
])
def test_entry_point_exits_3_when_too_little_finite_was_trained(tmp_path, capsys, steps, limit, bad, message):
    run_dir = tmp_path / "run"
    argv = ARGS + [f"--training.steps={steps}", f"--run.dir={run_dir}", f"--training.max_nonfinite_steps={limit}"]
    assert main(argv, build_objective=lambda config, *rest: _NaNOn(config, bad)) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("diverged")] == [err[-1]] and err[-1].startswith(message), err
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


# ---- the tools: plot_metrics, feedback_experiment, export_hf, checkpoint markers ----------------

@pytest.mark.parametrize("content, message", [
    ('{"step": 0, "loss": 1.0}\nstep,loss\n{"step": 1, "loss": 0.9}\n', "metrics.jsonl line 2 is not JSON"),
    ('{"step": 0, "loss": null}\n{"step": 1, "loss": null}\n', "none of its 2 records has a finite loss"),
])
def test_plot_metrics_refuses_what_it_cannot_plot(tmp_path, capsys, content, message):
    from launch.plot_metrics import main as plot

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(content)
    assert plot([str(run), "--out", str(tmp_path / "curves.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(run) in err[0], err
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("flag, message", [
    ("--lr=inf", "lr=inf a finite number > 0"), ("--temperature=-1", "temperature=-1.0 must be a finite number"),
    ("--temperature=inf", "temperature=inf must be"), ("--p-invalid=1.5", "p_invalid=1.5 must be a probability"),
    ("--json={tmp}/missing/result.json", "--json {tmp}/missing/result.json: {tmp}/missing does not exist"),
])
def test_feedback_experiment_checks_arguments_before_training(tmp_path, capsys, monkeypatch, flag, message):
    from experiments import feedback_experiment as fe

    def no_training(*args):
        raise AssertionError("training started")

    monkeypatch.setattr(fe, "run", no_training)
    argv = ["--quick", f"--work={tmp_path}/work", f"--json={tmp_path}/result.json", flag.format(tmp=tmp_path)]
    with pytest.raises(SystemExit) as info:
        fe.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {err[0][7:]}"] and message.format(tmp=tmp_path) in err[0], err


def test_export_of_a_gqa_model_is_one_line_that_hf_needs_mla(tmp_path):
    from models import Transformer, preset
    from models.hf.checkpoint import save_pretrained

    with pytest.raises(ValueError, match=r"attn='gqa' attention; the Hugging Face DeepSeek-V3 format .* attn='mla'"):
        save_pretrained(Transformer(preset("debug_gqa")), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_garbled_checkpoint_marker_is_named(tmp_path, capsys):
    from launch.export_hf import main as export
    from runtime.posttrain.objective import check_init_from

    step = tmp_path / "run" / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_bytes(b'{"step": 1, "mod\xff')
    assert export(["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{step}/COMPLETE: unreadable COMPLETE marker" in err[0], err
    with pytest.raises(ValueError, match=rf"^posttrain.init_from: {step}/COMPLETE: unreadable COMPLETE marker"):
        check_init_from(str(step), {})
