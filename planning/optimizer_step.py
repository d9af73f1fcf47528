"""The sharded Muon's optimizer step on a GPU cluster, projected from its own plan: the time one step takes
on the slowest rank, for benchmarks/projection.py (Kimi K2, 64..4096 GPUs) and the whole-step rows
(planning/dual_mesh.py).

Step time of a rank with B buckets (the runtime's pipeline: bucket k's NS overlaps bucket k+1's
forward all-to-all and bucket k-1's return):
    step = max(compute, comm) + comm / B + B * latency + elementwise
compute = its NS FLOPs / sustained (planning/devices.py); comm = max(intra sent, intra received) / nvlink_gbs
and max(inter sent, inter received) / network_gbs running concurrently (links are full duplex, NVLink and the
NICs are separate hardware); comm / B = the first bucket's forward plus the last bucket's return, which
nothing overlaps; elementwise = its local Muon elements x ELEMENTWISE_BYTES / HBM (momentum, Nesterov
direction, packing, update: memory-bound, not overlapped; the bytes are the step's own, counted on CPU).
The projected step is the slowest rank's.
"""

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

# Bytes the sharded Muon step reads + writes per local Muon element outside Newton-Schulz (fp32
# master weights and momentum, bf16 NS): MEASURED, not assumed. `benchmarks/lib/counters.py` counts every
# memory-bound op of the step; Kimi K2's shapes scaled down (`kimi_slice`, bf16 NS) give 64.3 on 1
# process and 64.3 on the busiest of 2 ranks (`optimizer_step.py --ns-dtype bfloat16`), debug 65.5.
# Per element: momentum mul + add (8 + 12), weight decay (8), the Nesterov direction written in bf16
# into the send buffer (4 + 4 + 2), block assembly (2 + 2), tall blocks batched with wide ones (cat
# and copy back: 8 on mixed groups), the return gather (2 + 2), the update (4 + 2 + 4).
# tests/entry/test_benchmarks.py re-measures it. A fused kernel would need about 24 (read grad, momentum
# and weight once, write momentum and weight once, the direction once in bf16, read the result).
# Pieces moved by index maps instead of runs (optim/sharded/index.py) cost 32 more: 9% of Kimi K2's
# elements at W = 256 (narrow), about +3 bytes not counted here.
ELEMENTWISE_BYTES = 64
NS_DTYPE = torch.bfloat16  # communicated and orthogonalized in bf16 on a GPU; fp32 master weights and momentum


@dataclass
class StepEstimate:
    step_s: float  # slowest rank
    compute_s: float  # of that rank
    comm_s: float
    exposed_s: float  # first/last bucket + latencies
    elementwise_s: float
    rank: int


def project(device, flops, sent_intra, recv_intra, sent_inter, recv_inter, local_elems,
            buckets: int, overlap: bool = True) -> StepEstimate:
    """Per-rank arrays -> the step estimate of the module docstring (overlap=False: compute + comm)."""
    compute = np.asarray(flops, dtype=np.float64) / (device.sustained_tflops * 1e12)
    intra = np.maximum(sent_intra, recv_intra) / (device.nvlink_gbs * 1e9)
    inter = np.maximum(sent_inter, recv_inter) / (device.network_gbs * 1e9)
    comm = np.maximum(intra, inter)
    b = max(1, buckets)
    exposed = comm / b + b * device.latency_us * 1e-6
    elementwise = np.asarray(local_elems, dtype=np.float64) * ELEMENTWISE_BYTES / (device.hbm_gbs * 1e9)
    step = (np.maximum(compute, comm) + exposed if overlap else compute + comm) + elementwise
    r = int(np.argmax(step))
    return StepEstimate(float(step[r]), float(compute[r]), float(comm[r]), float(exposed[r]), float(elementwise[r]), r)


def lower_bound(total_flops: float, world: int, device) -> float:
    """Total NS FLOPs spread perfectly over `world` GPUs at datasheet peak: no schedule beats it."""
    return total_flops / (world * device.peak_tflops * 1e12)


def gpu_plan_options(device, *, bucket_mb=256.0, replica_split="auto", ns_method="standard"):
    """What the sharded Muon plans with on a GPU (`optim.sharded.muon.plan_options`: NS in bf16, holders
    first), with the device model's rates for the cost model."""
    from optim.config import OptimConfig
    from optim.sharded.muon import plan_options

    options = plan_options(OptimConfig(ns_method=ns_method), torch.device("cuda"), bucket_mb=bucket_mb,
                           replica_split=replica_split, ranks_per_node=device.gpus_per_node)
    assert options.ns_dtype == NS_DTYPE
    return dataclasses.replace(options, flops_per_s=device.sustained_tflops * 1e12,
                               intra_node_bytes_per_s=device.nvlink_gbs * 1e9,
                               inter_node_bytes_per_s=device.network_gbs * 1e9)


def local_elements(specs, world: int) -> np.ndarray:
    """Muon parameter elements each rank holds (for the elementwise term)."""
    from models.boxes import all_boxes

    out = np.zeros(world)
    for s in specs:
        boxes = all_boxes(s.shape, s.mesh_ranks.shape, s.placements)
        np.add.at(out, s.mesh_ranks.ravel(), np.prod(boxes[..., 1] - boxes[..., 0], axis=-1).ravel())
    return out


@functools.lru_cache(maxsize=None)  # the same layout recurs across dtypes and what-ifs; planning K2 takes seconds
def optimizer_step_s(model_config, layout, device) -> float:
    """The sharded Muon step of this layout: its own planner and the device model above."""
    from optim.planner.plan import make_plan
    from optim.planner.specs import model_specs

    specs = model_specs(model_config, layout, dtype=torch.float32)  # expert ranks follow parallel.expert_inner
    plan = make_plan(specs, layout.world_size, gpu_plan_options(device))
    s = plan.stats
    est = project(device, s.flops, s.sent_intra, s.recv_intra, s.sent_inter, s.recv_inter,
                  local_elements(specs, layout.world_size), plan.num_buckets)
    return est.step_s
