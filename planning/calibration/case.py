"""A case file: one published training run, written from its source, that the step model (planning/step.py)
projects and compares with what was measured (benchmarks/calibrate.py is the command line; the cases live in
planning/calibration/cases/, each with a comment saying what its source states and what was assumed).

    [published]  name, source (URL), tokens_per_gpu_s (a finite number > 0)
    [cluster]    device (planning/devices.py DEVICES), gpus, gpus_per_node
    [model]      preset (models/presets.py) and any ModelConfig field the run's model sets differently (a model
                 without a preset, e.g. Qwen3, gives its whole shape this way), and mtp_layers
    [step]       seq_len, global_batch (sequences), micro_batch, gemm_precision "bf16"|"fp8"|"fp8_experts",
                 dispatch_precision "bf16"|"fp8" (default: "fp8" when gemm_precision is "fp8", else "bf16"),
                 dispatcher "nccl"|"deepep", activation_checkpoint "none"|"selective"|"full",
                 ep_overlap "none"|"microbatch" ("dualpipe" implies microbatch),
                 routing "balanced" (the model's router on random inputs, as forced-balance benchmarks route),
                 "aligned_blocks" (token t to experts K t..K t+K-1: NeMo AutoModel's fake balanced gate) or a skew
                 factor (float >= 1: balanced, the busiest expert rank at that multiple of the mean)
    [layout]     tp, pp, virtual_stages, pp_schedule "1f1b"|"interleaved"|"dualpipe", ep, etp, cp,
                 dp_sharding "fsdp"|"zero1", fsdp_gather "default"|"per_step"|"per_microbatch"
                 (data-parallel degree = gpus / (tp x pp x cp))
Nothing in a case file tunes the model: the device, network and fitted parameters are the same for every case.
A bad case file is a ValueError naming the file and the dotted key.
"""

import glob
import math
import os
import tomllib

from planning import network, step
from planning.devices import device_model

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases")


def case_files() -> list[str]:
    """Every committed case file, sorted."""
    return sorted(glob.glob(os.path.join(CASES, "*.toml")))


# section -> {key: (type, default or REQUIRED)}
REQUIRED = object()
KEYS = {
    "published": {"name": (str, REQUIRED), "source": (str, REQUIRED), "tokens_per_gpu_s": (float, REQUIRED)},
    "cluster": {"device": (str, REQUIRED), "gpus": (int, REQUIRED), "gpus_per_node": (int, 8)},
    "model": {"preset": (str, REQUIRED), "mtp_layers": (int, 0)},
    "step": {"seq_len": (int, REQUIRED), "global_batch": (int, REQUIRED), "micro_batch": (int, REQUIRED),
             "gemm_precision": (str, "bf16"), "dispatch_precision": (str, None), "dispatcher": (str, "nccl"),
             "activation_checkpoint": (str, "none"), "ep_overlap": (str, "none"),
             "routing": ((str, float), "balanced")},
    "layout": {"tp": (int, 1), "pp": (int, 1), "virtual_stages": (int, 1), "pp_schedule": (str, "1f1b"),
               "ep": (int, 1), "etp": (int, 1), "cp": (int, 1), "dp_sharding": (str, "fsdp"),
               "fsdp_gather": (str, "default")},
}
CHOICES = {("step", "gemm_precision"): step.PRECISIONS, ("step", "dispatch_precision"): step.DISPATCH_PRECISIONS,
           ("step", "dispatcher"): network.DISPATCHERS, ("step", "activation_checkpoint"): step.CHECKPOINTING,
           ("step", "ep_overlap"): step.EP_OVERLAPS, ("layout", "pp_schedule"): step.SCHEDULES,
           ("layout", "dp_sharding"): ("fsdp", "zero1"), ("layout", "fsdp_gather"): step.FSDP_GATHERS}


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
    case = {section: read_section(path, section, raw.get(section, {})) for section in KEYS}
    measured = case["published"]["tokens_per_gpu_s"]
    if not (math.isfinite(measured) and measured > 0):
        raise ValueError(f"{path}: published.tokens_per_gpu_s = {measured!r} must be a finite number > 0")
    return case


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


def routing_of(path: str, routing) -> tuple[str, float]:
    """(step.Run routing, skew) of the case's step.routing."""
    if routing in ("balanced", "aligned_blocks"):
        return ("sampled" if routing == "balanced" else routing), 1.0
    if isinstance(routing, float) and math.isfinite(routing) and routing >= 1.0:
        return "sampled", routing
    raise ValueError(f"{path}: step.routing = {routing!r}: expected \"balanced\", \"aligned_blocks\" or a skew "
                     f"factor >= 1.0")


def build_run(path: str, case: dict) -> step.Run:
    from models.presets import preset

    model = dict(case["model"])
    name, mtp = model.pop("preset"), model.pop("mtp_layers")
    try:
        config = preset(name, **model)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: [model]: {e}") from None
    try:
        device = device_model(case["cluster"]["device"])
    except ValueError as e:
        raise ValueError(f"{path}: cluster.device: {e}") from None
    keys, layout = case["step"], case["layout"]
    positive = {f"cluster.{k}": case["cluster"][k] for k in ("gpus", "gpus_per_node")}
    positive |= {f"step.{k}": keys[k] for k in ("seq_len", "global_batch", "micro_batch")}
    positive |= {f"layout.{k}": v for k, v in layout.items() if isinstance(v, int)}
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{path}: {key} = {value} must be >= 1")
    routing, skew = routing_of(path, keys["routing"])
    run = step.Run(
        model=config, device=device, gpus=case["cluster"]["gpus"], gpus_per_node=case["cluster"]["gpus_per_node"],
        seq_len=keys["seq_len"], global_batch=keys["global_batch"], micro_batch=keys["micro_batch"],
        gemm_precision=keys["gemm_precision"], dispatch_precision=keys["dispatch_precision"],
        dispatcher=keys["dispatcher"], activation_checkpoint=keys["activation_checkpoint"],
        ep_overlap=keys["ep_overlap"], routing=routing, skew=skew, mtp_layers=mtp, **layout)
    try:
        step.check_run(run)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return run


def load(path: str) -> tuple[dict, step.Run]:
    """(the case's sections, its Run); ValueError naming the file and key."""
    case = read_case(path)
    return case, build_run(path, case)


def memory_warning(path: str, run: step.Run) -> str | None:
    """A line when the layout's coarse memory (planning/step.memory_gib) exceeds the card's: the run as written
    could not have fit, so a key is probably wrong (the batch, the checkpointing, the sharding)."""
    need = step.memory_gib(run)
    if need <= run.device.memory_gib:
        return None
    return (f"warning: {path}: the layout needs about {need:.1f} GiB per GPU by the coarse memory model "
            f"(planning/step.memory_gib), more than the {run.device.memory_gib:.1f} GiB of a {run.device.name}: "
            f"check step.micro_batch, step.activation_checkpoint and layout.dp_sharding")


def project_case(path: str, efficiency=None) -> dict:
    """The case projected (with the committed fitted parameters unless `efficiency` is given) beside what
    was measured."""
    case, run = load(path)
    terms = step.step_terms(run, efficiency)
    measured = case["published"]["tokens_per_gpu_s"]
    warning = memory_warning(path, run)
    return {"case": path, "name": case["published"]["name"], "source": case["published"]["source"],
            "projected_tokens_per_gpu_s": terms["tokens_per_gpu_s"], "measured_tokens_per_gpu_s": measured,
            "ratio": terms["tokens_per_gpu_s"] / measured, "time_s": terms,
            "warnings": [warning] if warning else []}
