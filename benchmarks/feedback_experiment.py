"""Does targeted feedback fix a wrong tool call faster than the trajectory reward alone? The on-policy
experiment on the tool-use environment (examples/tool_env.py), on CPU.

    python benchmarks/feedback_experiment.py [--quick] --json PATH [--plot PNG] [--work DIR]

1. Base policy: `launch/pretrain.py` trains the debug model on transcripts of the protocol in which the
   first call for a goal goes to an unavailable tool with probability `p_invalid` (the behaviour to fix)
   and a reminder line, when present, is always followed by a valid call (so the hint-conditioned
   teacher knows better than the student). Cached in --work, keyed by its settings.
2. Three arms, each from the base weights, with the same seeds, tasks, sampling streams, number of
   episodes per step and number of steps. Every step: the current policy plays `episodes` fresh
   episodes (tasks and sampling streams drawn from (seed, step)), they are scored (reward = task
   success, advantage = reward minus the batch mean), turned into rollout records with their behaviour
   log-probs, and one optimizer step of launch/posttrain.py's objective (runtime/posttrain.py; the
   teacher is the base policy with the hint, `--teacher live` uses the current weights) is taken on them:
     reward_only    rl_coef 1, feedback_coef 0   L_rl with the trajectory advantage
     feedback       rl_coef 1, feedback_coef 1   L_rl + L_feedback on the flagged turns
     feedback_only  rl_coef 0, feedback_coef 1   L_feedback
   Flagged turns: every assistant turn that called an unavailable tool gets the hint
   "R: Reminder: available tools: ..." before it in the teacher's context.
3. Every `eval_every` steps (and before the first), the policy that generates the next batch plays
   `eval_episodes` fresh evaluation episodes (the same tasks and streams for every arm at a given step)
   and we record: invalid_call_rate (calls to unavailable tools per assistant turn), success_rate, and
   kl_untargeted: the mean per-token KL(current || starting policy) over the generated assistant tokens
   (not the "A: " header) of turns that called no unavailable tool (the turns no feedback ever targets).

The JSON: {"arms": {arm: {"steps", "invalid_call_rate", "success_rate", "kl_untargeted"}}, "seeds",
"config"}: per arm, the mean over seeds at each measured step, with the per-seed values under
"per_seed" and the spread (min, max over seeds) under "spread".
"""

import argparse
import dataclasses
import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.tool_env import HEADER, new_episode, play, rollout_record, transcript  # noqa: E402
from launch import posttrain, pretrain  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.generate import SamplingConfig  # noqa: E402
from runtime.rollout_batch import RolloutLoader  # noqa: E402
from runtime.rollouts import trajectory_from_record  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402
from runtime.schedule import build_scheduler  # noqa: E402
from runtime.train import build_model, build_optimizer, train_step  # noqa: E402

ARMS = {"reward_only": (1.0, 0.0), "feedback": (1.0, 1.0), "feedback_only": (0.0, 1.0)}  # rl_coef, feedback_coef
_TASK_STREAM, _EVAL_STREAM = 0x7A5C, 0xE7A1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    transcripts: int = 20000  # pretraining transcripts of the protocol
    p_invalid: float = 0.3  # in them: the first call for a goal goes to an unavailable tool
    p_reminder: float = 0.2  # in them: a reminder line precedes a call (always a valid one)
    pretrain_steps: int = 1200  # launch/pretrain.py steps of the base policy (16 x 320 tokens each)
    seeds: int = 3
    steps: int = 24  # optimizer steps per arm and seed
    episodes: int = 32  # fresh on-policy episodes per step
    eval_every: int = 4
    eval_episodes: int = 64
    optimizer: str = "muon"  # optim.name of the post-training steps: "muon" or "adamw"
    lr: float = 0.002  # constant (Muon's, and AdamW's for the rest under muon)
    teacher: str = "initial"  # posttrain.teacher: "initial" (the base's weights with the hint) or "live" (current)
    feedback_norm: str = "targets"  # posttrain.feedback_norm: L_feedback / target tokens, or / assistant tokens
    temperature: float = 1.0
    arms: tuple[str, ...] = tuple(ARMS)

    def __post_init__(self):
        choices = {"optimizer": ("muon", "adamw"), "teacher": ("live", "initial", "ema"),
                   "feedback_norm": ("targets", "assistant")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: expected one of {list(allowed)}")
        counts = ("transcripts", "pretrain_steps", "seeds", "episodes", "eval_every", "eval_episodes")
        for key in counts:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.steps < 0 or not self.lr > 0:
            raise ValueError(f"steps={self.steps} must be >= 0 and lr={self.lr} > 0")


QUICK = dict(seeds=2, steps=8, episodes=24, eval_every=4, eval_episodes=48)  # the same base policy (shared cache)
MINIATURE = dict(transcripts=300, pretrain_steps=4, seeds=1, steps=1, episodes=2, eval_every=1, eval_episodes=2)
MODEL = ["--model.preset=debug", "--model.max_seq_len=512"]  # an episode plus its hint fits in 512 positions


# ---- the base policy ----------------------------------------------------------------------------

def pretrain_base(cfg: ExperimentConfig, work: str) -> str:
    """The base policy's checkpoint dir (trained once per setting, then reused)."""
    key = hashlib.sha1(json.dumps([cfg.transcripts, cfg.p_invalid, cfg.p_reminder, cfg.pretrain_steps, MODEL])
                       .encode()).hexdigest()[:10]
    run = os.path.join(work, f"base_{key}")
    ckpt = os.path.join(run, "checkpoints", f"step_{cfg.pretrain_steps}")
    if os.path.isdir(ckpt):
        return ckpt
    os.makedirs(run, exist_ok=True)
    rng = random.Random(0)
    text = "".join(transcript(rng, cfg.p_invalid, cfg.p_reminder) for _ in range(cfg.transcripts))
    path = os.path.join(run, "transcripts.bin")
    np.frombuffer(text.encode("latin-1"), dtype=np.uint8).astype(np.uint16).tofile(path)
    with open(path + ".json", "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": 256, "num_tokens": len(text)}, f)
    rc = pretrain.main([f"--run.dir={run}", "--data.source=bin", f"--data.path={path}", *MODEL,
                        f"--training.steps={cfg.pretrain_steps}", "--data.seq_len=320", "--data.batch_size=16",
                        "--training.warmup_steps=50", "--eval.interval=0",
                        f"--checkpoint.interval={cfg.pretrain_steps}",
                        "--training.log_interval=200"])
    if rc != 0:
        raise SystemExit(f"pretraining the base policy failed with exit status {rc}")
    return ckpt


# ---- one arm ------------------------------------------------------------------------------------

def _episodes(n: int, stream: int, seed: int, step: int):
    rng = random.Random(hash((stream, seed, step)))
    return [new_episode(rng) for _ in range(n)]


def _sampling(cfg: ExperimentConfig) -> SamplingConfig:
    return SamplingConfig(temperature=cfg.temperature, max_new_tokens=16)


@torch.no_grad()
def _log_probs(model, episode) -> torch.Tensor:
    tokens = torch.tensor(list(episode.text().encode("latin-1")))
    model.eval()
    out = torch.log_softmax(model(tokens[None], torch.arange(len(tokens)))[0].float(), -1)
    model.train()
    return out


def kl_untargeted(model, start, episodes) -> float:
    """Mean per-token KL(model || start) over the generated tokens (after the "A: " header the
    environment writes) of assistant turns that called no unavailable tool."""
    total, count = 0.0, 0
    for episode in episodes:
        logp, logq = _log_probs(model, episode), _log_probs(start, episode)
        offset = 0
        for i, (role, line) in enumerate(episode.turns):
            if role == "assistant" and i not in episode.invalid_turns:
                rows = slice(offset + len(HEADER) - 1, offset + len(line) - 1)  # token j is predicted at j - 1
                total += float((logp[rows].exp() * (logp[rows] - logq[rows])).sum())
                count += rows.stop - rows.start
            offset += len(line)
    return total / max(count, 1)


def invalid_call_rate(episodes) -> float:
    return sum(len(e.invalid_turns) for e in episodes) / sum(e.assistant_turns() for e in episodes)


def measure(model, start, cfg: ExperimentConfig, seed: int, step: int) -> dict:
    episodes = _episodes(cfg.eval_episodes, _EVAL_STREAM, seed, step)
    play(model, episodes, _sampling(cfg), seed=hash((_EVAL_STREAM, seed, step)) & 0xFFFF)
    return {"invalid_call_rate": invalid_call_rate(episodes),
            "success_rate": sum(e.success for e in episodes) / len(episodes),
            "kl_untargeted": kl_untargeted(model, start, episodes)}


def arm_config(arm: str, seed: int, base: str, cfg: ExperimentConfig, work: str):
    """The job config of one arm: launch/posttrain.py's, with the base weights, a constant lr, no weight decay."""
    rl_coef, feedback_coef = ARMS[arm]
    return load_config([*MODEL, "--data.source=rollouts", f"--data.path={work}/on_policy",
                        f"--training.seed={seed}", f"--training.steps={max(cfg.steps, 1)}", "--training.warmup_steps=0",
                        "--training.min_lr_ratio=1.0", f"--optim.name={cfg.optimizer}", f"--optim.lr={cfg.lr}",
                        "--optim.weight_decay=0", f"--posttrain.rl_coef={rl_coef}",
                        f"--posttrain.feedback_coef={feedback_coef}", f"--posttrain.init_from={base}",
                        f"--posttrain.teacher={cfg.teacher}", f"--posttrain.feedback_norm={cfg.feedback_norm}",
                        f"--run.dir={work}/arm_{arm}_{seed}"])


class Learner:
    """The policy of one arm in this process (a one-rank process group: the same FSDP / EP / optimizer
    code path as launch/posttrain.py), a frozen copy of its starting weights, and its optimizer."""

    def __init__(self, config):
        self.config, self.device = config, torch.device("cpu")
        layout = config.layout(1)
        meshes = build_meshes(layout, "cpu")
        torch.manual_seed(config.training.seed)
        self.model = build_model(config, meshes, layout, self.device)
        self.objective = posttrain.build_objective(config, self.model, meshes, layout, self.device)  # loads the base
        if config.posttrain.teacher == "initial":  # the objective already holds a frozen copy of the start
            self.start = self.objective.teacher
        else:
            self.start = build_model(config, meshes, layout, self.device)
            posttrain.copy_weights(self.model, self.start)
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config.training)

    def step(self, episodes, logprobs) -> dict:
        """One optimizer step of the objective on these played episodes (reward = success, advantage =
        reward minus the batch mean; the hint on flagged turns when the arm uses feedback)."""
        rewards = [float(e.success) for e in episodes]
        baseline = sum(rewards) / len(rewards)
        with_feedback = self.config.posttrain.feedback_coef > 0
        vocab, max_len = self.config.model.vocab_size, self.config.model.max_seq_len
        trajs = [trajectory_from_record(rollout_record(e, lp, r - baseline, with_feedback), vocab, max_len)
                 for e, lp, r in zip(episodes, logprobs, rewards)]
        data = dataclasses.replace(self.config.data, batch_tokens=sum(t.cost() for t in trajs))  # all, once
        loader = RolloutLoader(data, self.config.training.seed, vocab_size=vocab, max_seq_len=max_len,
                               trajectories=trajs)
        return train_step(self.model, self.optimizer, self.scheduler, loader, self.config, self.device, self.objective)


def run_arm(arm: str, seed: int, base: str, cfg: ExperimentConfig, work: str) -> dict:
    """One arm, one seed: the measured curves."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        learner = Learner(arm_config(arm, seed, base, cfg, work))
        curves = {"steps": [], "invalid_call_rate": [], "success_rate": [], "kl_untargeted": [],
                  "train_invalid_call_rate": [], "train_success_rate": [], "feedback_kl": [], "rl_loss": [],
                  "target_tokens": []}
        for step in range(cfg.steps + 1):
            if step % cfg.eval_every == 0 or step == cfg.steps:
                curves["steps"].append(step)
                for key, value in measure(learner.model, learner.start, cfg, seed, step).items():
                    curves[key].append(value)
            if step == cfg.steps:
                break
            episodes = _episodes(cfg.episodes, _TASK_STREAM, seed, step)
            logprobs = play(learner.model, episodes, _sampling(cfg), seed=hash((_TASK_STREAM, seed, step)) & 0xFFFF)
            stats = learner.step(episodes, logprobs)
            curves["train_invalid_call_rate"].append(invalid_call_rate(episodes))
            curves["train_success_rate"].append(sum(e.success for e in episodes) / len(episodes))
            curves["feedback_kl"].append(stats["feedback_kl"])
            curves["rl_loss"].append(stats["rl_loss"])
            curves["target_tokens"].append(stats["target_tokens"])
        return curves
    finally:
        dist.destroy_process_group()


# ---- all arms, the summary, the plot -------------------------------------------------------------

def run(cfg: ExperimentConfig, work: str, say=print) -> dict:
    t0 = time.perf_counter()
    base = pretrain_base(cfg, work)
    say(f"base policy: {base} ({time.perf_counter() - t0:.0f} s)")
    arms = {}
    for arm in cfg.arms:
        runs = []
        for seed in range(cfg.seeds):
            t1 = time.perf_counter()
            runs.append(run_arm(arm, seed, base, cfg, work))
            r = runs[-1]
            say(f"{arm} seed {seed}: invalid/turn {r['invalid_call_rate'][0]:.3f} -> {r['invalid_call_rate'][-1]:.3f}, "
                f"success {r['success_rate'][0]:.2f} -> {r['success_rate'][-1]:.2f}, "
                f"kl_untargeted {r['kl_untargeted'][-1]:.4f} ({time.perf_counter() - t1:.0f} s)")
        arms[arm] = summarize(runs)
    return {"arms": arms, "seeds": cfg.seeds, "config": dataclasses.asdict(cfg),
            "seconds": round(time.perf_counter() - t0, 1)}


def summarize(runs: list[dict]) -> dict:
    """Mean over seeds per measured step; per-seed curves and (min, max) spread kept."""
    out = {"steps": runs[0]["steps"], "per_seed": runs, "spread": {}}
    for key in runs[0]:
        if key == "steps":
            continue
        values = np.array([r[key] for r in runs])
        out[key] = values.mean(0).tolist()
        out["spread"][key] = [values.min(0).tolist(), values.max(0).tolist()]
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ("invalid_call_rate", "success_rate", "kl_untargeted")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key in zip(axes, keys):
        for arm, curves in result["arms"].items():
            lo, hi = curves["spread"][key]
            ax.plot(curves["steps"], curves[key], marker="o", label=arm)
            ax.fill_between(curves["steps"], lo, hi, alpha=0.15)
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"on-policy tool use, {result['seeds']} seeds (mean, min-max band)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@user_errors
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer transcripts, pretraining steps, seeds and steps")
    parser.add_argument("--json", required=True, help="write the result here")
    parser.add_argument("--plot", help="write the three curves to this PNG (needs matplotlib)")
    parser.add_argument("--work", default="runs/feedback_experiment", help="base policy and run dirs")
    parser.add_argument("--arms", help=f"comma-separated subset of {','.join(ARMS)} (default: all)")
    for f in dataclasses.fields(ExperimentConfig):
        if f.name != "arms":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), help=f"(default {f.default})")
    args = parser.parse_args(argv)
    values = {**(QUICK if args.quick else {}),
              **{f.name: getattr(args, f.name) for f in dataclasses.fields(ExperimentConfig)
                 if f.name != "arms" and getattr(args, f.name, None) is not None}}
    if args.arms:
        unknown = set(args.arms.split(",")) - set(ARMS)
        if unknown:
            parser.error(f"--arms: unknown {sorted(unknown)}; choose from {list(ARMS)}")
        values["arms"] = tuple(args.arms.split(","))
    try:
        cfg = ExperimentConfig(**values)
    except ValueError as e:
        parser.error(str(e))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install -e '.[plot]')")
    check_outputs([("--json", args.json), ("--plot", args.plot)])
    result = run(cfg, args.work)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    return 0


def table(result: dict) -> str:
    """Markdown: per arm, first and last measured values (mean over seeds, [min, max])."""
    rows = ["| arm | invalid calls / turn | success rate | KL to start, untargeted turns |", "|---|---|---|---|"]
    for arm, c in result["arms"].items():
        cells = []
        for key in ("invalid_call_rate", "success_rate", "kl_untargeted"):
            lo, hi = c["spread"][key]
            cells.append(f"{c[key][0]:.3f} -> **{c[key][-1]:.3f}** [{lo[-1]:.3f}, {hi[-1]:.3f}]")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
