"""The calibration and band tables of docs/performance.md, generated from the case files and the result files.

    python benchmarks/bands_table.py

Prints two markdown tables; docs/performance.md holds them verbatim (tests/unit/test_calibrate.py checks it, so
the docs cannot drift from the results):
  calibration  each published run of benchmarks/calibration/ (held-out ones marked): measured and projected
               tokens/s/GPU and their ratio (benchmarks/calibrate.py)
  re-ranking   per model and world size: the recommended dual-mesh row of
               benchmarks/results/step_projection_<model>_bf16_calibrated.json (the fastest that fits an H200
               by launch/estimate_memory.py; at 256 GPUs the shipped config's), the fastest row when that one
               does not fit, and the PP16 rows with EP8 of pp_projection_<model>.json; cells are tokens/s/GPU
               low / central / high (central MFU)
"""

import argparse
import glob
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/bands_table.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import calibrate
from benchmarks.lib.ep_projection import describe_knobs
from runtime.cli import user_errors

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCHMARKS, "results")
MODELS = {"kimi_k2": "Kimi K2", "deepseek_v3": "DeepSeek-V3"}
PP_ROWS = ("pp16 1f1b ep8 ", "pp16 dualpipe ep8 ")  # the layouts Moonshot and DeepSeek ran, EP inside a node


def case_files() -> list[tuple[str, bool]]:
    """[(case file, held out)]: benchmarks/calibration/*.toml, then benchmarks/calibration/held_out/*.toml."""
    root = os.path.join(BENCHMARKS, "calibration")
    return ([(p, False) for p in sorted(glob.glob(os.path.join(root, "*.toml")))]
            + [(p, True) for p in sorted(glob.glob(os.path.join(root, "held_out", "*.toml")))])


def calibration_table() -> str:
    lines = ["| published run (case file) | measured tokens/s/GPU | projected | ratio |", "|---|---|---|---|"]
    for path, held_out in case_files():
        r = calibrate.project_case(path)
        name = os.path.relpath(path, os.path.join(BENCHMARKS, "calibration"))
        mark = " **held out**" if held_out else ""
        lines.append(f"| {r['name']} (`{name}`){mark} | {r['measured_tokens_per_gpu_s']:,.0f} | "
                     f"{r['projected_tokens_per_gpu_s']:,.0f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def band(row: dict) -> str:
    low, central, high = row["tokens_per_gpu_s_band"]
    mfu = row["mfu_band"][1] if "mfu_band" in row else row["time_s"]["mfu_bf16"]
    return f"{low:,.0f} / {central:,.0f} / {high:,.0f} ({mfu:.1%})"


def dual_mesh_cell(row: dict) -> str:
    knobs = describe_knobs(row["dispatch"]).strip("[]")
    memory = f"{row['estimate_gib']:.1f} GiB" if "estimate_gib" in row else "not estimated"
    layout = row["layout"].replace(" | ", ", ")  # a "|" would end the table cell
    return f"{band(row)}; {layout}; {knobs}; {memory}"


def reranking_table() -> str:
    lines = ["| model @ GPUs | recommended dual-mesh row: band (MFU); layout; dispatch; memory estimate "
             "| fastest dual-mesh row, when it does not fit | PP16 1F1B, EP8 | PP16 DualPipe, EP8 |",
             "|---|---|---|---|---|"]
    for model, title in MODELS.items():
        with open(os.path.join(RESULTS, f"step_projection_{model}_bf16_calibrated.json")) as f:
            rows = json.load(f)["rows"]
        with open(os.path.join(RESULTS, f"pp_projection_{model}.json")) as f:
            pp_rows = json.load(f)["rows"]
        for world in sorted({r["world"] for r in rows}):
            mine = [r for r in rows if r["world"] == world]
            (best,) = [r for r in mine if r.get("recommended")]
            fastest = min(mine, key=lambda r: r["time_s"]["step"])
            faster = "-" if fastest is best else dual_mesh_cell(fastest)
            pp = [next(band(r) for r in pp_rows if r["world"] == world and r["layout"].startswith(name))
                  for name in PP_ROWS]
            lines.append(f"| {title} @ {world} | {dual_mesh_cell(best)} | {faster} | {pp[0]} | {pp[1]} |")
    return "\n".join(lines)


@user_errors  # a missing or unreadable result or case file: one line, exit 2
def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    print(calibration_table())
    print()
    print(reranking_table())


if __name__ == "__main__":
    main()
