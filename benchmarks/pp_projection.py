"""Project pipeline-parallel layouts (PP + EP inside a node or two + ZeRO-1), which the runtime does not
implement, on the calibrated step model, beside the runtime's dual-mesh rows of benchmarks/step_projection.py.

    python benchmarks/pp_projection.py --config PATH [--compare 256,1024] [--device h200] [--json OUT]

The model, sequence length, tokens per GPU per step (weak scaling from the config's world size) and
activation checkpointing come from the config; each candidate is pp in PP_DEGREES x ep in EP_DEGREES (8: the
all-to-alls stay on NVLink; 16: two nodes) x the three schedules, micro-batches of one sequence, torch's
all_to_all_single ("nccl": what the runtime would use), ZeRO-1. The fastest that fits memory (coarse model,
benchmarks/lib/layout_step.memory_gib) at each world size is marked "recommended". Every row carries the
same band as step_projection's: low = skew 1.2 and the calibration's most optimistic ratio, high = its most
pessimistic ratio.
"""

import argparse
import dataclasses
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/pp_projection.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.lib import layout_step
from benchmarks.lib import network_model as net
from runtime.cli import user_errors
from runtime.paths import check_outputs, config_inputs

PP_DEGREES = (4, 8, 16)
EP_DEGREES = (8, 16)
SKEW_LOW = 1.2  # benchmarks/step_projection.py's
FIT_FRACTION = 0.9


def candidates(job, world: int, config_world: int, device) -> list[layout_step.Run]:
    """The PP layouts at `world` GPUs with the config's tokens per GPU (module docstring)."""
    sequences = job.data.batch_size * world // config_world
    out = []
    for pp in PP_DEGREES:
        for ep in EP_DEGREES:
            for schedule, virtual in (("1f1b", 1), ("interleaved", 2), ("dualpipe", 1)):
                run = layout_step.Run(
                    model=job.model, device=device, gpus=world, gpus_per_node=device.gpus_per_node,
                    seq_len=job.data.seq_len, global_batch=sequences, micro_batch=1, gemm_precision="bf16",
                    dispatcher="nccl", activation_checkpoint=job.training.activation_checkpoint, pp=pp,
                    virtual_stages=virtual, pp_schedule=schedule, ep=ep, dp_sharding="zero1")
                try:
                    layout_step.check_run(run)
                except ValueError:
                    continue
                out.append(run)
    return out


def row(run: layout_step.Run, memory_gib: float) -> dict:
    terms = layout_step.step_terms(run)
    skewed = layout_step.step_terms(dataclasses.replace(run, skew=SKEW_LOW))
    central = terms["tokens_per_gpu_s"]
    band = (skewed["tokens_per_gpu_s"] / max(net.CALIBRATION_RATIOS), central, central / min(net.CALIBRATION_RATIOS))
    per_token = terms["mfu_bf16"] / central
    return {"world": run.gpus, "layout": f"pp{run.pp} {run.pp_schedule}{'x2' if run.virtual_stages > 1 else ''} "
                                         f"ep{run.ep} dp{run.dp} zero1",
            "time_s": terms, "tokens_per_gpu_s_band": band, "mfu_band": tuple(b * per_token for b in band),
            "fits": terms["memory_gib"] <= FIT_FRACTION * memory_gib}


@user_errors
def main(argv=None) -> dict:
    from benchmarks.lib.device_model import device_model
    from benchmarks.step_projection import config_world
    from runtime.config_parser import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--compare", default="256,1024", help="comma-separated world sizes")
    p.add_argument("--device", default="h200")
    p.add_argument("--json")
    args = p.parse_args(argv)
    job = load_config(["--config", args.config])
    check_outputs([("--json", args.json)], config_inputs(args.config, job))
    device = device_model(args.device)
    rows = []
    for world in (int(w) for w in args.compare.split(",")):
        here = [row(run, device.memory_gib) for run in candidates(job, world, config_world(job), device)]
        best = max([r for r in here if r["fits"]] or here, key=lambda r: r["tokens_per_gpu_s_band"][1])
        best["recommended"] = True
        rows += here
    for r in rows:
        low, central, high = r["tokens_per_gpu_s_band"]
        t = r["time_s"]
        print(f"{r['world']:5d} {r['layout']:34s} {low:6.0f} {central:6.0f} {high:6.0f} tok/s/GPU  MFU "
              f"{r['mfu_band'][1]:5.1%}  step {t['step']:6.2f} s (compute {t['compute']:.2f}, ep {t['ep']:.2f}, "
              f"bubble {t['bubble']:.2f}, zero1 {t['zero1']:.2f})  {t['memory_gib']:5.0f} GiB"
              f"{'' if r['fits'] else ' no fit'}{'  recommended' if r.get('recommended') else ''}")
    out = {"config": args.config, "device": args.device, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
