"""Dry run of one rank of a W-rank job on this machine: no peers, no GPU (torch's `fake` backend).

    python launch/dry_run.py --config configs/kimi_k2_256gpu.toml [--world 256] [--ranks 0,128,255]
                             [--layers 1] [--seq 64] --json OUT [--section.key=value ...]

For each rank of `--ranks` (default 0), one process plays that rank of a `--world`-rank job through the
fake process-group backend (parallel/fake_backend.py; collectives move no data) and builds what the real
launch builds, with the real code: the layout (the same one-line config error as launch/pretrain.py,
exit 2), the meshes and every process group, the whole model parallelized on the meta device (all
layers, no memory), the sharded Muon optimizer and its plan (timed: `planner_s`), the data loader
(synthetic tokens when the config's token file is not on this machine) and the checkpoint's state dict.
It then materializes the model's last `--layers` blocks (plus embedding, final norm and head) at full
width on the CPU and runs one forward/backward/optimizer step of them at a short sequence (`--seq`
tokens), counting every collective (kind, mesh axes, bytes this rank contributes) and the step's peak
tensor memory (the materialized shards and optimizer state, plus the most bytes the step's ops hold
alive at once: planning/recording.py's live-storage count; the process's max RSS is reported too).
The counted bytes are converted to bytes on the wire (in-node / across nodes) by the conversion the
whole-step projection uses, and compared with the projection's FSDP and per-layer EP terms for the same
materialized model and the step's own routing (launch/dry_run_bytes.py).

What the fake backend cannot give, and what the dry run assumes instead: received values are whatever
the output buffers held. The only received values that steer control flow are the expert-parallel
token counts (they size the dispatch all-to-all); the dry run assumes symmetric traffic (every ep peer
sends this rank as many tokens per expert as this rank sends it; what balanced routing gives on
average), so nothing allocates from garbage. The node-deduplicated dispatch (parallel.ep_dedup) also
forwards what its gateways received (expert ids), so under it the step runs the direct dispatch of the
same routing, and the pipelined one (parallel.ep_overlap_chunks) sizes its pieces from the piece counts
peers send, so it runs unpipelined (`step_dispatch` says so). Losses, norms and updates are meaningless; shapes, groups and
bytes are real.

Under pipeline parallelism (parallel.pp > 1) a played rank builds its pipeline rank's stages instead of the
whole model (parallel/pp/part.py, each parallelized on the stage's meshes, Muon planned over the stage's
ranks), and its states equal the memory estimate's for those stages (planning/memory/pretrain.py
`rank_holding`). The step is not run there (`step_not_run`): the schedule's stages exchange activations point
to point, which the fake backend does not deliver.

JSON: world, rank, pp_rank, stages (this rank's pipeline stages, or "whole model"), groups (name -> size),
states_bytes ({dense, expert} x {params, grads, optimizer} of everything this rank holds, from the parallelized
model's local shards and the optimizer's state tensors), planner_s, collectives ([{kind, op, mesh, source, bytes,
count, wire_intra_bytes, wire_inter_bytes}]
of the materialized step: kind all_gather | reduce_scatter | all_reduce | all_to_all, source fsdp | ep |
optimizer | other, bytes passed in, bytes sent to peers on this rank's node and on others),
projection_comparison ([{kind, mesh, source, counted, projected, equal}]: [in-node, across] bytes of each
FSDP and EP term against planning/fsdp_traffic.py / ep_traffic.py), step_dispatch, peak_memory_bytes,
estimate (planning/memory/pretrain.py, launch/estimate_memory.py's, for the same rank: states by the same keys, and its whole estimate),
build_s / step_s. Exit status 2 with one line on a config or argument error.
"""

import contextlib
import dataclasses
import json
import math
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch import precheck  # noqa: E402


def parse(argv):
    """(the tool's flags, the rest: config overrides); a malformed flag is one line, exit 2."""
    ap = precheck.ToolParser(description="Dry run of ranks of a W-rank job (fake process group).",
                             prefix="config error",
                             epilog="Any other --section.key=value overrides the config (the keys of launch/pretrain.py --help).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--world", type=int, default=None,
                    help="world size (default: parallel.pp x the config's dense degrees)")
    ap.add_argument("--ranks", default="0", help="comma-separated ranks to play, e.g. 0,128,255")
    ap.add_argument("--layers", type=int, default=1, help="blocks materialized at full width for the step (the last ones)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence of the step")
    ap.add_argument("--json", default=None)
    return ap.parse_known_args(argv)


if __name__ == "__main__":  # a config error or a malformed flag exits here, before torch and the model code load
    precheck.tool_config(sys.argv[1:], prefix="config error")
    parse(sys.argv[1:])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from launch import dry_run_bytes  # noqa: E402
from models import Transformer  # noqa: E402
from models.experts import GroupedExperts  # noqa: E402
from parallel.fake_backend import register_fake_backend  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from parallel.pp import plan as pp_plan  # noqa: E402
from parallel.pp.part import split_stages  # noqa: E402
from planning.memory import pretrain as memory_estimate  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from runtime import comm  # noqa: E402
from runtime.checkpoint import checkpoint  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402
from runtime.cli import fail  # noqa: E402
from runtime.paths import check_output_file, config_inputs  # noqa: E402
from runtime import train  # noqa: E402


def job_config(args, overrides):
    """(config for the run on CPU, world, ranks, note on data); ValueError naming the flag or key."""
    config = load_config(["--config", args.config, *overrides])
    p = config.parallel
    world = args.world if args.world is not None else p.pp * math.prod((p.dp_replicate, p.dp_shard, p.cp))
    if world < 1:
        raise ValueError(f"--world {world}: must be >= 1 (the config infers a degree: give --world)")
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise ValueError(f"--ranks {args.ranks}: expected comma-separated integers") from None
    if bad := [r for r in ranks if not 0 <= r < world]:
        raise ValueError(f"--ranks {args.ranks}: {bad} not in 0..{world - 1} for a world of {world}")
    if not 1 <= args.layers <= config.model.n_layers:
        raise ValueError(f"--layers {args.layers}: must be in 1..{config.model.n_layers} (model.n_layers)")
    if args.json:
        check_output_file("--json", args.json, "dry_run.json", config_inputs(args.config, config))
    config.layout(world)  # ConfigError, the one line launch/pretrain.py prints
    note = "the config's token file"
    if config.data.source == "bin" and not os.path.exists(config.data.path):
        note = f"synthetic tokens ({config.data.path} is not on this machine)"
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, source="synthetic", path=""))
    step_data = dataclasses.replace(config.data, seq_len=args.seq)
    step = dataclasses.replace(config, training=dataclasses.replace(config.training, device="cpu"), data=step_data)
    return config, step, world, ranks, note


def last_blocks(model_config, n: int):
    """The model config of the last `n` blocks (MoE ones for DeepSeek-V3 shapes), full width."""
    dense = max(0, model_config.n_dense_layers - (model_config.n_layers - n))
    return dataclasses.replace(model_config, n_layers=n, n_dense_layers=dense)


def states_bytes(model, optimizer) -> dict:
    """{dense|expert: {params, grads, optimizer}} bytes of this rank's shards: fp32 masters, fp32 grads of
    the same shape, and every tensor in the optimizer's state but AdamW's "step" counters, which live
    in host memory whatever the device (optim/adamw.py, as torch keeps them): `host_bytes` apart."""
    out = {mesh: {"params": 0, "grads": 0, "optimizer": 0} for mesh in ("dense", "expert")}
    out["host_bytes"] = 0
    expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        mesh = out["expert" if id(p) in expert_params else "dense"]
        mesh["params"] += local.numel() * local.element_size()
        mesh["grads"] += local.numel() * local.element_size()
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                value = value.to_local() if isinstance(value, DTensor) else value
                if key == "step":
                    out["host_bytes"] += value.numel() * value.element_size()
                else:
                    mesh["optimizer"] += value.numel() * value.element_size()
    return out


def _fake_backend_legal(func, args):
    """The fake backend refuses an all-to-all that sends nothing but receives something (legal on gloo and
    NCCL: sharded Muon's exchange when this rank owns blocks but sends none); it moves no data anyway,
    so it gets one dummy row per peer instead (the log above counted the real, empty input)."""
    if func is not torch.ops.c10d.alltoall_base_.default or args[1].numel() or not args[0].numel():
        return args
    peers = dist.ProcessGroup.unbox(args[2]).size()
    dummy = args[1].new_zeros((peers, *args[1].shape[1:]))
    return (args[0], dummy, args[2], args[3], [1] * peers, *args[5:])


def all_groups() -> dict[str, int]:
    """{group name (with its mesh axes where known): size} of every process group this rank is in."""
    from torch.distributed import distributed_c10d as c10d

    return {name: dist.get_world_size(group) for group, name in c10d._world.pg_names.items()}


def play_rank(config, step_config, world: int, rank: int, layers: int, note: str) -> dict:
    """Everything for one rank; the fake process group lives only inside."""
    layout = config.layout(world)
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        start = time.perf_counter()
        meshes = build_meshes(layout, "cpu")
        names = comm.group_names(meshes)
        model = meta_model(config, layout, meshes)
        planner_start = time.perf_counter()
        optimizer = train.build_optimizer(model, config, meshes)  # under pp: planned over the stage's ranks
        planner_s = time.perf_counter() - planner_start
        states = states_bytes(model, optimizer)
        loader = train.build_loader(config, meshes, layout)
        app_state = {"train": checkpoint.ModelOptimState(model, [optimizer]), "data": loader}
        checkpoint_entries = len(app_state["train"].state_dict()["model"])
        del model, optimizer, app_state
        build_s = time.perf_counter() - start
        step = (materialized_step(step_config, layout, meshes, layers, names) if layout.pp == 1 else
                {"step_not_run": PIPELINE_STEP})
        groups = {names.get(name, name): size for name, size in all_groups().items()}
        job = memory_estimate.Job(config, layout, rank, "h200")
        estimate, state = memory_estimate.estimate(job), memory_estimate.sharded_state(job)
        held = stage_lines(layout, config.model.n_layers, meshes.pp_rank())
        return {"world": world, "rank": rank, "pp_rank": meshes.pp_rank(), "stages": held,
                "groups": groups, "states_bytes": states,
                "states_total_bytes": sum(sum(states[m].values()) for m in ("dense", "expert")), "planner_s": planner_s,
                "checkpoint_model_entries": checkpoint_entries, "data": note, **step, "build_s": build_s,
                "estimate": {"states_bytes": state, "states_total_bytes": sum(state.values()), **estimate}}
    finally:
        dist.destroy_process_group()


PIPELINE_STEP = ("not run under parallel.pp > 1: the schedule's stages exchange activations point to point, which "
                 "the fake backend does not deliver (the states above are the stage's, built by the real code)")


def meta_model(config, layout, meshes):
    """The model on the meta device, parallelized as the launch does: the whole model, or under pipeline
    parallelism this rank's stages (parallel/pp/part.py, each parallelized on the stage's meshes) as one module
    under the whole model's names. No memory."""
    t = config.training
    with torch.device("meta"):
        model = Transformer(config.model)
    parts = [model]
    if layout.pp > 1:
        model, parts = split_stages(model, layout, meshes.pp_rank())
    for part in parts:
        parallelize(part, meshes, layout, param_dtype=train.DTYPES[t.param_dtype],
                    reduce_dtype=train.DTYPES[t.reduce_dtype])
    return model


def stage_lines(layout, n_layers: int, pp_rank: int) -> str:
    """This rank's pipeline stages and their blocks (parallel/pp/plan.py), or "whole model"."""
    if layout.pp == 1:
        return "whole model"
    return pp_plan.describe_stages(layout.pp_config, layout.world_size, n_layers)[1 + pp_rank].strip()


def materialized_step(config, layout, meshes, layers: int, names: dict) -> dict:
    """One forward/backward/optimizer step of the last `layers` blocks at full width (real init).
    Peak memory: this rank's shards of the materialized model and its optimizer state, plus the most
    bytes the step's ops allocate alive at once (gathered weights, activations, gradients, buckets)."""
    small = dataclasses.replace(config, model=last_blocks(config.model, layers))
    layout, dispatch = step_dispatch(layout)
    model = train.build_model(small, meshes, layout, torch.device("cpu"), init=lambda m: m.init_weights(seed=0))
    routing = dry_run_bytes.RoutingLog(model)
    optimizer = train.build_optimizer(model, small)
    scheduler = train.build_scheduler(optimizer, small.training)
    loader = train.build_loader(small, meshes, layout)
    resident = sum(sum(m.values()) - m["grads"] for m in _by_mesh(states_bytes(model, optimizer)))
    log = dry_run_bytes.CollectiveLog(names, layout.ep_config.ranks_per_node, _fake_backend_legal)
    start = time.perf_counter()
    with log:
        train.train_step(model, optimizer, scheduler, loader, small, torch.device("cpu"))
    step_s = time.perf_counter() - start
    rows = log.table()
    projected = dry_run_bytes.projected_terms(small, layout, meshes, names, routing.routings)
    return {"step_layers": layers, "step_seq_len": config.data.seq_len, "step_s": step_s, "step_dispatch": dispatch,
            "collectives": rows, "projection_comparison": dry_run_bytes.compare(rows, projected),
            "peak_memory_bytes": resident + log.memory.peak, "step_peak_extra_bytes": log.memory.peak,
            "process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def step_dispatch(layout):
    """(the layout the step runs with, a note): the node-deduplicated dispatch forwards what its gateways
    received from peers (expert ids, pair counts), and the pipelined dispatch sizes its pieces from the
    piece counts peers send, neither of which the fake backend delivers, so the step runs the direct,
    unpipelined dispatch of the same routing (same rows and bytes but for the counts; every other EP knob
    as configured)."""
    off = {k: v for k, v in (("ep_dedup", False), ("ep_overlap_chunks", 1)) if getattr(layout.ep_config, k) != v}
    if not off or layout.ep == 1:
        return layout, "as configured"
    names = ", ".join(f"parallel.{k}" for k in off)
    direct = dataclasses.replace(layout, ep_config=dataclasses.replace(layout.ep_config, **off))
    return direct, f"direct, unpipelined ({names}: needs peers' data, not dry-runnable)"


def _by_mesh(states: dict) -> list[dict]:
    return [states["dense"], states["expert"]]


def main(argv=None) -> list[dict]:
    args, overrides = parse(argv if argv is not None else sys.argv[1:])
    try:
        config, step_config, world, ranks, note = job_config(args, overrides)
    except ValueError as e:  # ConfigError is one: it names the dotted key
        fail(e, prefix="config error")
    results = []
    for rank in ranks:
        started = time.perf_counter()
        result = play_rank(config, step_config, world, rank, args.layers, note)
        result["wall_s"] = time.perf_counter() - started
        print(summary(result), flush=True)
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)
    return results


def summary(r: dict) -> str:
    gib = 2**30
    ok = "equal" if r["states_total_bytes"] == r["estimate"]["states_total_bytes"] else "DIFFERENT"
    head = (f"rank {r['rank']} of {r['world']} ({r['stages']}): {len(r['groups'])} process groups; states "
            f"{r['states_total_bytes'] / gib:.3f} GiB ({ok} to the memory estimate's); planner {r['planner_s']:.1f} s; ")
    if "step_not_run" in r:
        return head + f"wall {r['wall_s']:.1f} s\n  step {r['step_not_run']}"
    lines = [head + f"step of {r['step_layers']} block(s) at seq {r['step_seq_len']}: {r['step_s']:.1f} s, peak "
             f"{r['peak_memory_bytes'] / gib:.2f} GiB; wall {r['wall_s']:.1f} s"]
    mib = 2**20
    lines += [f"  {c['kind']:<15} {c['source']:<10} {c['mesh']:<40} {c['count']:>4} x  {c['bytes'] / mib:10.1f} MiB "
              f"passed in, on the wire {c['wire_intra_bytes'] / mib:10.1f} MiB in-node "
              f"{c['wire_inter_bytes'] / mib:10.1f} MiB across" for c in r["collectives"]]
    lines += [f"  projection ({c['source']} {c['kind']} on {c['mesh']}): in-node {c['projected'][0] / mib:.3f} / "
              f"across {c['projected'][1] / mib:.3f} MiB, counted {c['counted'][0] / mib:.3f} / "
              f"{c['counted'][1] / mib:.3f}: {'equal' if c['equal'] else 'DIFFERENT'}"
              for c in r["projection_comparison"]]
    return "\n".join(lines)

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
