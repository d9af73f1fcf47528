"""Plot training curves: `python launch/plot_metrics.py RUN_DIR [RUN_DIR ...] --out curves.png`.

Reads each run's `metrics.jsonl` and draws, over optimizer steps: loss (solid) with the held-out eval
loss (markers), gradient norm, learning rate, tokens/s. Several runs are overlaid, one colour each,
labelled by their directory name. Needs matplotlib (`pip install -e ".[plot]"`).
"""

import argparse
import json
import os
import sys

PANELS = (("loss", "loss (line) and eval loss (dots)"), ("grad_norm", "gradient norm"), ("lr", "learning rate"),
          ("tokens_per_s", "tokens / s"))


def read_metrics(run_dir: str) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl` (a torn last line is skipped); ValueError if there are none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite `key`."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot(runs: dict[str, list[dict]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for (key, title), ax in zip(PANELS, axes.flat):
        for i, (name, records) in enumerate(runs.items()):
            color = f"C{i}"
            ax.plot(*series(records, key), color=color, label=name, linewidth=1)
            if key == "loss":
                ax.plot(*series(records, "eval_loss"), "o", color=color, markersize=4)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss, eval loss, grad norm, lr and tokens/s of runs.")
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--out", required=True, help="output PNG")
    args = parser.parse_args(argv)
    try:
        runs = {os.path.basename(os.path.normpath(d)) or d: read_metrics(d) for d in args.run_dirs}
        plot(runs, args.out)
    except ImportError:
        print("error: plotting needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
