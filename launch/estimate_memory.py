"""Per-rank peak memory of a training job before launch: no GPU, no process group.

    python launch/estimate_memory.py --config configs/kimi_k2_256gpu.toml [--world 256] [--device h200]
                                     [--rank 0] [--routing-skew 1.0] [--json PATH]
    python launch/estimate_memory.py --config configs/posttrain_example.toml --world 2 \\
        [--rollout-tokens L] [--feedback-items K] [--hint-tokens H] [--turn-tokens T] [--assistant-fraction A]

The command line of planning/memory/: a pretraining config (data.source other than "rollouts") is estimated by
planning/memory/pretrain.py (under parallel.pp > 1 one line per pipeline rank, at --rank's coordinate inside its
stage, then the worst one's parts; --json: {"stages": [...], "worst": p}), a post-training config by
planning/memory/posttrain.py, which adds the teacher's
and the feedback losses' terms for the rollouts' shape the flags give (the file is not read). What each
counts: those modules' docstrings; docs/cluster.md#memory-before-launch.

A post-training config whose posttrain.init_from is a Hugging Face directory needs only that directory's
config.json (the model's shape) for the estimate: no weights, so it can run before a checkpoint's download.
Every user error (config, flag, --json) is one line, exit 2.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch import precheck  # noqa: E402

INIT_FROM_HINT = ("; the estimate needs only the directory's config.json (the model's shape, no weights): e.g. "
                  "huggingface-cli download moonshotai/Kimi-K2.5 config.json --local-dir DIR, then "
                  "--posttrain.init_from=DIR")


def explain(message: str) -> str:
    """A config error, with how to estimate before a download when posttrain.init_from is not on this machine."""
    missing = "posttrain.init_from=" in message and ("no such directory" in message or "no config.json" in message)
    return message + INIT_FROM_HINT if missing else message


if __name__ == "__main__":  # a config error exits here, before torch and the model code load
    precheck.tool_config(sys.argv[1:], explain=explain)

import json  # noqa: E402

from planning.memory import posttrain, pretrain  # noqa: E402
from runtime.cli import fail  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402
from runtime.paths import check_output_file, config_inputs  # noqa: E402

SHAPE_FLAGS = ("rollout_tokens", "feedback_items", "hint_tokens", "turn_tokens", "assistant_fraction")


def parser() -> precheck.ToolParser:
    ap = precheck.ToolParser(description="Per-rank peak memory of a training job, before launch.", prefix="error",
                             epilog="Any other --section.key=value overrides the config (the keys of "
                                    "launch/pretrain.py --help).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--world", type=int, default=None,
                    help="world size (default: parallel.pp x the product of the config's dense degrees)")
    ap.add_argument("--device", choices=pretrain.DEVICE_CHOICES, default="h200",
                    help="planning/devices.py (memory as torch reports it); cpu: no limit")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--routing-skew", type=float, default=1.0,
                    help="the busiest ep rank's routed rows over the mean: scales its dispatch and kept EP buffers "
                         "(1.0: uniform routing)")
    ap.add_argument("--json", default=None)
    g = ap.add_argument_group("post-training (data.source = 'rollouts'): the rollouts' shape")
    g.add_argument("--rollout-tokens", type=int, default=None, help="longest trajectory (default model.max_seq_len)")
    g.add_argument("--feedback-items", type=int, default=None, help="feedback items per trajectory (default 10)")
    g.add_argument("--hint-tokens", type=int, default=None, help="tokens per hint (default 256)")
    g.add_argument("--turn-tokens", type=int, default=None, help="tokens per flagged turn (default 2048, at most L/K)")
    g.add_argument("--assistant-fraction", type=float, default=None,
                   help="trained (assistant) share of a trajectory's tokens (default 1: the upper bound)")
    return ap


def rollout_shape(args, config) -> posttrain.RolloutShape | None:
    """The shape of a post-training config's rollouts (None for pretraining); ValueError naming the flag."""
    given = {k: getattr(args, k, None) for k in SHAPE_FLAGS}
    if config.data.source != "rollouts":
        flags = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if flags:
            raise ValueError(f"{flags[0]}: only for post-training configs (data.source='rollouts'), but data.source="
                             f"{config.data.source!r}")
        return None
    L = config.model.max_seq_len if given["rollout_tokens"] is None else given["rollout_tokens"]
    K = 10 if given["feedback_items"] is None else given["feedback_items"]
    H = 256 if given["hint_tokens"] is None else given["hint_tokens"]
    T = min(2048, L // max(K, 1)) if given["turn_tokens"] is None else given["turn_tokens"]
    A = 1.0 if given["assistant_fraction"] is None else given["assistant_fraction"]
    checks = [("--rollout-tokens", L, 1 <= L <= config.model.max_seq_len, f"in [1, model.max_seq_len="
               f"{config.model.max_seq_len}] (the loader refuses longer trajectories)"),
              ("--feedback-items", K, K >= 0, ">= 0"), ("--hint-tokens", H, H >= 1, ">= 1"),
              ("--turn-tokens", T, 1 <= T and K * T <= L, f"in [1, rollout tokens / feedback items = {L}/{K}]"),
              ("--assistant-fraction", A, 0 <= A <= 1, "in [0, 1]")]
    for flag, value, ok, expected in checks:
        if not ok:
            raise ValueError(f"{flag} {value}: must be {expected}")
    return posttrain.RolloutShape(L, K, H, T, A)


def job_from_args(args, overrides: list[str]) -> pretrain.Job:
    """The Job of the parsed arguments; ValueError naming the flag or the dotted config key otherwise,
    before any estimating (which takes seconds at real widths)."""
    config = load_config(["--config", args.config, *overrides])
    p = config.parallel
    degrees = (p.dp_replicate, p.dp_shard, p.cp)
    if args.world is None and -1 in degrees:
        raise ValueError(f"--world: the config infers parallel.dp_replicate, dp_shard or cp (-1: "
                         f"{', '.join(map(str, degrees))}); give the world size")
    world = p.pp * math.prod(degrees) if args.world is None else args.world
    if world < 1:
        raise ValueError(f"--world {world}: must be >= 1")
    if not 0 <= args.rank < world:
        raise ValueError(f"--rank {args.rank}: must be in 0..{world - 1} for a world of {world}")
    if not (math.isfinite(args.routing_skew) and args.routing_skew >= 1.0):  # refuses nan and inf
        raise ValueError(f"--routing-skew {args.routing_skew}: must be a finite number >= 1.0 (the busiest rank "
                         f"over the mean)")
    if args.json:
        check_output_file("--json", args.json, "estimate.json", config_inputs(args.config, config))
    layout = config.layout(world)  # refuses post-training under parallel.pp > 1, as the launch does
    return pretrain.Job(config, layout, args.rank, args.device, args.routing_skew)


def main(argv=None) -> dict:
    """The estimate of the job the arguments describe (printed, and written to --json). A user error
    (config, --world, --rank, --json) prints one line and exits with status 2, as argparse does."""
    args, overrides = parser().parse_known_args(argv)
    try:
        job = job_from_args(args, overrides)
        shape = rollout_shape(args, job.config)  # None unless data.source = "rollouts"
    except ValueError as e:  # ConfigError is one: it names the dotted key
        fail(explain(str(e)))
    if shape is not None:
        result = posttrain.estimate(job, shape)
    elif job.layout.pp > 1:
        result = pretrain.estimate_stages(job)
    else:
        result = pretrain.estimate(job)
    print(format_stages(result) if "stages" in result else format_table(result), flush=True)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as e:
            fail(f"--json {args.json}: cannot write ({e.strerror or e})")
    return result


def format_stages(r: dict) -> str:
    """One line per pipeline rank (its stages' blocks, peak, moment), then the worst one's table."""
    lines = []
    for p, row in enumerate(r["stages"]):
        s = row["stage"]
        blocks = ", ".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) if c else "none" for c in s["chunks"])
        extra = "".join([" + embedding" if s["embedding"] else "", " + head" if s["head"] else ""])
        flight = " or ".join("/".join(map(str, m)) for m in s["moments"])
        lines.append(f"pipeline rank {p:>2}: blocks {blocks}{extra}; micro-batches in flight {flight}: "
                     f"{row['total_gib']:7.2f} GiB at {row['peak_at']}")
    return "\n".join([*lines, f"worst: pipeline rank {r['worst']}", format_table(r["stages"][r["worst"]])])


def format_table(r: dict) -> str:
    rows = [f"  {k:<13}{v:9.2f} GiB" for k, v in r["per_rank_gib"].items()]
    device = "cpu (no limit)" if r["device_gib"] is None else f"{r['device_gib']:.1f} GiB"
    verdict = "fits" if r["fits"] else "does NOT fit: " + "; ".join(r["suggestions"])
    skew = "" if r["routing_skew"] == 1.0 else f", routing skew {r['routing_skew']:g}"
    return "\n".join([f"rank {r['rank']} of {r['world']}, micro-batch {r['micro_batch']}{skew}", *rows,
                      f"  {'peak':<13}{r['total_gib']:9.2f} GiB  (device {device}): {verdict}"])


if __name__ == "__main__":
    main()
