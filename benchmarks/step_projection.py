"""Project one whole training step per layout: FLOPs, bytes per mesh and link, host syncs, time, MFU.

    python benchmarks/step_projection.py --config PATH [--world N] [--json PATH] [--device h100|h200]
        [--calibration gpu_check.json] [--act-dtype float32|bfloat16] [--param-dtype ...] [--reduce-dtype ...]
        [--activation-checkpoint none|selective|full] [--compare]

What each row holds and how its time is made: planning/dual_mesh.py (this is its command line). `--compare`
projects candidate layouts at each world size (`candidate_layouts`), each with every EP dispatch combination
the runtime implements, and marks the fastest row that fits memory "recommended": by the coarse memory model,
or with --memory-estimate by launch/estimate_memory.py's estimate (planning/memory/pretrain.py).
"""

import argparse
import dataclasses
import json
import math
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/step_projection.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.dual_mesh import (DTYPE_BYTES, EP_CANDIDATES, MEMORY_NOTE, Options, candidate_layouts, compute_rates,
                                project_layout, resolved, scaled_job)
from planning.ep_traffic import describe_knobs, dispatch_variants
from runtime.cli import user_errors
from runtime.paths import check_outputs, config_inputs


def options(args) -> Options:
    """The projection's what-ifs from the parsed flags."""
    return Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)})


def compare(job, config_world: int, worlds, device, rates, args) -> list[dict]:
    rows = []
    for world in worlds:
        scaled = scaled_job(job, world, config_world)
        base = job.layout(world) if world == config_world else None
        layouts = {}
        for name, layout in candidate_layouts(scaled, world, base).items():
            layouts |= variants(scaled, name, layout, args)
        if not layouts:
            raise ValueError(f"--compare {world}: no candidate layout at {world} GPUs (candidates: ep of "
                             f"{', '.join(map(str, EP_CANDIDATES))} dividing the model's "
                             f"{job.model.n_routed_experts} experts and the world, dense FSDP over nodes of 8, that "
                             f"the runtime accepts with the batch scaled to {scaled.data.batch_size} sequences)")
        rows += recommend(project_rows(scaled, layouts, device, rates, args), world, scaled, layouts, args)
    return rows


def variants(job, name, layout, args) -> dict:
    """{row name: layout} of one layout: with its own dispatch knobs, then with every other combination the
    runtime implements (`dispatch_variants`), named name+variant."""
    checkpointing = resolved(job, options(args))["activation_checkpoint"]
    others = dispatch_variants(layout, checkpointing)
    return {name: layout} | {f"{name}+{v}": lay for v, lay in others.items() if lay != layout}


def project_rows(job, layouts: dict, device, rates, args) -> list[dict]:
    rows = []
    for row_name, lay in layouts.items():
        row = project_layout(job, lay, device, rates, options(args))
        row["name"] = row_name
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def recommend(rows: list[dict], world: int, job, layouts: dict, args) -> list[dict]:
    """Mark the fastest row that fits memory `"recommended": true`: by the coarse memory model, or with
    --memory-estimate by the memory estimate (planning/memory/pretrain.py, rank 0, uniform routing), run on the
    rows in order of step time until one fits (each checked row gets "estimate_gib"). When none fits, none is
    recommended, and the line says so."""
    by_time = sorted(rows, key=lambda r: r["time_s"]["step"])
    if args.memory_estimate:
        best = next((r for r in by_time if estimate_fits(r, job, layouts[r["name"]], args.device)), None)
    else:
        best = next((r for r in by_time if r["fits"]), None)
    if best is None:
        print(f"  recommended at {world} GPUs: none: no row fits {args.memory_gib:.1f} GiB "
              f"({'by the memory estimate' if args.memory_estimate else 'by the coarse memory model'}); more GPUs, "
              f"activation checkpointing or a larger card", flush=True)
        return rows
    best["recommended"] = True
    print(f"  recommended at {world} GPUs: {best['name']}: {best['layout']} {describe_knobs(best['dispatch'])} "
          f"({best['time_s']['step']:.2f} s, MFU {best['mfu']:.1%})", flush=True)
    return rows


def estimate_fits(row: dict, job, layout, device: str) -> bool:
    """Whether launch/estimate_memory.py says `layout` fits `device` (rank 0, uniform routing); recorded in the row."""
    from planning.memory.pretrain import Job, estimate

    result = estimate(Job(job, layout, 0, device))
    row["estimate_gib"], row["estimate_fits"] = result["total_gib"], result["fits"]
    print(f"  memory estimate of {row['name']} ({row['layout']}): {result['total_gib']:.1f} GiB, "
          f"{'fits' if result['fits'] else 'does NOT fit'}", flush=True)
    return result["fits"]


HEADER = ("world layout                                   dispatch       step s  compute recomp  ep s  cp s "
          "fsdpNVL fsdpNET   opt s syncs"
          "  MFU   fsdp GB in/out-node  ep GB in/out  mem GiB fits")


def format_row(r: dict) -> str:
    t = r["time_s"]
    fsdp_intra = sum(v["intra_gb"] for m in r["fsdp"].values() for v in m.values())
    fsdp_inter = sum(v["inter_gb"] for m in r["fsdp"].values() for v in m.values())
    return (f"{r['world']:5d} {r['layout']:40s} {r['name'].split('+')[-1] if '+' in r['name'] else 'own':14s} "
            f"{t['step']:7.2f} {t['compute']:8.2f} {t['recompute']:6.2f} {t['ep']:5.2f} {t['cp']:5.2f} "
            f"{t['fsdp_nvlink']:7.2f} {t['fsdp_network']:7.2f} {t['optimizer']:7.3f} {r['host_syncs']:5d} "
            f"{r['mfu']:5.1%} {fsdp_intra:9.0f} {fsdp_inter:9.0f} "
            f"{r['ep']['intra_gb']:6.0f} {r['ep']['inter_gb']:6.0f} "
            f"{r['memory_gib']['total']:8.0f} {'yes' if r['fits'] else 'no':>4s}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a job TOML (configs/*.toml): model, batch, micro-batches, layout")
    p.add_argument("--world", type=int, help="GPUs (default: the config layout's own world size)")
    p.add_argument("--json", help="write {'rows': [...]} here")
    p.add_argument("--device", default="h200", help="a device of planning/devices.py (h100, h200, h800, b200)")
    p.add_argument("--calibration", help="JSON written by benchmarks/gpu_check.py (measured rates)")
    p.add_argument("--act-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="dtype of activations, dispatched tokens and gathered K/V (default: training.param_dtype, "
                        "the compute dtype)")
    p.add_argument("--param-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="dtype FSDP all-gathers weights in (default: training.param_dtype)")
    p.add_argument("--reduce-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="dtype gradients are reduced in (default: training.reduce_dtype)")
    p.add_argument("--activation-checkpoint", default=None, choices=("none", "selective", "full"),
                   help="default: training.activation_checkpoint")
    p.add_argument("--cp-gather", default="latent", choices=("latent", "expanded"),
                   help="latent: what the runtime gathers (MLA latent + rotary key, GQA kv heads); "
                        "expanded: the expanded K/V, as it gathered before")
    p.add_argument("--grad-sync", default=None, choices=("every", "replicas_last", "last"),
                   help="override the config's training.grad_sync (parallel/overlap.py)")
    p.add_argument("--overlap-ep", action="store_true",
                   help="what-if: step = max(compute, EP + CP) instead of their sum: every EP/CP collective hidden "
                        "behind compute, an upper bound beyond what any runtime path does (ep_overlap_chunks "
                        "hides part of it: its rows without this flag)")
    p.add_argument("--compare", default="",
                   help="comma-separated world sizes: candidate layouts at each (e.g. 256,1024)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="device memory for the fit check (default: --device's, planning/devices.py)")
    p.add_argument("--memory-estimate", action="store_true",
                   help="recommend the fastest row that fits by launch/estimate_memory.py (--device's memory; "
                        "rank 0, uniform routing) instead of the coarse memory model")
    return p.parse_args(argv)


def config_world(job, flag: str = "--world") -> int:
    """The world size the config's own degrees give; ValueError naming `flag` when the config infers one."""
    degrees = [job.parallel.dp_replicate, job.parallel.dp_shard, job.parallel.cp]
    if any(d < 1 for d in degrees):
        raise ValueError(f"{flag}: the config infers a degree (parallel.dp_replicate x dp_shard x cp = "
                         f"{' x '.join(map(str, degrees))}), so the world its batch is for is unknown: pass --world")
    return math.prod(degrees)


def worlds_of(text: str) -> list[int]:
    """--compare's world sizes; ValueError naming the flag."""
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--compare {text}: expected comma-separated world sizes, e.g. 256,1024") from None
    if bad := [w for w in worlds if w < 1]:
        raise ValueError(f"--compare {text}: world sizes must be >= 1 (got {', '.join(map(str, bad))})")
    return worlds


def check_flags(args) -> None:
    """One-line refusals of the numeric flags, before any projecting."""
    if args.world is not None and args.world < 1:
        raise ValueError(f"--world {args.world}: must be >= 1")
    if args.memory_gib is not None and not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
        raise ValueError(f"--memory-gib {args.memory_gib}: must be a finite number of GiB > 0")


@user_errors
def main(argv=None) -> dict:
    from planning.devices import device_model
    from runtime.config_parser import load_config

    args = parse_args(argv)
    check_flags(args)
    worlds = worlds_of(args.compare) if args.compare else None
    job = load_config(["--config", args.config])
    check_outputs([("--json", args.json)], config_inputs(args.config, job)
                  + [("the --calibration file", args.calibration)])
    try:
        device = device_model(args.device, args.calibration)
        rates = compute_rates(device, args.calibration)
    except ValueError as e:
        raise ValueError(f"--device {args.device} / --calibration {args.calibration}: {e}") from None
    if args.memory_gib is None:
        args.memory_gib = device.memory_gib
    world = args.world or config_world(job, "--compare" if worlds else "--world")
    print(f"{job.model_preset}: {job.data.tokens_per_step()} tokens per step at {world} "
          f"GPUs, {job.training.grad_accum} micro-batches; {device.name}; compute "
          + ", ".join(f"{k} {v / 1e12:.0f}" for k, v in rates.items()) + " TFLOP/s")
    used = resolved(job, options(args))
    print("dtypes and checkpointing: " + ", ".join(f"{k} {v} ({'flag' if getattr(args, k) else 'config'})"
                                                  for k, v in used.items()))
    print(MEMORY_NOTE)
    print(HEADER)
    if args.compare:
        rows = compare(job, world, worlds, device, rates, args)
    else:
        layouts = variants(job, "config", job.layout(world), args)
        rows = recommend(project_rows(job, layouts, device, rates, args), world, job, layouts, args)
    out = {"config": args.config, "device": device.__dict__, "rates_tflops": {k: v / 1e12 for k, v in rates.items()},
           **used, "cp_gather": args.cp_gather, "memory_note": MEMORY_NOTE, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
