"""Build each benchmarked optimizer on its own copy of a parameter set.

Every method gets fresh parameters (same values, same fixed gradients) and exposes `.step()` and
`.params` (fqn -> the parameter it updates: a sharded DTensor, or for `single` a full tensor on
rank 0). A method that cannot run here is returned as `Skipped(reason)`.
"""

from dataclasses import dataclass

import torch

from benchmarks.lib import baselines, torchtitan_muon
from benchmarks.lib.param_sets import ParamSet, clone_params
from optim.config import OptimConfig

METHODS = ("sharded", "sharded_sync", "gather_all", "owner_allgather", "torchtitan", "single")


@dataclass
class Skipped:
    reason: str


@dataclass
class Method:
    name: str
    step: object  # () -> None
    params: dict  # fqn -> parameter this method updates
    note: str = ""  # shown in the table and the JSON
    ns_dtype: torch.dtype = torch.float32  # what its Newton-Schulz runs in (for its yardstick)
    planned: object = None  # sharded only: the plan (per-rank NS FLOPs and bytes it predicts)


def build_method(name: str, param_set: ParamSet, config: OptimConfig, bucket_mb: float):
    """Method or Skipped; collective (every rank must build the same methods in the same order)."""
    params = clone_params(param_set)
    splits = param_set.splits
    if name in ("sharded", "sharded_sync"):
        return _sharded(name, params, splits, config, bucket_mb)
    if name == "gather_all":
        return Method(name, baselines.GatherAll(params, splits, config).step, params)
    if name == "owner_allgather":
        return Method(name, baselines.OwnerAllGather(params, splits, config).step, params)
    if name == "torchtitan":
        return _torchtitan(params, splits, config)
    if name == "single":
        single = baselines.Single(params, splits, config)
        return Method(name, single.step, single.params if single.opt is not None else {},
                      note="rank 0 only, full tensors", ns_dtype=config.ns_torch_dtype())
    raise ValueError(f"unknown method {name!r}; expected one of {METHODS}")


def _sharded(name, params, splits, config, bucket_mb):
    try:
        from optim.sharded.muon import ShardedMuon
    except ImportError as err:
        return Skipped(f"optim.sharded.muon not importable: {err}")
    opt = ShardedMuon(list(params.items()), splits, config, bucket_mb=bucket_mb, overlap=(name == "sharded"))
    note = "" if name == "sharded" else "overlap=False"
    return Method(name, opt.step, params, note=note, ns_dtype=config.ns_torch_dtype(),
                  planned=getattr(opt, "plan", None))


def _torchtitan(params, splits, config):
    module, reason = torchtitan_muon.import_dist_muon()
    if module is None:
        return Skipped(reason)
    if config.coefficients != "jordan" or config.lr_adjust != "rms":
        return Skipped(f"DistMuon has one (a, b, c) tuple and 'match_rms_adamw'; asked for "
                       f"coefficients={config.coefficients!r}, lr_adjust={config.lr_adjust!r}")
    if all(torchtitan_muon.compute_layout(p, splits[f])[0] is None for f, p in params.items()):
        return Skipped("no parameter DistMuon can express (nothing is sharded?)")
    opt, skipped = torchtitan_muon.build(params, splits, lr=config.lr, weight_decay=config.weight_decay,
                                         momentum=config.momentum, nesterov=config.nesterov)
    device = next(iter(params.values())).to_local().device
    notes = ["NS in bf16 (always)"]
    if device.type == "cpu":
        notes.append("CPU shim: device check + stream creation patched, maths unchanged")
    if skipped:
        notes.append(f"{len(skipped)} of {len(params)} params not expressible ({sorted(set(skipped.values()))[0]})")
    kept = {fqn: p for fqn, p in params.items() if fqn not in skipped}
    return Method("torchtitan", opt.step, kept, note="; ".join(notes), ns_dtype=torch.bfloat16)
