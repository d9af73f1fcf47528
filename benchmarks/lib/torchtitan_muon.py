"""torchtitan 0.3.0's DistMuon on the benchmark's parameters (the `torchtitan` method).

DistMuon needs a hand-written compute layout per parameter and hand-written buckets; we derive
them from our splits, the way a torchtitan user would write them:
  whole      ComputeLayout({shard axis: Owned()})           one owner rank per matrix
  rows       ComputeLayout({shard axis: BlockShard(0, r)})  per-head blocks, heads split over ranks
  experts    ComputeLayout({axis: Shard(0) for every sharded axis}) whole experts per rank (local)
  cols       not expressible (BlockShard only splits dim 0): per-head output projections are left
             out, so torchtitan steps a SUBSET of the parameters (`skipped` says which).
Buckets: one per transformer layer (the parameters of `layers.<i>.`), in layer order.

Its maths: momentum as an EMA (buf.lerp_(g, 1 - mu); Nesterov input g.lerp(buf, mu)), Newton-Schulz
in bf16 (always), lr adjust "match_rms_adamw" = 0.2 sqrt(max(r, c)) of the block, decoupled weight
decay. EMA momentum is (1 - mu) times the classic buf = mu buf + g at every step and NS normalizes
by the Frobenius norm, so the update equals the reference's up to bf16 rounding.

On CPU DistMuon refuses to run ("requires one CUDA device per process"). `cpu_shim()` patches two
private torchtitan functions, neither of which touches the maths: the device check (accept
"cpu") and the creation of its transfer stream (torch.cpu.Stream takes no `device=`; CPU streams are
no-ops, collectives run synchronously). Checked on torchtitan 0.3.0 with torch 2.13.0.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from models.splits import MatrixSplit

CHECKED_TORCHTITAN_VERSION = "0.3.0"


def import_dist_muon():
    """(module, None) or (None, reason) when torchtitan's DistMuon cannot be imported."""
    try:
        from torchtitan.distributed.flex_shard import dist_muon
    except Exception as err:  # ImportError, or a version whose imports fail differently
        return None, f"torchtitan DistMuon not importable: {type(err).__name__}: {err}"
    return dist_muon, None


def compute_layout(param: DTensor, split: MatrixSplit):
    """torchtitan's ComputeLayout for one parameter, or (None, reason) when it has none for our split."""
    from torchtitan.distributed.flex_shard.optimizer_reshard import BlockShard, ComputeLayout, Owned

    names = param.device_mesh.mesh_dim_names
    sharded = [names[i] for i, (p, n) in enumerate(zip(param.placements, param.device_mesh.shape))
               if n > 1 and not isinstance(p, Replicate)]
    if not sharded:
        return None, "not sharded"
    if split.kind == "cols":
        return None, "per-head cols (BlockShard splits dim 0 only)"
    if split.kind == "experts" and split.parts > 1:
        return None, f"experts cut into {split.parts} row blocks each (fused w1/w3): no ComputeLayout for part of an expert"
    if split.kind == "experts":
        if any(type(p) is not Shard or p.dim != 0 for p in param.placements if not isinstance(p, Replicate)):
            return None, f"experts placements {param.placements} are not whole experts per rank"
        return ComputeLayout({axis: Shard(0) for axis in sharded}), None
    if len(sharded) != 1:
        return None, f"sharded on {len(sharded)} axes {sharded}"
    if split.kind == "rows":
        return ComputeLayout({sharded[0]: BlockShard(0, split.block_shape(tuple(param.shape))[0])}), None
    return ComputeLayout({sharded[0]: Owned()}), None


def build(named_params: dict, splits: dict, lr: float, weight_decay: float, momentum: float, nesterov: bool):
    """(optimizer, skipped {fqn: reason}) for the parameters DistMuon can express with our splits."""
    dist_muon, reason = import_dist_muon()
    if dist_muon is None:
        raise RuntimeError(reason)
    layouts, skipped = {}, {}
    for fqn, p in named_params.items():
        layout, why = compute_layout(p, splits[fqn])
        if layout is None:
            skipped[fqn] = why
        else:
            layouts[fqn] = layout
    names = list(layouts)
    from torchtitan.distributed.flex_shard.optimizer_reshard import BucketConfig

    buckets = [BucketConfig(patterns=(f"{prefix}*",), name=prefix) for prefix in _bucket_prefixes(names)]
    with cpu_shim(dist_muon, next(iter(named_params.values())).to_local().device):
        opt = dist_muon.build_dist_muon(
            [{"params": [named_params[n] for n in names], "param_names": names}],
            compute_sharding_by_fqn=layouts, bucket_configs=buckets, lr=lr, weight_decay=weight_decay,
            momentum=momentum, nesterov=nesterov, ns_steps=5, adjust_lr_fn="match_rms_adamw",
        )
    return opt, skipped


def _bucket_prefixes(names: list[str]) -> list[str]:
    """'layers.<i>.' for each layer, in order; any other parameter gets its own exact bucket."""
    prefixes = []
    for n in names:
        parts = n.split(".")
        prefix = f"layers.{parts[1]}." if parts[0] == "layers" else n
        if prefix not in prefixes:
            prefixes.append(prefix)
    return prefixes


@contextlib.contextmanager
def cpu_shim(dist_muon, device: torch.device):
    """Let DistMuon run on CPU tensors without changing its maths (see module docstring)."""
    if device.type != "cpu":
        yield
        return
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as runtime

    orig_validate = dist_muon.DistMuon._validate_parameter_storage
    orig_create = runtime._CommunicationContext.create.__func__

    def validate_cpu(self):
        devices = {p.to_local().device for g in self.param_groups for p in g["params"]}
        assert devices == {device}, devices
        return device

    def create_cpu(cls, dev):
        stream_cls = torch.cpu.Stream
        torch.cpu.Stream = lambda device=None, priority=0: stream_cls(priority=priority)
        try:
            return orig_create(cls, dev)
        finally:
            torch.cpu.Stream = stream_cls

    dist_muon.DistMuon._validate_parameter_storage = validate_cpu
    runtime._CommunicationContext.create = classmethod(create_cpu)
    try:
        yield
    finally:
        dist_muon.DistMuon._validate_parameter_storage = orig_validate
        runtime._CommunicationContext.create = classmethod(orig_create)
