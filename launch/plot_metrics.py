"""Plot training curves: `python launch/plot_metrics.py RUN_DIR [RUN_DIR ...] --out curves.png`.

Reads each run's `metrics.jsonl` and draws, over optimizer steps: loss (solid) with the held-out eval
loss (markers), gradient norm, learning rate, tokens/s; for post-training runs (launch/posttrain.py) also
the RL loss, the feedback KL, the target tokens per step and the PPO clip fraction. Several runs are overlaid, one colour each,
labelled by their directory name (by their path where two share a name). Needs matplotlib
(`pip install -e ".[plot]"`). A run dir without records or an `--out` matplotlib cannot write (a
directory, no image extension, a missing directory) exits with status 2 and one line.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from launch.precheck import ToolParser  # noqa: E402
from runtime.cli import report  # noqa: E402
from runtime.paths import check_output_file  # noqa: E402

PANELS = (("loss", "loss (line) and eval loss (dots)"), ("grad_norm", "gradient norm"), ("lr", "learning rate"),
          ("tokens_per_s", "tokens / s"))
POSTTRAIN_PANELS = (("rl_loss", "RL loss (policy gradient)"), ("feedback_kl", "feedback KL (student || teacher)"),
                    ("target_tokens", "feedback target tokens / step"), ("clip_fraction", "PPO clip fraction"))


def read_metrics(run_dir: str) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl`: JSON objects with a "step" (a torn last line is
    skipped); ValueError, naming the file, if another line is not JSON (not a metrics file), if there
    are no records, or if no record has a finite loss (every step skipped: nothing to plot)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(run_dir):
        raise ValueError(f"{run_dir} is a file; give the run directory that holds metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (not a metrics file?)") from None
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            if number == len(lines):
                continue  # the torn last line of a run that was killed mid-write
            raise ValueError(f"{path} line {number} is not JSON (not a metrics file?)") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records (JSON lines with a \"step\")")
    if not any(isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]) for r in records):
        raise ValueError(f"{path}: none of its {len(records)} records has a finite loss (every step was "
                         f"non-finite): nothing to plot")
    return records


def labels(run_dirs: list[str]) -> list[str]:
    """Each run's directory name, or its path where two runs share a name (else one would hide the other)."""
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    return [name if names.count(name) == 1 else os.path.normpath(d) for name, d in zip(names, run_dirs)]


def check_out(out: str, run_dirs: list[str] = ()) -> None:
    """ValueError unless `out` is a file path with an image extension matplotlib writes, in an existing
    directory (matplotlib would append .png to a name without one, and write next to a directory), and
    not the metrics.jsonl of one of `run_dirs` (through a symlink or hard link: writing would destroy it)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    inputs = [(f"the metrics file of {d}", os.path.join(d, "metrics.jsonl")) for d in run_dirs]
    check_output_file("--out", out, "curves.png", inputs)
    if ext not in formats:
        raise ValueError(f"--out {out}: {'unsupported image extension .' + ext if ext else 'no image extension'} "
                         f"(use .png, or one of {', '.join(sorted(formats))})")


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite `key`."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def panels(runs: dict[str, list[dict]]) -> tuple:
    """The (key, title) panels: the post-training ones too when any run recorded an RL loss."""
    posttrain = any(r.get("rl_loss") is not None for records in runs.values() for r in records)
    return PANELS + POSTTRAIN_PANELS if posttrain else PANELS


def plot(runs: dict[str, list[dict]], out: str):
    """Write the figure to `out`; returns it."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    chosen = panels(runs)
    rows = len(chosen) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows), sharex=True)
    for (key, title), ax in zip(chosen, axes.flat):
        for i, (name, records) in enumerate(runs.items()):
            color = f"C{i}"
            steps, values = series(records, key)
            if steps:  # a pretraining run next to a post-training one has no RL series
                ax.plot(steps, values, color=color, label=name, linewidth=1)
            if key == "loss":
                ax.plot(*series(records, "eval_loss"), "o", color=color, markersize=4)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Plot loss, eval loss, grad norm, lr and tokens/s of runs.", prefix="error")
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--out", required=True, help="output PNG")
    args = parser.parse_args(argv)
    try:
        check_out(args.out, args.run_dirs)
        runs = {label: read_metrics(d) for label, d in zip(labels(args.run_dirs), args.run_dirs)}
        plot(runs, args.out)
    except ImportError:
        return report("plotting needs matplotlib (pip install -e '.[plot]')")
    except ValueError as e:
        return report(e)
    except OSError as e:
        return report(f"--out {args.out}: cannot write ({e.strerror or e})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
