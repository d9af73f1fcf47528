"""Whether the committed recommendations still hold: the step projection rerun at 256 H200s against
`benchmarks/results/step_projection_<model>_h200.json` and the shipped `configs/<model>_256gpu.toml`.

    python benchmarks/recommended_rows.py [--models kimi_k2,deepseek_v3] [--json PATH]

For each model: benchmarks/step_projection.py with the command of
docs/performance.md#re-ranked-on-the-cross-validated-bands (`--compare 256 --device h200 --act-dtype bfloat16
--param-dtype bfloat16 --memory-estimate`, its table not printed), then its recommended row (the fastest that
fits an H200 by the memory estimate) against the committed JSON's recommended row (layout, dispatch, step time,
memory estimate), and the config's own row: its layout and dispatch are the config's, and its cross-validated
band overlaps the recommended row's (planning/bands.py: the projection cannot tell them apart). Prints every
difference; exit 1 if there is one. About 2-3 minutes per model on 2 CPU cores, so the test suite does not run
it (tests/unit/test_config.py projects only the config's own row): run it after changing the step model, the
memory estimate or a shipped config, and regenerate the JSON where it differs.
"""

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.cli import user_errors
from runtime.paths import check_outputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("kimi_k2", "deepseek_v3")
WORLD = 256
COMPARED = ("layout", "dispatch", "estimate_fits", "estimate_gib")  # and the step time, relatively
STEP_RTOL = 1e-9  # the projection is deterministic arithmetic: any change of the model moves it further


def committed_rows(model: str, card: str = "h200") -> tuple[dict, dict | None]:
    """(the config's own row, the recommended row or None when no row fits) at WORLD of the committed JSON."""
    path = os.path.join(REPO, "benchmarks", "results", f"step_projection_{model}_{card}.json")
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["world"] == WORLD]
    (config,) = [r for r in rows if r["name"] == "config"]
    recommended = [r for r in rows if r.get("recommended")]
    return config, (recommended[0] if recommended else None)


def fresh_rows(model: str) -> tuple[dict, dict]:
    """(the config's own row, the recommended row) at WORLD of the projection rerun now (JSON round trip: tuples
    become lists)."""
    from benchmarks import step_projection

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        with contextlib.redirect_stdout(io.StringIO()):
            step_projection.main(["--config", os.path.join(REPO, "configs", f"{model}_256gpu.toml"),
                                  "--compare", str(WORLD), "--device", "h200", "--act-dtype", "bfloat16",
                                  "--param-dtype", "bfloat16", "--memory-estimate", "--json", out])
        with open(out) as f:
            rows = [r for r in json.load(f)["rows"] if r["world"] == WORLD]
    (config,) = [r for r in rows if r["name"] == "config"]
    (recommended,) = [r for r in rows if r.get("recommended")]
    return config, recommended


def config_row(model: str) -> dict:
    """The shipped config's own layout and dispatch knobs, as the projection describes them."""
    from planning.dual_mesh import describe
    from planning.ep_traffic import dispatch_knobs
    from runtime.config_parser import load_config

    layout = load_config(["--config", os.path.join(REPO, "configs", f"{model}_256gpu.toml")]).layout(WORLD)
    return {"layout": describe(layout), "dispatch": json.loads(json.dumps(dispatch_knobs(layout)))}


def differences(fresh: dict, committed: dict, config_row: dict, config: dict) -> list[str]:
    """One line per difference: the fresh recommendation against the committed one, and the config's own row
    (`config_row`) against the config's layout and the recommendation's band."""
    from planning.bands import overlap

    out = [f"{key}: {committed.get(key)!r} committed, {fresh.get(key)!r} now" for key in COMPARED
           if fresh.get(key) != committed.get(key)]
    step, was = fresh["time_s"]["step"], committed["time_s"]["step"]
    if not math.isclose(step, was, rel_tol=STEP_RTOL):
        out.append(f"step time: {was!r} s committed, {step!r} s now")
    out += [f"{key}: {config[key]!r} in the config, {config_row.get(key)!r} in its row" for key in ("layout", "dispatch")
            if config_row.get(key) != config[key]]
    if not overlap(config_row["tokens_per_gpu_s_band"], fresh["tokens_per_gpu_s_band"]):
        out.append(f"config band: {config_row['tokens_per_gpu_s_band']} does not overlap the recommended row's "
                   f"{fresh['tokens_per_gpu_s_band']}")
    return out


@user_errors
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--json", default=None, help="write {model: [differences]} here")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    check_outputs([("--json", args.json)])
    found = {}
    for model in models:
        config, recommended = fresh_rows(model)
        found[model] = differences(recommended, committed_rows(model)[1], config, config_row(model))
        print(f"{model} @ {WORLD}: " + ("; ".join(found[model]) if found[model] else "the committed row and the config hold"),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
