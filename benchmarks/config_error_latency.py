"""Wall time from launch to a config typo's one-line error (exit 2), per entry point, against the time of
`python -c "import torch"` on the same machine.

Every run is a fresh interpreter, as a user starts it. Each round runs the yardstick (`import torch`) and
then each entry point with a typo, so a change of load on a shared machine hits both; medians over
`--repeats` rounds, after one untimed warm-up round (file cache). `ratio` = median(entry point) /
median(import torch); the entry points check their config before importing torch (launch/precheck.py).
`--repo DIR` times the scripts of another checkout (e.g. an export of an older commit) the same way.

    python benchmarks/config_error_latency.py [--repeats 7] [--repo DIR] [--json PATH]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/config_error_latency.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.cli import user_errors  # noqa: E402
from runtime.paths import check_output_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARDSTICK = ["-c", "import torch"]
# (script, arguments with a typo): an unknown section or key, a bad value, a bad flag value
TYPOS = [
    ("launch/pretrain.py", ["--trainng.steps=3"]),
    ("launch/posttrain.py", ["--config", "configs/posttrain_example.toml", "--posttrain.top_k=x"]),
    ("launch/dry_run.py", ["--config", "configs/kimi_k2_256gpu.toml", "--parallel.epp=2"]),
    ("launch/estimate_memory.py", ["--config", "configs/kimi_k2_256gpu.toml", "--optim.lr=-1"]),
    ("launch/evaluate.py", ["--model", "RUN", "--holdout", "1.5"]),
    ("launch/generate.py", ["--model", "RUN", "--temprature", "0"]),
]


def timed(argv: list[str], cwd: str, expected_status: int) -> tuple[float, str]:
    """(seconds, last stderr line) of one fresh `python argv`; RuntimeError on another exit status."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    last = (result.stderr.strip().splitlines() or [""])[-1]
    if result.returncode != expected_status:
        raise RuntimeError(f"{' '.join(argv)}: exit {result.returncode}, expected {expected_status}: {last}")
    return seconds, last


def measure(repo: str, repeats: int) -> dict:
    """Runs of the yardstick and of every entry point's typo, interleaved round by round."""
    runs = {"import torch": [], **{script: [] for script, _ in TYPOS}}
    lines = {}
    cwd = os.path.join(repo, "launch")  # nothing is written: every run stops at its check
    for round_ in range(repeats + 1):
        seconds, _ = timed(YARDSTICK, cwd, 0)
        if round_:
            runs["import torch"].append(seconds)
        for script, argv in TYPOS:
            args = [os.path.join(repo, a) if a.startswith(("configs/", "launch/")) else a for a in [script, *argv]]
            seconds, lines[script] = timed(args, cwd, 2)
            if round_:
                runs[script].append(seconds)
    base = statistics.median(runs["import torch"])
    rows = [{"script": script, "argv": argv, "error": lines[script], "median_s": statistics.median(runs[script]),
             "ratio": statistics.median(runs[script]) / base, "runs_s": runs[script]} for script, argv in TYPOS]
    return {"import_torch": {"median_s": base, "runs_s": runs["import torch"]}, "rows": rows}


@user_errors
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (one warm-up round more)")
    ap.add_argument("--repo", default=REPO, help="the checkout whose launch/ scripts are timed")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be >= 1")
    if not os.path.isfile(os.path.join(args.repo, "launch", "pretrain.py")):
        raise ValueError(f"--repo {args.repo}: no launch/pretrain.py there")
    if args.json:
        check_output_file("--json", args.json, "config_error_latency.json")
    load_before = os.getloadavg()
    result = {"repo": os.path.abspath(args.repo), "python": platform.python_version(), "cpus": os.cpu_count(),
              "repeats": args.repeats, "loadavg_before": load_before, **measure(args.repo, args.repeats),
              "loadavg_after": os.getloadavg()}
    print(f"import torch: median {result['import_torch']['median_s']:.3f} s  (load average {load_before[0]:.1f})")
    for row in result["rows"]:
        print(f"{row['script']:<28} median {row['median_s']:.3f} s  {row['ratio']:.2f}x import torch  {row['error'][:70]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
