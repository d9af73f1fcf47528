"""Project pipeline-parallel layouts (PP + EP inside a node or two + ZeRO-1), which the runtime does not
implement, on the calibrated step model, beside the runtime's dual-mesh rows of benchmarks/step_projection.py.

    python benchmarks/pp_projection.py --config PATH [--compare 256,1024] [--device h200] [--json OUT]

The command line of planning/pipeline.py (the candidates, their terms and bands). The fastest that fits memory
at each world size is marked "recommended" (none when none fits).
"""

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/pp_projection.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.pipeline import candidates, row
from runtime.cli import user_errors
from runtime.paths import check_outputs, config_inputs


@user_errors
def main(argv=None) -> dict:
    from benchmarks.step_projection import config_world, worlds_of
    from planning.devices import device_model
    from runtime.config_parser import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--compare", default="256,1024", help="comma-separated world sizes")
    p.add_argument("--device", default="h200", help="a device of planning/devices.py (h100, h200, h800, b200)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    worlds = worlds_of(args.compare)
    job = load_config(["--config", args.config])
    check_outputs([("--json", args.json)], config_inputs(args.config, job))
    device = device_model(args.device)
    rows = []
    for world in worlds:
        here = [row(run, device.memory_gib) for run in candidates(job, world, config_world(job, "--compare"), device)]
        fitting = [r for r in here if r["fits"]]
        if fitting:
            max(fitting, key=lambda r: r["tokens_per_gpu_s_band"][1])["recommended"] = True
        else:
            print(f"{world:5d} no PP candidate fits {device.memory_gib:.1f} GiB by the coarse memory model")
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
