"""Project published training runs with the calibrated step model and compare them with what was measured.

    python benchmarks/calibrate.py --case planning/calibration/cases/CASE.toml [--json OUT]
    python benchmarks/calibrate.py --cross-validate [--json OUT] [--write]

The command line of planning/calibration/ (the case format: planning/calibration/case.py; keys:
docs/performance.md#calibration).
  --case            one case with the committed fitted parameters (planning/calibration/fitted.json): writes
                    projected_tokens_per_gpu_s, measured_tokens_per_gpu_s, ratio (projected / measured), the time
                    split (planning/step.py) and `warnings` (a layout the coarse memory model puts above the card)
  --cross-validate  every committed case (planning/calibration/cases/*.toml): the five parameters fitted on all of
                    them, and each case projected with the parameters fitted on all the others (leave-one-out):
                    per case measured, projected held-out, ratio, and the fitted ratio; the summary the tests hold
                    (median |ln ratio|, share within +-25%, lowest, highest). --write records it in
                    planning/calibration/fitted.json, which every projection reads.
A bad case file is one line, exit 2.
"""

import argparse
import json
import math
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/calibrate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.calibration.case import case_files, load, project_case
from planning.calibration.fit import committed_form, cross_validate, summary
from planning.parameters import FITTED_JSON
from runtime.cli import user_errors
from runtime.paths import check_outputs


def one_case(path: str) -> dict:
    out = project_case(path)
    t = out["time_s"]
    for warning in out["warnings"]:
        print(warning, file=sys.stderr)
    print(f"{out['name']}: projected {out['projected_tokens_per_gpu_s']:.0f} tokens/s/GPU, measured "
          f"{out['measured_tokens_per_gpu_s']:.0f}, ratio {out['ratio']:.3f}")
    print("step {step:.2f} s: compute {compute:.2f} (contended {compute_contended:.2f}), ep {ep:.2f}"
          " (overlapped: {ep_overlapped}), tp {tp:.2f}, fsdp {fsdp:.2f} (exposed {fsdp_exposed:.2f}), zero1 {zero1:.2f},"
          " bubble {bubble:.2f}, syncs {syncs:.3f}".format(**t))
    return out


def every_case(write: bool) -> dict:
    paths = case_files()
    cv = cross_validate(paths)
    rows = []
    print(f"{'case':50s} {'measured':>9s} {'held out':>9s} {'ratio':>6s} {'fitted':>7s}")
    for path in paths:
        name = os.path.basename(path)
        case, _ = load(path)
        measured = case["published"]["tokens_per_gpu_s"]
        ratio = cv["ratios"][name]
        rows.append({"case": name, "name": case["published"]["name"], "measured_tokens_per_gpu_s": measured,
                     "projected_tokens_per_gpu_s": ratio * measured, "ratio": ratio,
                     "fitted_ratio": cv["fitted_ratios"][name], "log_ratio": math.log(ratio)})
        print(f"{name:50s} {measured:9.0f} {ratio * measured:9.0f} {ratio:6.3f} {cv['fitted_ratios'][name]:7.3f}")
    held, fitted = summary(cv["ratios"]), summary(cv["fitted_ratios"])
    print("parameters fitted on every case: " + ", ".join(f"{k} {v:.4g}" for k, v in cv["efficiency"].items()))
    print("leave-one-out: median |ln ratio| {median_abs_log:.3f}, within +-25% {within_25_percent:.0%}, "
          "lowest {lowest:.3f}, highest {highest:.3f}".format(**held))
    if write:
        with open(FITTED_JSON, "w") as f:
            json.dump(committed_form(cv), f, indent=1)
            f.write("\n")
        print(f"wrote {FITTED_JSON}")
    return {"cases": rows, "efficiency": cv["efficiency"], "folds": cv["folds"], "leave_one_out": held,
            "fitted": fitted}


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--case", help="a case file (planning/calibration/cases/*.toml)")
    what.add_argument("--cross-validate", action="store_true",
                      help="leave-one-out over every committed case (planning/calibration/cases/)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--write", action="store_true",
                   help="with --cross-validate: record the fit in planning/calibration/fitted.json")
    args = p.parse_args(argv)
    if args.write and not args.cross_validate:
        raise ValueError("--write: only with --cross-validate (it records the fit of every committed case)")
    check_outputs([("--json", args.json)], [("--case", args.case)] if args.case else [])
    out = one_case(args.case) if args.case else every_case(args.write)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
