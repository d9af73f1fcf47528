"""Rows, table, JSON and plot of the optimizer-step benchmark (rank 0 only, no process group calls).

Per method (JSON keys):
  step_ms                  median step time, slowest rank (step_ms_min: the fastest of the steps)
  ns_gflop_per_rank_max    measured matmul GFLOP of the busiest rank in one step (mean: over all ranks)
  bytes_per_rank_max       measured bytes sent + received by the busiest rank in one step
  ns_gflops_achieved       ns_gflop_per_rank_max / step time: the busiest rank's NS rate
  ns_efficiency            that rate / the machine's NS rate on the same blocks (same dtype)
  check                    max relative error of the parameter change vs the reference, tolerance
speedup_vs[name] = step_ms[name] / step_ms["sharded"] for every method that passed its check.
"""

import json

from benchmarks.lib.harness import median

COLUMNS = ("method", "step ms", "min ms", "NS GF/rank max", "mean", "MB/rank max", "NS GF/s", "of machine", "check")


def method_row(method, times: list, counts: list, check: dict, machine_gflops: float) -> dict:
    flops = [c.flops for c in counts]
    step_s = median(times)
    achieved = max(flops) / step_s / 1e9 if step_s > 0 else 0.0
    row = {
        "step_ms": step_s * 1e3,
        "step_ms_min": min(times) * 1e3,  # interference on a shared machine only adds time
        "step_ms_all": [t * 1e3 for t in times],
        "ns_gflop_per_rank_max": max(flops) / 1e9,
        "ns_gflop_per_rank_mean": sum(flops) / len(flops) / 1e9,
        "bytes_per_rank_max": max(c.bytes_total for c in counts),
        "bytes_sent_per_rank_max": max(c.bytes_sent for c in counts),
        "bytes_received_per_rank_max": max(c.bytes_received for c in counts),
        "collectives_per_rank_max": max(c.collectives for c in counts),
        "ns_gflops_achieved": achieved,
        "machine_ns_gflops": machine_gflops,
        "ns_efficiency": achieved / machine_gflops if machine_gflops > 0 else 0.0,
        "ns_dtype": str(method.ns_dtype).replace("torch.", ""),
        "uncounted_collectives": sorted({name for c in counts for name in c.uncounted}),
        "check": check,
        "note": method.note,
    }
    if method.planned is not None:
        row["planned_ns_gflop_per_rank_max"] = float(method.planned.stats.flops.max()) / 1e9
        row["planned_load_ratio"] = float(method.planned.stats.load_ratio)
        st = method.planned.stats
        row["planned_bytes_per_rank_max"] = int((st.sent_intra + st.sent_inter + st.recv_intra + st.recv_inter).max())
    return row


def speedups(rows: dict) -> dict:
    """How many times faster `sharded` is than each other method that passed its check."""
    ours = rows.get("sharded", {})
    if "step_ms" not in ours or not ours["check"]["ok"]:
        return {}
    return {name: row["step_ms"] / ours["step_ms"] for name, row in rows.items()
            if name != "sharded" and "step_ms" in row and row["check"]["ok"]}


def table(name: str, data: dict, world: int) -> str:
    blocks = ", ".join(f"{n} x {shape}" for shape, n in data["blocks"].items())
    lines = [f"== {name}: {world} ranks, blocks: {blocks}", _fmt(COLUMNS)]
    for method, row in data["methods"].items():
        if "skipped" in row:
            lines.append(f"{method:16s} skipped: {row['skipped']}")
            continue
        check = "ok" if row["check"]["ok"] else "FAILED"
        lines.append(_fmt((
            method, f"{row['step_ms']:.1f}", f"{row['step_ms_min']:.1f}", f"{row['ns_gflop_per_rank_max']:.3f}",
            f"{row['ns_gflop_per_rank_mean']:.3f}", f"{row['bytes_per_rank_max'] / 2**20:.2f}",
            f"{row['ns_gflops_achieved']:.2f}", f"{100 * row['ns_efficiency']:.0f}%",
            f"{check} ({row['check']['max_rel_err']:.1e})",
        )) + (f"  {row['note']}" if row["note"] else "")
                     + (f"  bytes exclude {row['uncounted_collectives']}" if row["uncounted_collectives"] else ""))
    rates = ", ".join(f"{k} {v:.2f}" for k, v in data["matmul_gflops"].items())
    lines.append(f"machine NS rate on these blocks (GFLOP/s per rank, all ranks busy): {rates}")
    if data["speedup_vs"]:
        lines.append("sharded is faster than: " + ", ".join(f"{k} {v:.2f}x" for k, v in data["speedup_vs"].items()))
    return "\n".join(lines)


def _fmt(cells) -> str:
    widths = (16, 9, 8, 15, 8, 12, 8, 11, 18)
    return " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def emit(results: dict, json_path=None, plot_path=None) -> None:
    print(f"optimizer step benchmark: {results['world_size']} ranks on {results['device']}, "
          f"{results['threads_per_rank']} thread(s) per rank, NS in {results['ns_dtype']}, "
          f"median of {results['steps']} steps")
    for name, data in results["shape_sets"].items():
        print(table(name, data, results["world_size"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"wrote {json_path}")
    if plot_path:
        plot(results, plot_path)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path} (pip install matplotlib)")
        return
    sets = results["shape_sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, (name, data) in zip(axes[0], sets.items()):
        rows = {m: r for m, r in data["methods"].items() if "step_ms" in r}
        colors = ["tab:green" if m.startswith("sharded") else "tab:gray" for m in rows]
        values = [r["step_ms"] for r in rows.values()]
        bars = ax.bar(list(rows), values, color=colors)
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(f"{name}, {results['world_size']} ranks ({results['device']})")
        ax.set_ylabel("optimizer step, ms (median, log scale)")
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 4, max(values) * 2)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
