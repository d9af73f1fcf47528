"""Does targeted feedback fix a wrong tool call faster than the trajectory reward alone? The on-policy
experiment on the tool-use environment (experiments/tool_env.py), on CPU.

    python experiments/feedback_experiment.py [--quick] --json PATH [--plot PNG] [--work DIR]
    python experiments/feedback_experiment.py --env long [--teacher initial|ema|live] [--mode full|topk] ...
    python experiments/feedback_experiment.py --merge A.json,B.json,... --json PATH   (runs split by --first-seed)

`--env long` (docs/feedback_long.md) runs the long-horizon environment (experiments/long_tool_env.py: 20-30
assistant turns, a wrong call costs a turn of a generous budget) with its own defaults (LONG), a second
flagged behaviour (the redundant call, `redundant_call_rate` in the JSON) and, before training, the
pre-check: the initial teacher-student gap on the flagged turns per behaviour (`precheck` in the JSON).

1. Base policy: `launch/pretrain.py` trains the debug model on transcripts of the protocol in which the
   first call for a goal goes to an unavailable tool with probability `p_invalid` (the behaviour to fix)
   and a reminder line, when present, is always followed by a valid call (so the hint-conditioned
   teacher knows better than the student). Cached in --work, keyed by its settings.
2. Three arms, each from the base weights, with the same seeds, tasks, sampling streams, number of
   episodes per step and number of steps. Every step: the current policy plays `episodes` fresh
   episodes (tasks and sampling streams drawn from (seed, step)), they are scored (reward = task
   success, advantage = reward minus the batch mean), turned into rollout records with their behaviour
   log-probs, and one optimizer step of launch/posttrain.py's objective (runtime/posttrain/objective.py; the
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
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from experiments import long_tool_env, tool_env  # noqa: E402
from experiments.tool_env import HEADER, rollout_record  # noqa: E402
from launch import posttrain, pretrain  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402
from runtime.generate import SamplingConfig  # noqa: E402
from runtime.posttrain.rollout_batch import RolloutLoader  # noqa: E402
from runtime.posttrain.rollouts import trajectory_from_record  # noqa: E402
from runtime.paths import check_output_dir, check_outputs  # noqa: E402
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
    first_seed: int = 0  # seeds first_seed .. first_seed + seeds - 1 (split a run over processes, then --merge)
    steps: int = 24  # optimizer steps per arm and seed
    episodes: int = 32  # fresh on-policy episodes per step
    eval_every: int = 4
    eval_episodes: int = 64
    optimizer: str = "muon"  # optim.name of the post-training steps: "muon" or "adamw"
    lr: float = 0.002  # constant (Muon's, and AdamW's for the rest under muon)
    teacher: str = "initial"  # posttrain.teacher: "initial" (the base's weights with the hint), "live" (current), "ema"
    ema_decay: float = 0.9  # posttrain.ema_decay (teacher "ema" only): teacher += (1 - decay) (student - teacher) per step
    mode: str = "full"  # posttrain.mode of L_feedback: "full" (exact KL) or "topk" (teacher top-k + tail bucket)
    top_k: int = 32  # posttrain.top_k (mode "topk" only)
    feedback_norm: str = "targets"  # posttrain.feedback_norm: L_feedback / target tokens, or / assistant tokens
    temperature: float = 1.0
    line_tokens: int = 0  # most tokens generated per assistant line; 0: the environment's (short 16, long 12)
    env: str = "short"  # "short": experiments/tool_env.py (<= 5 turns); "long": experiments/long_tool_env.py (20-30)
    p_redundant: float = 0.1  # long env's transcripts: after an ok, the same call is repeated (2nd behaviour)
    arms: tuple[str, ...] = tuple(ARMS)

    def __post_init__(self):
        choices = {"optimizer": ("muon", "adamw"), "teacher": ("live", "initial", "ema"),
                   "feedback_norm": ("targets", "assistant"), "env": tuple(ENVS), "mode": ("full", "topk")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: expected one of {list(allowed)}")
        counts = ("transcripts", "pretrain_steps", "seeds", "episodes", "eval_every", "eval_episodes")
        if self.first_seed < 0 or not 0 <= self.line_tokens <= 12 + 4 * (self.env == "short"):
            raise ValueError(f"first_seed={self.first_seed} must be >= 0 and line_tokens={self.line_tokens} in "
                             f"[0, {12 + 4 * (self.env == 'short')}] (0: the environment's)")
        for key in counts:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.steps < 0 or not 0 < self.lr < math.inf:
            raise ValueError(f"steps={self.steps} must be >= 0 and lr={self.lr} a finite number > 0")
        for key in ("p_invalid", "p_reminder"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key}={getattr(self, key)} must be a probability in [0, 1]")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)")
        if not 0 <= self.ema_decay < 1 or self.top_k < 1:
            raise ValueError(f"ema_decay={self.ema_decay} must be in [0, 1) and top_k={self.top_k} >= 1")


QUICK = dict(seeds=2, steps=8, episodes=24, eval_every=4, eval_episodes=48)  # the same base policy (shared cache)
MINIATURE = dict(transcripts=300, pretrain_steps=4, seeds=1, steps=1, episodes=2, eval_every=1, eval_episodes=2)
MODEL = ["--model.preset=debug", "--model.max_seq_len=512"]  # an episode plus its hint fits in 512 positions


@dataclasses.dataclass(frozen=True)
class Env:
    """An environment module (new_episode, play, transcript) and what its base policy is trained on."""

    module: object
    model: list[str]  # model flags: max_seq_len holds the longest episode plus a hint
    seq_len: int  # pretraining window (short: holds a whole transcript; long: the list is restated every 4 turns)
    batch_size: int  # pretraining windows per step


ENVS = {"short": Env(tool_env, MODEL, 320, 16),
        "long": Env(long_tool_env, ["--model.preset=debug", "--model.max_seq_len=1536"], 1280, 8)}
# the long environment's own defaults (transcripts are ~6x longer; mistakes rarer, as the budget allows)
# (sized for a 2-core machine shared by other jobs: a 25-turn episode costs ~25 batched generate calls)
LONG = dict(transcripts=4000, p_invalid=0.2, p_reminder=0.1, pretrain_steps=400, steps=8, episodes=8,
            eval_every=4, eval_episodes=16)
LONG_QUICK = dict(seeds=2, steps=2, episodes=4, eval_every=2, eval_episodes=8)  # 144 episodes: ~3 min of one core (base cached)


# ---- the base policy ----------------------------------------------------------------------------

def pretrain_base(cfg: ExperimentConfig, work: str) -> str:
    """The base policy's checkpoint dir (trained once per setting, then reused)."""
    env = ENVS[cfg.env]
    settings = [cfg.transcripts, cfg.p_invalid, cfg.p_reminder, cfg.pretrain_steps, env.model]
    if cfg.env != "short":  # (the short environment's key predates the others)
        settings += [cfg.env, cfg.p_redundant, env.seq_len, env.batch_size]
    key = hashlib.sha1(json.dumps(settings).encode()).hexdigest()[:10]
    run = os.path.join(work, f"base_{key}")
    ckpt = os.path.join(run, "checkpoints", f"step_{cfg.pretrain_steps}")
    if os.path.isdir(ckpt):
        return ckpt
    os.makedirs(run, exist_ok=True)
    rng = random.Random(0)
    text = "".join(_transcript(cfg, rng) for _ in range(cfg.transcripts))
    path = os.path.join(run, "transcripts.bin")
    np.frombuffer(text.encode("latin-1"), dtype=np.uint8).astype(np.uint16).tofile(path)
    with open(path + ".json", "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": 256, "num_tokens": len(text)}, f)
    rc = pretrain.main([f"--run.dir={run}", "--data.source=bin", f"--data.path={path}", *env.model,
                        f"--training.steps={cfg.pretrain_steps}", f"--data.seq_len={env.seq_len}",
                        f"--data.batch_size={env.batch_size}",
                        "--training.warmup_steps=50", "--eval.interval=0",
                        f"--checkpoint.interval={cfg.pretrain_steps}",
                        f"--training.log_interval={max(cfg.pretrain_steps // 6, 1)}"])
    if rc != 0:
        raise SystemExit(f"pretraining the base policy failed with exit status {rc}")
    return ckpt


def _transcript(cfg: ExperimentConfig, rng: random.Random) -> str:
    if cfg.env == "short":
        return tool_env.transcript(rng, cfg.p_invalid, cfg.p_reminder)
    return long_tool_env.transcript(rng, cfg.p_invalid, cfg.p_reminder, cfg.p_redundant)


# ---- one arm ------------------------------------------------------------------------------------

def _episodes(cfg: ExperimentConfig, n: int, stream: int, seed: int, step: int):
    rng = random.Random(hash((stream, seed, step)))
    return [ENVS[cfg.env].module.new_episode(rng) for _ in range(n)]


def _sampling(cfg: ExperimentConfig) -> SamplingConfig:
    """A call line is 11 tokens; the long environment's bound keeps its longest episode plus a hint in
    max_seq_len (30 turns of at most 3 + 12 + 19 tokens and 7 restated tool lines of 34, after 139; 54
    for the hint: 1,451 <= 1,536)."""
    limit = cfg.line_tokens or (16 if cfg.env == "short" else 12)
    return SamplingConfig(temperature=cfg.temperature, max_new_tokens=limit)


def _play(cfg: ExperimentConfig, model, episodes, stream: int, seed: int, step: int):
    return ENVS[cfg.env].module.play(model, episodes, _sampling(cfg), seed=hash((stream, seed, step)) & 0xFFFF)


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
            if role == "assistant" and i not in episode.targeted_turns():
                rows = slice(offset + len(HEADER) - 1, offset + len(line) - 1)  # token j is predicted at j - 1
                total += float((logp[rows].exp() * (logp[rows] - logq[rows])).sum())
                count += rows.stop - rows.start
            offset += len(line)
    return total / max(count, 1)


def _behaviour(episode, turn: int) -> str:
    return "redundant" if turn in getattr(episode, "redundant_turns", ()) else "invalid"


@torch.no_grad()
def precheck(base, episodes) -> dict:
    """The initial teacher-student gap on the flagged turns, per behaviour, before any training: the
    student is `base` on the episode, the teacher `base` with the turn's hint before its header. Per
    behaviour: flagged turns, the mean per-token KL(student || teacher) over the turn's generated tokens,
    and the mean log-probability of the called tool's name (its bytes after "call ") under each, with
    their difference (negative: the hint makes the flagged call less likely, what the feedback teaches)."""
    sums: dict[str, list[float]] = {}
    for episode in episodes:
        student = _log_probs(base, episode)
        offsets = np.cumsum([0] + [len(line) for _, line in episode.turns])
        for turn, hint in episode.feedback_hints():
            at, end = int(offsets[turn]), int(offsets[turn + 1])
            text = episode.text()
            tokens = torch.tensor(list((text[:at] + hint + text[at:end]).encode("latin-1")))
            base.eval()
            teacher = torch.log_softmax(base(tokens[None], torch.arange(len(tokens)))[0].float(), -1)
            base.train()
            shift = len(hint)
            rows = torch.arange(at + len(HEADER), end) - 1  # the turn's generated tokens, predicted at j - 1
            logp_s, logp_t = student[rows], teacher[rows + shift]
            kl = float((logp_s.exp() * (logp_s - logp_t)).sum())
            name = rows[len("call "):-1]  # the tool name's bytes (the line ends with "\n")
            ids = torch.tensor(list(text[at:end].encode("latin-1")))[len(HEADER) + len("call "):-1]
            name_s = float(student[name].gather(1, ids[:, None]).sum())
            name_t = float(teacher[name + shift].gather(1, ids[:, None]).sum())
            acc = sums.setdefault(_behaviour(episode, turn), [0, 0.0, 0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += kl
            acc[2] += len(rows)
            acc[3] += name_s
            acc[4] += name_t
    return {b: {"turns": n, "kl_per_token": kl / max(tokens, 1), "name_logprob_student": s / n,
                "name_logprob_teacher": t / n, "name_logprob_change": (t - s) / n}
            for b, (n, kl, tokens, s, t) in sorted(sums.items())}


def invalid_call_rate(episodes) -> float:
    return sum(len(e.invalid_turns) for e in episodes) / sum(e.assistant_turns() for e in episodes)


def redundant_call_rate(episodes) -> float:
    """Long environment: calls repeating the call that last answered ok, per assistant turn."""
    return sum(len(e.redundant_turns) for e in episodes) / sum(e.assistant_turns() for e in episodes)


def rates(cfg: ExperimentConfig, episodes) -> dict:
    out = {"invalid_call_rate": invalid_call_rate(episodes),
           "success_rate": sum(e.success for e in episodes) / len(episodes)}
    if cfg.env == "long":
        out["redundant_call_rate"] = redundant_call_rate(episodes)
        out["assistant_turns"] = sum(e.assistant_turns() for e in episodes) / len(episodes)
    return out


def measure(model, start, cfg: ExperimentConfig, seed: int, step: int) -> dict:
    episodes = _episodes(cfg, cfg.eval_episodes, _EVAL_STREAM, seed, step)
    _play(cfg, model, episodes, _EVAL_STREAM, seed, step)
    return {**rates(cfg, episodes), "kl_untargeted": kl_untargeted(model, start, episodes)}


def arm_config(arm: str, seed: int, base: str, cfg: ExperimentConfig, work: str):
    """The job config of one arm: launch/posttrain.py's, with the base weights, a constant lr, no weight decay."""
    rl_coef, feedback_coef = ARMS[arm]
    extra = {"ema": [f"--posttrain.ema_decay={cfg.ema_decay}"]}.get(cfg.teacher, [])
    extra += [f"--posttrain.mode={cfg.mode}"] + ([f"--posttrain.top_k={cfg.top_k}"] if cfg.mode == "topk" else [])
    return load_config([*ENVS[cfg.env].model, *extra, "--data.source=rollouts", f"--data.path={work}/on_policy",
                        f"--training.seed={seed}", f"--training.steps={max(cfg.steps, 1)}", "--training.warmup_steps=0",
                        "--training.min_lr_ratio=1.0", f"--optim.name={cfg.optimizer}", f"--optim.lr={cfg.lr}",
                        "--optim.weight_decay=0", f"--posttrain.rl_coef={rl_coef}",
                        f"--posttrain.feedback_coef={feedback_coef}", f"--posttrain.init_from={base}",
                        f"--posttrain.teacher={cfg.teacher}", f"--posttrain.feedback_norm={cfg.feedback_norm}",
                        f"--run.dir={work}/arm_{cfg.env}_{cfg.teacher}_{cfg.mode}_{arm}_{seed}"])


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


def run_arm(arm: str, seed: int, base: str, cfg: ExperimentConfig, work: str,
            precheck_into: dict | None = None, say=lambda _: None) -> dict:
    """One arm, one seed: the measured curves (and, into `precheck_into`, the pre-check on the step-0
    batch, which every arm plays alike)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        learner = Learner(arm_config(arm, seed, base, cfg, work))
        curves = {"steps": [], "feedback_kl": [], "rl_loss": [], "target_tokens": []}
        for step in range(cfg.steps + 1):
            if step % cfg.eval_every == 0 or step == cfg.steps:
                curves["steps"].append(step)
                for key, value in measure(learner.model, learner.start, cfg, seed, step).items():
                    curves.setdefault(key, []).append(value)
                say(f"  {arm} seed {seed} step {step}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in curves.items()
                                                                    if k != "steps" and len(v) == len(curves["steps"])))
            if step == cfg.steps:
                break
            episodes = _episodes(cfg, cfg.episodes, _TASK_STREAM, seed, step)
            logprobs = _play(cfg, learner.model, episodes, _TASK_STREAM, seed, step)
            if step == 0 and precheck_into is not None:
                precheck_into.update(precheck(learner.start, episodes))
            stats = learner.step(episodes, logprobs)
            for key, value in rates(cfg, episodes).items():
                curves.setdefault(f"train_{key}", []).append(value)
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
    arms, prechecks = {}, [{} for _ in range(cfg.seeds)]
    for arm in cfg.arms:
        runs = []
        for k, seed in enumerate(range(cfg.first_seed, cfg.first_seed + cfg.seeds)):
            t1 = time.perf_counter()
            runs.append(run_arm(arm, seed, base, cfg, work, prechecks[k] if arm == cfg.arms[0] else None, say))
            r = runs[-1]
            r["seconds"] = [round(time.perf_counter() - t1, 1)]
            second = (f"redundant/turn {r['redundant_call_rate'][0]:.3f} -> {r['redundant_call_rate'][-1]:.3f}, "
                      if "redundant_call_rate" in r else "")
            say(f"{arm} seed {seed}: invalid/turn {r['invalid_call_rate'][0]:.3f} -> {r['invalid_call_rate'][-1]:.3f}, "
                f"{second}success {r['success_rate'][0]:.2f} -> {r['success_rate'][-1]:.2f}, "
                f"kl_untargeted {r['kl_untargeted'][-1]:.4f} ({r['seconds'][0]:.0f} s)")
        arms[arm] = summarize(runs)
    out = {"arms": arms, "seeds": cfg.seeds, "config": dataclasses.asdict(cfg),
           "seconds": round(time.perf_counter() - t0, 1)}
    if cfg.env == "long":
        out["precheck"] = prechecks
        say(f"pre-check (initial teacher-student gap on flagged turns, per seed): {prechecks}")
    return out


def merge(results: list[dict]) -> dict:
    """One result from runs of the same settings, each over some arms and a seed range (own processes):
    per arm, the seed ranges must follow on from the same first seed."""
    results = sorted(results, key=lambda r: r["config"]["first_seed"])
    ignore = ("first_seed", "seeds", "arms")
    same = [{k: v for k, v in r["config"].items() if k not in ignore} for r in results]
    if any(c != same[0] for c in same):
        raise ValueError("--merge: the results differ in settings other than arms, first_seed and seeds")
    arms = list(dict.fromkeys(arm for r in results for arm in r["arms"]))
    runs, start, prechecks = {}, results[0]["config"]["first_seed"], {}
    for arm in arms:
        expected, runs[arm] = start, []
        for r in (r for r in results if arm in r["arms"]):
            if r["config"]["first_seed"] != expected:
                raise ValueError(f"--merge: arm {arm}'s seeds do not follow on: first_seed="
                                 f"{r['config']['first_seed']}, expected {expected}")
            runs[arm] += r["arms"][arm]["per_seed"]
            prechecks.update({expected + k: p for k, p in enumerate(r.get("precheck", []))})
            expected += r["seeds"]
    n = max(len(v) for v in runs.values())  # arms may hold fewer seeds: "seeds_per_arm" says so
    out = {"arms": {arm: summarize(v) for arm, v in runs.items()}, "seeds": n,
           "seeds_per_arm": {arm: len(v) for arm, v in runs.items()},
           "config": {**results[0]["config"], "seeds": n, "first_seed": start, "arms": arms},
           "seconds": round(sum(r["seconds"] for r in results), 1), "merged_from_processes": len(results)}
    if prechecks:
        out["precheck"] = [prechecks.get(start + k, {}) for k in range(n)]
    return out


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
    keys = [k for k in ("invalid_call_rate", "redundant_call_rate", "success_rate", "kl_untargeted")
            if k in next(iter(result["arms"].values()))]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.7 * len(keys), 4))
    for ax, key in zip(axes, keys):
        for arm, curves in result["arms"].items():
            lo, hi = curves["spread"][key]
            ax.plot(curves["steps"], curves[key], marker="o", label=arm)
            ax.fill_between(curves["steps"], lo, hi, alpha=0.15)
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    env = result["config"].get("env", "short")
    seeds = result.get("seeds_per_arm", {})
    seeds = ", ".join(f"{a} {n}" for a, n in seeds.items()) if len(set(seeds.values())) > 1 else result["seeds"]
    fig.suptitle(f"on-policy tool use ({env} episodes, teacher {result['config']['teacher']}), "
                 f"seeds: {seeds} (mean, min-max band)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@user_errors
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer transcripts, pretraining steps, seeds and steps")
    parser.add_argument("--json", required=True, help="write the result here")
    parser.add_argument("--merge", help="comma-separated result JSONs of one setting over consecutive seed "
                                        "ranges (--first-seed): write their merged result, run nothing")
    parser.add_argument("--plot", help="write the three curves to this PNG (needs matplotlib)")
    parser.add_argument("--work", default="runs/feedback_experiment", help="base policy and run dirs")
    parser.add_argument("--arms", help=f"comma-separated subset of {','.join(ARMS)} (default: all)")
    for f in dataclasses.fields(ExperimentConfig):
        if f.name != "arms":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), help=f"(default {f.default})")
    args = parser.parse_args(argv)
    if args.merge:
        return _merge_files(parser, args)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ExperimentConfig)
             if f.name != "arms" and getattr(args, f.name, None) is not None}
    long = given.get("env") == "long"
    quick = (LONG_QUICK if long else QUICK) if args.quick else {}
    values = {**(LONG if long else {}), **quick, **given}
    unused = {"ema_decay": values.get("teacher") == "ema", "top_k": values.get("mode") == "topk",
              "p_redundant": long}
    for key, used in unused.items():
        if key in given and not used:
            parser.error(f"--{key.replace('_', '-')}={given[key]} has no effect here (it needs "
                         f"{ {'ema_decay': '--teacher ema', 'top_k': '--mode topk', 'p_redundant': '--env long'}[key]})")
    if args.arms:
        unknown = set(args.arms.split(",")) - set(ARMS)
        if unknown:
            parser.error(f"--arms: unknown {sorted(unknown)}; choose from {list(ARMS)}")
        values["arms"] = tuple(args.arms.split(","))
    cfg = ExperimentConfig(**values)  # a ValueError: one line, exit 2 (user_errors)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install -e '.[plot]')")
    check_outputs([("--json", args.json), ("--plot", args.plot)])
    check_output_dir("--work", args.work)
    result = run(cfg, args.work)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    return 0


def _merge_files(parser, args) -> int:
    paths = args.merge.split(",")
    results = []
    for path in paths:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:
            parser.error(f"--merge: cannot read {path}: {e}")
    check_outputs([("--json", args.json), ("--plot", args.plot)], inputs=[("--merge", p) for p in paths])
    try:
        result = merge(results)
    except ValueError as e:
        parser.error(str(e))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    return 0


def table(result: dict) -> str:
    """Markdown: per arm, first and last measured values (mean over seeds, [min, max])."""
    keys = [k for k in ("invalid_call_rate", "redundant_call_rate", "success_rate", "kl_untargeted")
            if k in next(iter(result["arms"].values()))]
    names = {"invalid_call_rate": "invalid calls / turn", "redundant_call_rate": "redundant calls / turn",
             "success_rate": "success rate", "kl_untargeted": "KL to start, untargeted turns"}
    rows = ["| arm | " + " | ".join(names[k] for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for arm, c in result["arms"].items():
        cells = []
        for key in keys:
            lo, hi = c["spread"][key]
            cells.append(f"{c[key][0]:.3f} -> **{c[key][-1]:.3f}** [{lo[-1]:.3f}, {hi[-1]:.3f}]")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
