"""Project one published training run with the calibrated step model and compare it with what was measured.

    python benchmarks/calibrate.py --case planning/calibration/cases/CASE.toml [--json OUT]

The command line of planning/calibration/ (the case format: planning/calibration/case.py; keys:
docs/performance.md#calibration). Writes projected_tokens_per_gpu_s, measured_tokens_per_gpu_s, ratio
(projected / measured) and the time split (planning/step.py). A bad case file is one line, exit 2.
"""

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/calibrate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.calibration.case import project_case
from runtime.cli import user_errors
from runtime.paths import check_outputs


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", required=True, help="a case file (planning/calibration/cases/*.toml)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    check_outputs([("--json", args.json)], [("--case", args.case)])
    out = project_case(args.case)
    t = out["time_s"]
    print(f"{out['name']}: projected {out['projected_tokens_per_gpu_s']:.0f} tokens/s/GPU, measured "
          f"{out['measured_tokens_per_gpu_s']:.0f}, ratio {out['ratio']:.3f}")
    print("step {step:.2f} s: compute {compute:.2f} (contended {compute_contended:.2f}), ep {ep:.2f}"
          " (overlapped: {ep_overlapped}), tp {tp:.2f}, fsdp {fsdp:.2f} (exposed {fsdp_exposed:.2f}), zero1 {zero1:.2f},"
          " bubble {bubble:.2f}, syncs {syncs:.3f}".format(**t))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
