"""Post-training's student head: the whole row's logits and the losses over them in one piece, against the
chunked head (models/output_head.py, posttrain.head_chunk), side by side in this process.

    python benchmarks/output_head.py [--length 8192] [--vocab 32768] [--chunks 512,2048] [--repeats 3] [--json PATH]

One trajectory of --length tokens in 128 alternating user / assistant turns, the last 20 assistant turns
flagged (benchmarks/lib/synthetic_rollout.py), the debug model with a --vocab vocabulary, fp32 on
this CPU. For each variant, the student's forward and backward (RL, SFT and the feedback KL in `full` mode;
the teacher's data computed once beforehand): the peak of live tensors (MemTracker,
benchmarks/lib/memory_peak.py) and the median time of --repeats; the loss and the output head's gradient
against the whole-logits variant's.
"""

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.lib.memory_peak import track_peak
from benchmarks.lib.synthetic_rollout import synthetic_record
from models import Transformer, preset
from runtime.cli import user_errors
from runtime.paths import check_outputs
from runtime.posttrain import feedback
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective, feedback_kl
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import trajectory_from_record

MIB = 2**20


def whole_logits_student(model, mb, data, step, c: PosttrainConfig) -> torch.Tensor:
    """The student before chunking, the baseline: every position's logits [B, S, V], then the losses over them;
    backward run, the loss returned (tests/unit/test_output_head.py holds the chunked head to the same
    computation)."""
    logits_TV = model(mb.inputs_BS, mb.positions_S, documents=mb.documents).flatten(0, 1)
    logp_n = feedback.token_logp(logits_TV[mb.trained_flat_n], mb.labels_n)
    old_n = torch.where(mb.has_old_n, mb.old_logp_n, logp_n.detach())
    rl_sum, _ = feedback.ppo_loss(logp_n, old_n, mb.advantages_n, c.clip_eps)
    kl_sum = feedback_kl(logits_TV[mb.target_flat_m], mb.target_labels_m, data, c).sum() if data else 0.0
    n_feedback = step.target_tokens if c.feedback_norm == "targets" else step.trained_tokens
    loss = (c.sft_coef * -logp_n.sum() + c.rl_coef * rl_sum) / step.trained_tokens + c.feedback_coef * kl_sum / n_feedback
    loss.backward()
    return loss.detach()


def measure(length: int, vocab: int, chunks: list[int], repeats: int) -> dict:
    record = synthetic_record(length)
    traj = trajectory_from_record(record, vocab, 2**20)
    torch.manual_seed(0)
    model = Transformer(preset("debug", vocab_size=vocab, max_seq_len=max(length, 256)))
    model.init_weights(torch.Generator().manual_seed(0))
    data = argparse.Namespace(batch_tokens=10 * (traj.cost() + length))
    step = RolloutLoader(data, seed=0, vocab_size=vocab, max_seq_len=2**20, trajectories=[traj]).batch(0)
    (mb,) = step.micro_batches
    base = PosttrainConfig(sft_coef=0.1, rl_coef=1.0, feedback_coef=1.0, mode="full")
    teacher_data, _ = FeedbackObjective(base)._teacher(model, mb)

    variants = {"whole": lambda: whole_logits_student(model, mb, teacher_data, step, base)}
    for chunk in chunks:
        objective = FeedbackObjective(PosttrainConfig(**{**vars(base), "head_chunk": chunk}))
        variants[f"chunk_{chunk}"] = lambda o=objective: o._student(model, mb, teacher_data, step)[0]
    rows = {}
    for name, fn in variants.items():
        model.zero_grad(set_to_none=True)
        with track_peak(model) as peak:
            loss = fn()
        head_grad = model.output.weight.grad.clone()
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        rows[name] = {"loss": loss.item(), "peak_mib": round(peak()["Total"] / MIB, 1),
                      "step_s": round(statistics.median(times), 3), "head_grad": head_grad}
    whole = rows["whole"]
    for row in rows.values():
        row["loss_rel_diff"] = abs(row["loss"] - whole["loss"]) / abs(whole["loss"])
        row["head_grad_rel_diff"] = ((row.pop("head_grad") - whole["head_grad"]).abs().max()
                                     / whole["head_grad"].abs().max()).item() if row is not whole else 0.0
        row["peak_x"] = round(row["peak_mib"] / whole["peak_mib"], 3)
        row["time_x"] = round(row["step_s"] / whole["step_s"], 3)
    whole.pop("head_grad")
    return {"length": length, "vocab": vocab, "trained_tokens": step.trained_tokens,
            "target_tokens": step.target_tokens, "repeats": repeats, "threads": torch.get_num_threads(),
            "variants": rows}


@user_errors
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunks", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.length < 256 or min(chunks) < 1 or args.repeats < 1 or args.vocab < 256:
        parser.error("--length >= 256, --vocab >= 256, --chunks >= 1 and --repeats >= 1")
    check_outputs([("--json", args.json)])
    result = measure(args.length, args.vocab, chunks, args.repeats)
    print(f"{args.length:,} tokens ({result['trained_tokens']:,} trained, {result['target_tokens']:,} targets), "
          f"vocabulary {args.vocab:,}, fp32, {result['threads']} threads")
    print(f"{'variant':<12} {'peak MiB':>9} {'x':>6} {'step s':>7} {'x':>6} {'loss diff':>10} {'head grad diff':>15}")
    for name, row in result["variants"].items():
        print(f"{name:<12} {row['peak_mib']:>9.1f} {row['peak_x']:>6.3f} {row['step_s']:>7.3f} {row['time_x']:>6.3f} "
              f"{row['loss_rel_diff']:>10.1e} {row['head_grad_rel_diff']:>15.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
