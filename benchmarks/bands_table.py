"""The cross-validation and re-ranking tables of docs/performance.md, generated from the committed fit and results.

    python benchmarks/bands_table.py

Prints two markdown tables; docs/performance.md holds them verbatim (tests/unit/test_calibrate.py checks it, so the docs
cannot drift from the results):
  cross-validation  each published run of planning/calibration/cases/: measured tokens/s/GPU, the projection with
                    the parameters fitted on all the other runs (leave-one-out) and its ratio, and the ratio under the
                    fit on every run (planning/calibration/fitted.json, `benchmarks/calibrate.py --cross-validate`)
  re-ranking        per model, world size and device (H200, H100): the fastest dual-mesh row that fits by the memory
                    estimate (benchmarks/results/step_projection_<model>_<device>.json, the rows marked recommended)
                    and the fastest PP row that fits by the coarse memory model (pp_projection_<model>_<device>.json);
                    cells are tokens/s/GPU low / central / high (central MFU) from the cross-validated band
                    (planning/bands.py), and whether the two bands overlap (then the model cannot rank them)
"""

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/bands_table.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.bands import overlap
from planning.calibration.case import case_files, read_case
from planning.ep_traffic import describe_knobs
from planning.parameters import committed
from runtime.cli import user_errors

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCHMARKS, "results")
MODELS = {"kimi_k2": "Kimi K2", "deepseek_v3": "DeepSeek-V3"}
DEVICES = {"h200": "H200", "h100": "H100"}


def calibration_table() -> str:
    fit = committed()
    lines = ["| published run (case file) | measured tokens/s/GPU | projected, held out | ratio | ratio under the "
             "fit on all |", "|---|---|---|---|---|"]
    for path in case_files():
        name = os.path.basename(path)
        published = read_case(path)["published"]
        ratio = fit["cross_validation"]["ratios"][name]
        measured = published["tokens_per_gpu_s"]
        lines.append(f"| {published['name']} (`{name}`) | {measured:,.0f} | {ratio * measured:,.0f} | {ratio:.3f} | "
                     f"{fit['fitted_ratios'][name]:.3f} |")
    return "\n".join(lines)


def band(row: dict) -> str:
    low, central, high = row["tokens_per_gpu_s_band"]
    mfu = row["mfu_band"][1]
    return f"{low:,.0f} / {central:,.0f} / {high:,.0f} ({mfu:.1%})"


def dual_mesh_cell(row: dict | None) -> str:
    if row is None:
        return "none fits"
    knobs = describe_knobs(row["dispatch"]).strip("[]")
    layout = row["layout"].replace(" | ", ", ")  # a "|" would end the table cell
    return f"{band(row)}; {layout}; {knobs}; {row['estimate_gib']:.1f} GiB"


def pp_cell(row: dict | None) -> str:
    if row is None:
        return "none fits"
    return f"{band(row)}; {row['layout']}; {row['time_s']['memory_gib']:.0f} GiB (coarse)"


def verdict(dual: dict | None, pp: dict | None) -> str:
    if dual is None or pp is None:
        return "-"
    if overlap(dual["tokens_per_gpu_s_band"], pp["tokens_per_gpu_s_band"]):
        return "not distinguishable"
    return "PP faster" if pp["tokens_per_gpu_s_band"][0] > dual["tokens_per_gpu_s_band"][2] else "dual-mesh faster"


def _rows(kind: str, model: str, device: str) -> list[dict]:
    with open(os.path.join(RESULTS, f"{kind}_{model}_{device}.json")) as f:
        return json.load(f)["rows"]


def reranking_table() -> str:
    lines = ["| model @ GPUs, card | fastest dual-mesh row that fits (memory estimate): band (MFU); layout; dispatch; "
             "memory | fastest PP row that fits (coarse memory): band (MFU); layout; memory | the two |",
             "|---|---|---|---|"]
    for model, title in MODELS.items():
        for device, card in DEVICES.items():
            rows, pp_rows = _rows("step_projection", model, device), _rows("pp_projection", model, device)
            for world in sorted({r["world"] for r in rows}):
                dual = next((r for r in rows if r["world"] == world and r.get("recommended")), None)
                pp = next((r for r in pp_rows if r["world"] == world and r.get("recommended")), None)
                lines.append(f"| {title} @ {world}, {card} | {dual_mesh_cell(dual)} | {pp_cell(pp)} | "
                             f"{verdict(dual, pp)} |")
    return "\n".join(lines)


@user_errors  # a missing or unreadable result or case file: one line, exit 2
def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    print(calibration_table())
    print()
    print(reranking_table())


if __name__ == "__main__":
    main()
