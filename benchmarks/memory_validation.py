"""The memory estimate (launch/estimate_memory.py, device cpu) against measured peaks of real CPU steps.

    python benchmarks/memory_validation.py [--json PATH] [--quick]

For each case (preset x world size x activation checkpointing) ranks are forked (gloo), each builds
the job exactly as the runtime does (runtime/train.py: meta model, parallelize, seeded init, sharded
Muon) and runs one training step (forward/backward, clipping, optimizer step) under torch's
MemTracker (benchmarks/lib/memory_peak.py): the peak of all live tensors on rank 0 (parameters,
gradients, optimizer state, FSDP buffers, activations, temporaries). Prints estimate, measured and
their ratio per case.

Post-training cases (planning/memory/posttrain.py): the debug model on a rollout file of equal
trajectories (POSTTRAIN_SHAPE: user and assistant turns in turn, the last one flagged), one step of
launch/posttrain.py's objective (the prefix-shared teacher's two passes, student forward/backward over the
packed row, clipping, optimizer step, EMA update) with the live and the ema teacher, each rank's slot
holding POSTTRAIN_ROWS trajectories.
"""

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/memory_validation.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (FSDP2 imports it lazily; import once before forking)

from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402  (private, checked on torch 2.13.0)

from benchmarks.lib.memory_peak import track_peak  # noqa: E402
from planning.memory.pretrain import Job, estimate  # noqa: E402
from planning.memory.posttrain import RolloutShape, estimate as posttrain_estimate_of  # noqa: E402
from multirank import run_ranks  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from runtime import train as T  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402

COMMON = ["--data.source=synthetic", "--training.warmup_steps=1", "--checkpoint.interval=0"]
PRESETS = {
    "debug": ["--data.seq_len=128", "--data.batch_size=16"],
    "wide": ["--model.dim=256", "--model.n_layers=4", "--model.inter_dim=512", "--model.moe_inter_dim=256",
             "--model.n_routed_experts=16", "--model.n_activated_experts=4", "--model.n_heads=8",
             "--model.q_lora_rank=128", "--model.kv_lora_rank=128", "--model.qk_nope_head_dim=32",
             "--model.qk_rope_head_dim=16", "--model.v_head_dim=32", "--model.vocab_size=2048",
             "--data.seq_len=256", "--data.batch_size=8"],
}


def pretrain_argv(preset: str, checkpointing: str, run_dir: str, param_dtype: str = "float32") -> list[str]:
    return COMMON + PRESETS[preset] + [f"--training.activation_checkpoint={checkpointing}", f"--run.dir={run_dir}",
                                       f"--training.param_dtype={param_dtype}"]


def _job(world_size: int, argv: list[str]):
    """(config, layout, meshes, device, model, optimizer, loader) of one rank's CPU training job."""
    config = load_config(argv)
    layout = config.layout(world_size)
    meshes = build_meshes(layout, "cpu")
    device = torch.device("cpu")
    model = T.build_model(config, meshes, layout, device)
    return config, layout, meshes, device, model, T.build_optimizer(model, config), T.build_loader(config, meshes, layout)


def pretrain_peak(rank, world_size, argv):
    """One rank's peak bytes over one real training step of `argv` (run on ranks by multirank.run_ranks)."""
    config, _, _, device, model, optimizer, loader = _job(world_size, argv)
    with track_peak(model, optimizers=(optimizer,)) as peak:
        T.forward_backward(model, loader.next_step(), config.data.tokens_per_step(), device)
        T.clip_grad_norm_(model.parameters(), config.training.grad_clip)
        optimizer.step()
    return peak()["Total"]


POSTTRAIN_SHAPE = RolloutShape(rollout_tokens=192, feedback_items=1, hint_tokens=16, turn_tokens=32,
                               assistant_fraction=0.5)


def write_rollouts(path: str, n: int, shape: RolloutShape, vocab_size: int) -> None:
    """n trajectories of shape.rollout_tokens random tokens in turns of turn_tokens, user and assistant in
    turn (assistant_fraction 0.5), the last feedback_items assistant turns flagged with hints of hint_tokens."""
    g = torch.Generator().manual_seed(0)
    L, T = shape.rollout_tokens, shape.turn_tokens
    assert L % (2 * T) == 0 and shape.assistant_fraction == 0.5, shape
    turns = [{"role": ("user", "assistant")[i % 2], "start": i * T, "end": (i + 1) * T} for i in range(L // T)]
    with open(path, "w") as f:
        for _ in range(n):
            hint = lambda: torch.randint(0, vocab_size, (shape.hint_tokens,), generator=g).tolist()  # noqa: E731
            feedback = [{"turn": len(turns) - 1 - 2 * i, "hint": hint()} for i in range(shape.feedback_items)]
            f.write(json.dumps({"tokens": torch.randint(0, vocab_size, (L,), generator=g).tolist(), "turns": turns,
                                "advantage": 1.0, "feedback": feedback}) + "\n")


POSTTRAIN_ROWS = 8  # trajectories per rank: activations, not the model's few MiB, decide the peak


def posttrain_argv(run_dir: str, rollouts: str, dp: int, teacher: str, checkpointing: str, extra=()) -> list[str]:
    """A post-training job whose every slot (dp of them) holds POSTTRAIN_ROWS trajectories of
    POSTTRAIN_SHAPE: a file of POSTTRAIN_ROWS x dp of them, and a budget of as many trajectories at
    the estimate's cost (above today's cost, one teacher row per item), so one step is the whole file."""
    budget = dp * POSTTRAIN_ROWS * POSTTRAIN_SHAPE.cost()
    return ["--data.source=rollouts", f"--data.path={rollouts}", f"--data.batch_tokens={budget}",
            "--training.warmup_steps=1", "--checkpoint.interval=0", f"--run.dir={run_dir}",
            f"--posttrain.teacher={teacher}", f"--training.activation_checkpoint={checkpointing}", *extra]


# (teacher, activation checkpointing, world, extra arguments): the debug model as it is, with a vocabulary
# of 4096 (the losses over the logits then weigh: 16-22 bytes per logit), and split over cp (the
# teacher data's all-gather).
POSTTRAIN_CASES = [(t, ck, w, ()) for w in (1, 2) for t in ("live", "ema") for ck in ("none", "full")] + [
    ("live", "full", 1, ("--model.vocab_size=4096",)), ("ema", "full", 1, ("--model.vocab_size=4096",
                                                                            "--posttrain.mode=topk")),
    ("live", "full", 2, ("--model.vocab_size=4096", "--parallel.cp=2", "--parallel.dp_shard=1"))]


def posttrain_estimate(run_dir: str, teacher: str, checkpointing: str, world: int, extra=()) -> tuple[list, dict]:
    """(the job's argv, planning/memory/posttrain.py's estimate for rank 0) of one post-training case; writes its
    rollout file."""
    os.makedirs(run_dir, exist_ok=True)
    rollouts = os.path.join(run_dir, "rollouts.jsonl")
    dp = load_config(posttrain_argv(run_dir, rollouts, 1, teacher, checkpointing, extra)).layout(world).dp
    argv = posttrain_argv(run_dir, rollouts, dp, teacher, checkpointing, extra)
    config = load_config(argv)
    write_rollouts(rollouts, POSTTRAIN_ROWS * dp, POSTTRAIN_SHAPE, config.model.vocab_size)
    result = posttrain_estimate_of(Job(config, config.layout(world), 0, "cpu"), POSTTRAIN_SHAPE)
    assert result["posttrain"]["rows"] == POSTTRAIN_ROWS, result["posttrain"]
    return argv, result


def posttrain_row(run_dir: str, teacher: str, checkpointing: str, world: int, extra=()) -> dict:
    """Estimate vs measured peak of one post-training case (rank 0)."""
    argv, result = posttrain_estimate(run_dir, teacher, checkpointing, world, extra)
    est = result["total_gib"] * 2**30
    measured = run_ranks(_measure_posttrain, world, argv, timeout=600)[0]
    param_dtype = load_config(argv).training.param_dtype
    return {"preset": "debug", "objective": "posttrain", "teacher": teacher, "world": world,
            "activation_checkpoint": checkpointing, "param_dtype": param_dtype,
            "extra": " ".join(a for a in extra if "param_dtype" not in a), "peak_at": result["peak_at"],
            "estimate_mib": est / 2**20, "measured_mib": measured / 2**20, "ratio": est / measured}


def _measure_posttrain(rank, world_size, argv):
    from launch.posttrain import build_objective

    config, layout, meshes, device, model, optimizer, loader = _job(world_size, argv)
    objective = build_objective(config, model, meshes, layout, device)
    teacher = () if objective.teacher is None else (objective.teacher,)
    for t in teacher:  # MemTracker hooks every called module's parameter gradients and refuses frozen ones;
        t.requires_grad_(True)  # the teacher runs under no_grad, so it has no gradient either way
    tracker = MemTracker()  # as benchmarks/lib/memory_peak.track_peak, with the hook below
    tracker.track_external(model, *teacher, optimizer)

    # A top-level module called again in the step (the teacher: a prefix pass, then the item rows; the live
    # teacher, then the student) is refused by MemTracker unless it is tracked afresh: only that module's
    # own stats restart. Its submodules keep theirs (MemTracker allows a submodule to be called more than
    # once): ModTracker queues a post-backward callback for every module called without a grad-requiring
    # input (every teacher module), run at the end of the student's backward, which looks the module's stats
    # up; clearing them all (`reset_mod_stats`) loses those of modules not called again (the teacher's
    # `kv_source`s, called only while the prefix pass fills the cache) and fails there with a KeyError.
    # The peak it records (all tensors) does not depend on per-module stats.
    # The final norm and the head are called on their own too (models/model.py `head_losses`, `logits_at`).
    top_level = {m for t in (model, *teacher) for m in (t, t.norm, t.output)}

    def restart_module_stats(module, args):
        if module in top_level and module in tracker.memory_tracking:
            del tracker.memory_tracking[module]

    handle = torch.nn.modules.module.register_module_forward_pre_hook(restart_module_stats)  # before its hooks
    try:
        with tracker:
            objective.forward_backward(model, loader.next_step(), device)
            T.clip_grad_norm_(model.parameters(), config.training.grad_clip)
            optimizer.step()
            objective.after_step(model)
    finally:
        handle.remove()
    return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def posttrain_rows(run_dir: str, param_dtype: str, quick: bool = False) -> list[dict]:
    rows = []
    for teacher, checkpointing, world, extra in POSTTRAIN_CASES[:4] if quick else POSTTRAIN_CASES:
        rows.append(posttrain_row(run_dir, teacher, checkpointing, world, (*extra, f"--training.param_dtype={param_dtype}")))
        r = rows[-1]
        print(f"posttrain {r['teacher']:4s} world {r['world']} {r['activation_checkpoint']:5s} {r['extra']:40s} "
              f"estimate {r['estimate_mib']:8.2f} MiB  measured {r['measured_mib']:8.2f} MiB  ratio {r['ratio']:.3f}"
              f"  (peak: {r['peak_at']})", flush=True)
    return rows


@user_errors
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="debug preset on 1 and 2 ranks only")
    ap.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--objective", default="pretrain", choices=("pretrain", "posttrain"),
                    help="posttrain: the POSTTRAIN_CASES (planning/memory/posttrain.py's terms)")
    args = ap.parse_args(argv)
    check_outputs([("--json", args.json)])
    rows = []
    if args.objective == "posttrain":
        rows = posttrain_rows("/tmp/memory_validation_posttrain", args.param_dtype, quick=args.quick)
    for preset in () if args.objective == "posttrain" else ("debug",) if args.quick else tuple(PRESETS):
        for world in (1, 2) if args.quick else (1, 2, 4):
            for checkpointing in ("none", "full"):
                argv_case = pretrain_argv(preset, checkpointing, "/tmp/memory_validation", args.param_dtype)
                config = load_config(argv_case)
                est = estimate(Job(config, config.layout(world), 0, "cpu"))["total_gib"] * 2**30
                measured = run_ranks(pretrain_peak, world, argv_case, timeout=600)[0]
                rows.append({"preset": preset, "world": world, "activation_checkpoint": checkpointing,
                             "param_dtype": args.param_dtype,
                             "estimate_mib": est / 2**20, "measured_mib": measured / 2**20, "ratio": est / measured})
                print(f"{preset:6s} {args.param_dtype} world {world} {checkpointing:5s} estimate {est / 2**20:8.2f} MiB  "
                      f"measured {measured / 2**20:8.2f} MiB  ratio {est / measured:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
