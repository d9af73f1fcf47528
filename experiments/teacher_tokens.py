"""Post-training's teacher: tokens forwarded and CPU time, the prefix-shared teacher with packed rows
(runtime/posttrain/rollout_batch.py) against one teacher row per feedback item and one trajectory per row.

    python experiments/teacher_tokens.py [--episodes 64] [--time-length 16384] [--repeats 3] [--json PATH]

Counts (no model):
  long_env       --episodes scripted episodes of experiments/long_tool_env.py (19 goals, a wrong call of
                 the base policy's kinds at its rates: before a goal's call an unavailable tool with
                 probability 0.138, the last ok call repeated with 0.065), as rollout records with
                 their hints (experiments/tool_env.py rollout_record).
  synthetic_64k  65,536 tokens in 128 turns of 512 alternating user / assistant, the last 20 assistant
                 turns flagged, 16-token hints at each turn's start.
  per trajectory: per_item = sum over items of (turn end + hint) (one row tokens[:at] + hint +
  tokens[at:end] each), prefix_shared = the largest `at` + sum over items of (hint + end - at).
Timing (debug model, fp32, this CPU, medians of --repeats): the synthetic shape at --time-length
tokens (turns of length / 128): the teacher's forwards alone, and one whole objective step (teacher,
student forward and backward), before (per-item rows padded to the longest, one batch; the student
row unpacked) and after, side by side in this process. Also `padding_fraction` (the step's metric) of
a step of 8 long-environment episodes, unpacked (one trajectory and one teacher prefix per row) and packed.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.lib.synthetic_rollout import synthetic_record
from experiments.long_tool_env import new_episode, step
from experiments.tool_env import GOALS, rollout_record
from models import Transformer, preset
from runtime.cli import user_errors
from runtime.paths import check_outputs
from runtime.posttrain.objective import FeedbackObjective, PosttrainConfig, prefix_shared_teacher, teacher_data
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import Trajectory, trajectory_from_record

P_INVALID, P_REDUNDANT = 0.138, 0.065


def long_env_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    while len(records) < n:
        episode = new_episode(rng)
        right = {goal: next(t for t in episode.tools if t in GOALS[goal]) for goal in GOALS}
        for goal in episode.goals:
            if episode.done:
                break
            if rng.random() < P_INVALID:
                step(episode, f"A: call {next(t for t in GOALS[goal] if t not in episode.tools)}\n")
            elif episode.last_ok and rng.random() < P_REDUNDANT:
                step(episode, f"A: call {episode.last_ok}\n")
            if not episode.done:
                step(episode, f"A: call {right[goal]}\n")
        if not episode.done:
            step(episode, "A: done\n")
        record = rollout_record(episode, advantage=1.0)
        if record["feedback"]:
            records.append(record)
    return records


def counts(trajs: list[Trajectory]) -> dict:
    tokens = sum(len(t.tokens) for t in trajs)
    per_item = sum(t.turns[f.turn].end + len(f.hint) for t in trajs for f in t.feedback)
    shared = sum(t.teacher_cost() for t in trajs)
    return {"trajectories": len(trajs), "tokens": tokens, "items": sum(len(t.feedback) for t in trajs),
            "teacher_tokens_per_item": per_item, "teacher_tokens_prefix_shared": shared,
            "per_item_x": round(per_item / tokens, 3), "prefix_shared_x": round(shared / tokens, 3)}


class PerItemRows(FeedbackObjective):
    """The teacher as it was: one row tokens[:at] + hint + tokens[at:end] per item, padded to the longest
    (one process, one micro-batch: the targets' canonical order is the student side's)."""

    def __init__(self, config, trajs: list[Trajectory]):
        super().__init__(config)
        items = [(t, f) for t in trajs for f in t.feedback]
        L = max(t.turns[f.turn].end + len(f.hint) for t, f in items)
        self.rows_BL, flat = torch.zeros(len(items), L, dtype=torch.int64), []
        for k, (t, f) in enumerate(items):
            seq = t.teacher_tokens(f)
            self.rows_BL[k, :len(seq)] = torch.as_tensor(seq)
            turn = t.turns[f.turn]
            flat += [k * L + j + len(f.hint) - 1 for j in range(max(turn.start, 1), turn.end)]
        self.flat_m = torch.tensor(flat)

    @torch.no_grad()
    def _teacher(self, model, mb):
        model.eval()
        logits_mV = model(self.rows_BL).flatten(0, 1)[self.flat_m]
        model.train()
        return teacher_data(logits_mV, mb.target_labels_m, self.config), torch.zeros(())


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset("debug"))
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def _step(trajs: list[Trajectory], pack: bool):
    data = argparse.Namespace(batch_tokens=sum(t.cost() for t in trajs) + sum(len(t.tokens) for t in trajs) * 100)
    return RolloutLoader(data, seed=0, vocab_size=256, max_seq_len=2**20, trajectories=trajs, pack=pack).batch(0)


def timing(length: int, repeats: int) -> dict:
    trajs = [trajectory_from_record(synthetic_record(length), 256, 2**20)]
    model, config = _model(), PosttrainConfig()
    before, after = PerItemRows(config, trajs), FeedbackObjective(config)
    old_step, new_step = _step(trajs, False), _step(trajs, True)
    (mb,) = new_step.micro_batches

    def teacher_after():
        with torch.no_grad():
            model.eval()
            prefix_shared_teacher(model, mb)
            model.train()

    def run(objective, s):
        model.zero_grad()
        return objective.forward_backward(model, s, torch.device("cpu"))[2]["feedback_kl"]

    return {"feedback_kl_before": run(before, old_step), "feedback_kl_after": run(after, new_step),
            "length": len(trajs[0].tokens), **counts(trajs), "repeats": repeats, "threads": torch.get_num_threads(),
            "teacher_s_before": _median_s(lambda: before._teacher(model, mb), repeats),
            "teacher_s_after": _median_s(teacher_after, repeats),
            "step_s_before": _median_s(lambda: run(before, old_step), repeats),
            "step_s_after": _median_s(lambda: run(after, new_step), repeats)}


def padding(trajs: list[Trajectory]) -> dict:
    """The step's `padding_fraction`: before = one trajectory (and one teacher prefix) per row, after = packed."""
    model, out = _model(), {}
    for name, pack in (("before", False), ("after", True)):
        step_ = _step(trajs, pack)
        metrics = FeedbackObjective(PosttrainConfig()).forward_backward(model, step_, torch.device("cpu"))[2]
        out[f"padding_fraction_{name}"] = round(metrics["padding_fraction"], 4)
    return out


@user_errors
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--time-length", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.repeats < 1 or args.time_length < 128 * 2:
        raise ValueError(f"--episodes={args.episodes} and --repeats={args.repeats} must be >= 1, "
                         f"--time-length={args.time_length} >= 256 (128 turns of at least 2 tokens)")
    check_outputs([("--json", args.json)])
    long_trajs = [trajectory_from_record(r, 256, 2**20) for r in long_env_records(args.episodes)]
    results = {"long_env": {**counts(long_trajs), **padding(long_trajs[:8])},
               "synthetic_64k": counts([trajectory_from_record(synthetic_record(65_536), 256, 2**20)])}
    print(json.dumps(results), flush=True)
    results["timing"] = timing(args.time_length, args.repeats)
    print(json.dumps(results["timing"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
