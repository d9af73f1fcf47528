"""End to end: generated chat conversations -> launch/prepare_rollouts.py (the ChatML test tokenizer,
hints as system messages, grpo advantages) -> launch/posttrain.py with SFT, RL and the feedback KL
against the `initial` teacher, on 1 process and on 8 ranks (dp_shard=4 x cp=2 | ep=8): equal losses step
by step, and feedback_kl falling on the flagged turns.

Why the initial teacher and the contrast run: the randomly initialized debug model barely reads a hint
(feedback_kl 0.0004 at step 0), so the first update (SFT and RL move the student) is what opens a gap
to the teacher; from step 1 on the feedback term closes it while SFT keeps training. Without the
feedback term (feedback_coef = 0) the gap keeps growing. Measured (6 conversations, lr 1e-3, seed 0): with
the feedback term 0.249 -> 0.146 -> 0.087 (steps 1-3), without 0.247 -> 0.515 -> 0.590. 1 process vs 8
ranks: <= 2.9e-7 relative on loss, sft_loss and rl_loss, feedback_kl <= 1.2e-8 absolute."""

import json

import pytest

from chat_tokenizers import CHATML, conversations, make_tokenizer_dir
from entry_point import run_ok
from launch.posttrain import main as posttrain
from launch.prepare_rollouts import main as prepare
from runtime.posttrain.rollouts import read_rollouts

VOCAB, MAX_LEN, STEPS = 448, 512, 4
ARGS = ["--data.source=rollouts", f"--training.steps={STEPS}", "--training.warmup_steps=1", "--checkpoint.interval=0",
        "--optim.name=adamw", "--optim.lr=1e-3", "--optim.adam_eps=1e-3", "--optim.weight_decay=0",
        f"--model.vocab_size={VOCAB}", f"--model.max_seq_len={MAX_LEN}", "--posttrain.sft_coef=0.5",
        "--posttrain.feedback_coef=4", "--posttrain.teacher=initial"]
HEADLINE = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"]
LOSSES = ("loss", "sft_loss", "rl_loss", "feedback_kl", "clip_fraction", "teacher_entropy")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(rollout file, its budget: every trajectory once per step)."""
    root = tmp_path_factory.mktemp("transcripts")
    tokenizer = make_tokenizer_dir(str(root / "tokenizer"), CHATML, vocab_size=VOCAB)
    chats = conversations(6, seed=5)
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = str(root / "rollouts.jsonl")
    assert prepare(["--tokenizer", tokenizer, "--in", str(root / "chats.jsonl"), "--out", out,
                    "--max-len", str(MAX_LEN)]) == 0
    trajs = read_rollouts(out, VOCAB, MAX_LEN)
    assert sum(len(t.feedback) for t in trajs) >= 3
    return out, sum(t.cost() for t in trajs)


def test_prepared_transcripts_train_alike_on_1_and_8_ranks(tmp_path, prepared):
    """fp32; the layouts differ only in reduction order. Tolerances as tests/entry/test_posttrain_layouts.py
    (1e-5 relative; feedback_kl also 5e-7 absolute: one fp32 ulp of log-probs near log 448)."""
    path, budget = prepared
    common = [*ARGS, f"--data.path={path}", f"--data.batch_tokens={budget}"]
    single = run_ok(tmp_path / "single", 1, common, entry=posttrain)
    multi = run_ok(tmp_path / "multi", 8, [*common, *HEADLINE], entry=posttrain)
    assert [r["step"] for r in single] == [r["step"] for r in multi] == list(range(STEPS))
    for a, b in zip(single, multi):
        assert a["target_tokens"] == b["target_tokens"] > 0
        for key in LOSSES:
            atol = 5e-7 if key == "feedback_kl" else 1e-8
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=atol), (key, a, b)
    kl = [r["feedback_kl"] for r in single]
    assert all(b < a for a, b in zip(kl[1:], kl[2:])) and kl[-1] < 0.5 * kl[1], kl
    assert single[-1]["sft_loss"] < single[0]["sft_loss"] - 0.5
    without = run_ok(tmp_path / "no_feedback", 1, [*common, "--posttrain.feedback_coef=0"], entry=posttrain)
    kl_without = [r["feedback_kl"] for r in without]
    assert kl_without[-1] > kl_without[1] and kl[-1] < 0.25 * kl_without[-1], (kl, kl_without)
