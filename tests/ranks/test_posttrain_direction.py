"""Direction: with rl_coef = 0, a few steps of the real training loop on the bundled example rollouts
make feedback_kl fall and raise the student's probability of the teacher's preferred tokens on the
target turns; how much the other assistant turns move is measured and printed.

Setup: a randomly initialized model barely reads a hint (teacher-student KL ~0.002), so the debug
model first gets 60 steps of next-token training on the example transcripts, with the hint before
half of the valid calls (the bin loader, seq_len 192 so that teacher positions are not extrapolated).
Post-training then uses the `initial` teacher (a fixed target to measure against), AdamW at lr 3e-4
without weight decay, and no expert-bias updates (they move routing whatever the loss).

Measured on this machine (seed 0): feedback_kl 0.032 -> 0.004 in 6 steps; at the 20 of 117 target
positions where the hint changes the top token, the student's probability of the teacher's top token
0.184 -> 0.249. KL(before || after) of the student: target turns 0.020, the other assistant turns
0.018 (mostly calls, the same kind of text), the final "done" turns 0.008. So the gradient is local
(tests/unit/test_posttrain_objective.py) but on this 3-layer model the effect spreads to similar turns
through shared weights; only turns of different content move clearly less.
"""

import os

import numpy as np
import torch

from launch.posttrain import build_objective
from multirank import run_ranks
from parallel.meshes import build_meshes
from runtime.config_parser import load_config
from runtime.posttrain.rollouts import read_rollouts
from runtime.schedule import build_scheduler
from runtime.train import build_loader, build_model, build_optimizer, train_step

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(REPO, "examples", "rollouts.jsonl")
N_TRAJ, STEPS, WARM = 8, 6, 60


@torch.no_grad()
def _snapshot(model, trajs) -> dict:
    """Log-probs [n, V] at the target positions (student context), at the other assistant positions, at
    the "done" turns, and the teacher's (hinted context) at the target positions."""
    model.eval()
    out = {"target": [], "other": [], "teacher": [], "done": []}  # done: final "done" turns (never targeted)
    for t in trajs:
        logp = torch.log_softmax(model(torch.as_tensor(t.tokens)[None])[0].float(), -1)
        targeted = {f.turn for f in t.feedback}
        for i, turn in enumerate(t.turns):
            if turn.role == "assistant":
                out["target" if i in targeted else "other"].append(logp[max(turn.start, 1) - 1:turn.end - 1])
                if t.tokens[turn.start] == ord("d"):
                    out["done"].append(logp[max(turn.start, 1) - 1:turn.end - 1])
        for f in t.feedback:
            turn, H = t.turns[f.turn], len(f.hint)
            teacher = torch.log_softmax(model(torch.as_tensor(t.teacher_tokens(f))[None])[0].float(), -1)
            out["teacher"].append(teacher[max(turn.start, 1) + H - 1:turn.end + H - 1])
    model.train()
    return {k: torch.cat(v) for k, v in out.items()}


def _kl(p_logp, q_logp) -> float:
    """Mean over positions of KL(p || q)."""
    return (p_logp.exp() * (p_logp - q_logp)).sum(-1).mean().item()


def _warm_start_tokens(trajs, out_path) -> None:
    """The example transcripts as a token file, each valid call preceded by the hint half of the time:
    a model warmed up on it has seen that a reminder of the available tools precedes a valid call."""
    rng = np.random.default_rng(0)
    pieces = []
    for t in trajs:
        tools = bytes(t.tokens[t.turns[0].start + len(b"tools: "):t.turns[0].end]).decode()
        hint = list(f"Reminder: available tools: {tools}".encode())
        targeted = {f.turn for f in t.feedback}
        for i, turn in enumerate(t.turns):
            if turn.role == "assistant" and i not in targeted and rng.random() < 0.5:
                pieces.append(hint)
            pieces.append(t.tokens[turn.start:turn.end].tolist())
    np.asarray([x for p in pieces for x in p], dtype=np.uint16).tofile(out_path)


def _train(rank, world_size, path, bin_path):
    device = torch.device("cpu")
    pre = load_config(["--data.source=bin", f"--data.path={bin_path}", "--data.dtype=uint16", "--data.seq_len=192",
                       "--data.batch_size=4", f"--training.steps={WARM}", "--training.warmup_steps=1",
                       "--optim.name=adamw", "--optim.lr=3e-3", "--model.bias_update_speed=0"])
    layout = pre.layout(world_size)
    meshes = build_meshes(layout, "cpu")
    model = build_model(pre, meshes, layout, device)
    optimizer, loader = build_optimizer(model, pre), build_loader(pre, meshes, layout)
    scheduler = build_scheduler(optimizer, pre.training)
    warm = [train_step(model, optimizer, scheduler, loader, pre, device)["loss"] for _ in range(WARM)]
    config = load_config(["--data.source=rollouts", f"--data.path={path}", "--posttrain.rl_coef=0",
                          f"--training.steps={STEPS}", "--training.warmup_steps=1", "--training.min_lr_ratio=1",
                          "--posttrain.teacher=initial", "--model.bias_update_speed=0", "--optim.name=adamw",
                          "--optim.lr=3e-4", "--optim.weight_decay=0"])
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config.training)
    loader = build_loader(config, meshes, layout)
    loader.plan.batch_tokens = sum(loader.plan.costs)  # every step: the whole file, once
    objective = build_objective(config, model, meshes, layout, device)
    trajs = read_rollouts(path, config.model.vocab_size, config.model.max_seq_len)
    before = _snapshot(model, trajs)
    stats = [train_step(model, optimizer, scheduler, loader, config, device, objective) for _ in range(STEPS)]
    return warm, before, _snapshot(model, trajs), stats


def test_feedback_moves_target_turns_toward_the_teacher_and_leaves_the_rest(tmp_path):
    path = tmp_path / "r.jsonl"
    with open(EXAMPLE) as f:
        path.write_text("".join(f.readlines()[:N_TRAJ]))
    trajs = read_rollouts(EXAMPLE, 256, 256)
    _warm_start_tokens(trajs, tmp_path / "warm.bin")
    (warm, before, after, stats), = run_ranks(_train, 1, str(path), str(tmp_path / "warm.bin"), timeout=300)
    assert warm[-1] < 0.5 * warm[0], warm
    kls = [s["feedback_kl"] for s in stats]
    preferred = before["teacher"].argmax(-1)  # the teacher's preferred token at each target position
    changed = preferred != before["target"].argmax(-1)  # positions where the hint changes the top token
    p_before = before["target"].gather(1, preferred[:, None]).exp()[changed].mean().item()
    p_after = after["target"].gather(1, preferred[:, None]).exp()[changed].mean().item()
    drift = {k: _kl(before[k], after[k]) for k in ("target", "other", "done")}
    print(f"feedback_kl by step {[round(k, 5) for k in kls]}; p(teacher's top token) at the {int(changed.sum())} "
          f"of {len(changed)} target positions where the hint changes it: {p_before:.4f} -> {p_after:.4f}; "
          f"KL(before || after): {drift}")
    assert stats[0]["target_tokens"] > 0 and changed.sum() > 0
    assert kls[-1] < 0.5 * kls[0], kls
    assert p_after > p_before
    assert drift["done"] < drift["target"]
