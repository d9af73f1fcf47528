"""Project one published training run with the calibrated step model and compare it with what was measured.

    python benchmarks/calibrate.py --case benchmarks/calibration/CASE.toml [--json OUT]

A case file (keys: docs/performance.md#calibration; one file per published run in benchmarks/calibration/):
    [published]  name, source (URL), tokens_per_gpu_s
    [cluster]    device (benchmarks/lib/device_model.DEVICES), gpus, gpus_per_node
    [model]      preset (models/presets.py), and optionally ModelConfig fields that the run's model sets
                 differently (n_expert_groups, n_limited_groups, ...) and mtp_layers (multi-token prediction)
    [step]       seq_len, global_batch (sequences), micro_batch, gemm_precision "bf16"|"fp8",
                 dispatcher "nccl"|"deepep", activation_checkpoint "none"|"selective"|"full",
                 routing "balanced" or a skew factor (float >= 1: the busiest expert rank over the mean)
    [layout]     tp, pp, virtual_stages, pp_schedule "1f1b"|"interleaved"|"dualpipe", ep, etp, cp,
                 dp_sharding "fsdp"|"zero1" (data-parallel degree = gpus / (tp x pp x cp))
Writes projected_tokens_per_gpu_s, measured_tokens_per_gpu_s, ratio (projected / measured) and the time
split (benchmarks/lib/layout_step.py). The device and network parameters are the same for every case
(benchmarks/lib/network_model.py): nothing in a case file tunes the model. A bad case file is one line,
exit 2.
"""

import argparse
import json
import os
import sys
import tomllib

if __package__ in (None, ""):  # `python benchmarks/calibrate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.lib import layout_step, network_model
from runtime.cli import user_errors
from runtime.paths import check_outputs

# section -> {key: (type, default or REQUIRED)}
REQUIRED = object()
KEYS = {
    "published": {"name": (str, REQUIRED), "source": (str, REQUIRED), "tokens_per_gpu_s": (float, REQUIRED)},
    "cluster": {"device": (str, REQUIRED), "gpus": (int, REQUIRED), "gpus_per_node": (int, 8)},
    "model": {"preset": (str, REQUIRED), "mtp_layers": (int, 0)},
    "step": {"seq_len": (int, REQUIRED), "global_batch": (int, REQUIRED), "micro_batch": (int, REQUIRED),
             "gemm_precision": (str, "bf16"), "dispatcher": (str, "nccl"), "activation_checkpoint": (str, "none"),
             "routing": ((str, float), "balanced")},
    "layout": {"tp": (int, 1), "pp": (int, 1), "virtual_stages": (int, 1), "pp_schedule": (str, "1f1b"),
               "ep": (int, 1), "etp": (int, 1), "cp": (int, 1), "dp_sharding": (str, "fsdp")},
}
CHOICES = {("step", "gemm_precision"): layout_step.PRECISIONS, ("step", "dispatcher"): network_model.DISPATCHERS,
           ("step", "activation_checkpoint"): layout_step.CHECKPOINTING,
           ("layout", "pp_schedule"): layout_step.SCHEDULES, ("layout", "dp_sharding"): ("fsdp", "zero1")}


def read_case(path: str) -> dict:
    """{section: {key: value}} with defaults filled in; ValueError naming the file and the dotted key."""
    with open(path, "rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not TOML: {e}") from None
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {unknown}; expected {sorted(KEYS)}")
    return {section: read_section(path, section, raw.get(section, {})) for section in KEYS}


def read_section(path: str, section: str, raw: dict) -> dict:
    out = {}
    for key, (kind, default) in KEYS[section].items():
        if key not in raw:
            if default is REQUIRED:
                raise ValueError(f"{path}: missing key {section}.{key}")
            out[key] = default
            continue
        value = raw[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise ValueError(f"{path}: {section}.{key} = {value!r} must be {' or '.join(k.__name__ for k in kinds)}")
        choices = CHOICES.get((section, key))
        if choices and value not in choices:
            raise ValueError(f"{path}: {section}.{key} = {value!r}: expected one of {', '.join(choices)}")
        out[key] = value
    extra = sorted(set(raw) - set(KEYS[section]))
    if extra and section != "model":  # [model] passes other keys to the preset (checked there)
        raise ValueError(f"{path}: unknown key(s) {[f'{section}.{k}' for k in extra]}")
    out |= {k: raw[k] for k in extra}
    return out


def skew_of(path: str, routing) -> float:
    if routing == "balanced":
        return 1.0
    if isinstance(routing, float) and routing >= 1.0:
        return routing
    raise ValueError(f"{path}: step.routing = {routing!r}: expected \"balanced\" or a skew factor >= 1.0")


def build_run(path: str, case: dict) -> layout_step.Run:
    from benchmarks.lib.device_model import device_model
    from models.presets import preset

    model = dict(case["model"])
    name, mtp = model.pop("preset"), model.pop("mtp_layers")
    try:
        config = preset(name, **model)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: [model]: {e}") from None
    device = device_model(case["cluster"]["device"])
    step, layout = case["step"], case["layout"]
    run = layout_step.Run(
        model=config, device=device, gpus=case["cluster"]["gpus"], gpus_per_node=case["cluster"]["gpus_per_node"],
        seq_len=step["seq_len"], global_batch=step["global_batch"], micro_batch=step["micro_batch"],
        gemm_precision=step["gemm_precision"], dispatcher=step["dispatcher"],
        activation_checkpoint=step["activation_checkpoint"], skew=skew_of(path, step["routing"]), mtp_layers=mtp,
        **layout)
    positive = {f"cluster.{k}": case["cluster"][k] for k in ("gpus", "gpus_per_node")}
    positive |= {f"step.{k}": step[k] for k in ("seq_len", "global_batch", "micro_batch")}
    positive |= {f"layout.{k}": v for k, v in layout.items() if isinstance(v, int)}
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{path}: {key} = {value} must be >= 1")
    try:
        layout_step.check_run(run)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return run


def project_case(path: str) -> dict:
    case = read_case(path)
    terms = layout_step.step_terms(build_run(path, case))
    measured = case["published"]["tokens_per_gpu_s"]
    return {"case": path, "name": case["published"]["name"], "source": case["published"]["source"],
            "projected_tokens_per_gpu_s": terms["tokens_per_gpu_s"], "measured_tokens_per_gpu_s": measured,
            "ratio": terms["tokens_per_gpu_s"] / measured, "time_s": terms}


@user_errors
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", required=True, help="a case file (benchmarks/calibration/*.toml)")
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
