"""A small model of one GPU in a cluster, and the optimizer-step time it implies for a plan.

Numbers (per GPU; sources and assumptions):
  peak_tflops       dense bf16 tensor-core peak, NVIDIA H100 SXM5 and H200 SXM datasheets: 989 TFLOP/s
                    for both (same GH100 compute; "1,979" in the datasheets is with 2:4 sparsity).
  sustained_tflops  what batched NS matmuls (2048 x 7168 blocks, bf16) sustain: 600, ~60% of peak, the
                    design's working figure (large cuBLAS bf16 GEMMs reach 650-750 on H100 SXM; NS
                    also runs the smaller s x s products). Same for H200: NS is compute-bound, the
                    H200's extra HBM bandwidth does not speed it up. `--calibration` replaces it by
                    a measured rate on the real Kimi K2 block shapes.
  nvlink_gbs        NVLink 4 / NVSwitch: 900 GB/s bidirectional = 450 GB/s per direction; ~80% of it
                    achieved by an all-to-all inside a node: 360 GB/s per direction.
  network_gbs       one 400 Gb/s NIC per GPU (ConnectX-7, InfiniBand NDR or RoCE) = 50 GB/s per
                    direction; ~80% achieved by a many-node all-to-all: 40 GB/s.
  hbm_gbs           HBM3 3.35 TB/s (H100), HBM3e 4.8 TB/s (H200), datasheets.
  latency_us        per collective (one bucket's all-to-all): 50 us, typical NCCL all-to-all latency
                    at small sizes across nodes.
Links are full duplex and NVLink and the NICs are separate hardware, so a rank's communication time
is max(intra sent, intra received) / nvlink_gbs and max(inter sent, inter received) / network_gbs
running concurrently: comm = max(intra, inter).

Step time of a rank with B buckets (the runtime's pipeline: bucket k's NS overlaps bucket k+1's
forward all-to-all and bucket k-1's return):
    step = max(compute, comm) + comm / B + B * latency + elementwise
compute = its NS FLOPs / sustained; comm / B = the first bucket's forward plus the last bucket's
return, which nothing overlaps; elementwise = its local Muon elements x ELEMENTWISE_BYTES / HBM
(momentum, Nesterov direction, packing, update: memory-bound, not overlapped; the bytes are the
step's own, counted on CPU). The projected step is
the slowest rank's.
"""

import json
from dataclasses import dataclass, replace

import numpy as np

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


@dataclass(frozen=True)
class DeviceModel:
    name: str
    peak_tflops: float
    sustained_tflops: float
    nvlink_gbs: float
    network_gbs: float
    hbm_gbs: float
    latency_us: float = 50.0
    gpus_per_node: int = 8
    source: str = "datasheet + assumptions (benchmarks/lib/device_model.py)"
    peak_fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (datasheet; 2x bf16 on Hopper and Blackwell)
    nvlink_line_gbs: float = 450.0  # NVLink per direction, line rate (benchmarks/lib/network_model.py)
    nic_line_gbs: float = 50.0  # network per GPU per direction, line rate: one 400 Gb/s NIC
    memory_gib: float = 80.0  # usable HBM (datasheet)


# Datasheets (dense tensor-core peaks: the sparse figures halved), per GPU:
#   H100 SXM5: bf16 989, fp8 1,979 TFLOP/s; HBM3 3.35 TB/s, 80 GB; NVLink 4 900 GB/s bidirectional.
#   H200 SXM: the H100's compute; HBM3e 4.8 TB/s, 141 GB; NVLink 900 GB/s.
#   H800 SXM5: the H100's compute; NVLink 400 GB/s bidirectional (200 per direction; DeepSeek-V3 report:
#       160 GB/s achievable); HBM3 3.35 TB/s, 80 GB.
#   B200 (HGX B200, 8 GPUs: 36 PFLOP/s bf16 / 72 fp8 with sparsity): bf16 2,250, fp8 4,500; HBM3e 8 TB/s,
#       180 GB; NVLink 5 1.8 TB/s bidirectional.
# Every node: one 400 Gb/s NIC per GPU (ConnectX-7 NDR; DeepSeek-V3's H800 cluster and the torchtitan B200 run).
DEVICES = {
    "h100": DeviceModel("H100 SXM5 80GB", 989.0, 600.0, 360.0, 40.0, 3350.0, peak_fp8_tflops=1979.0,
                        memory_gib=80.0, source="NVIDIA H100 datasheet"),
    "h200": DeviceModel("H200 SXM 141GB", 989.0, 600.0, 360.0, 40.0, 4800.0, peak_fp8_tflops=1979.0,
                        memory_gib=139.0, source="NVIDIA H200 datasheet"),
    "h800": DeviceModel("H800 SXM5 80GB", 989.0, 600.0, 160.0, 40.0, 3350.0, peak_fp8_tflops=1979.0,
                        nvlink_line_gbs=200.0, memory_gib=80.0,
                        source="NVIDIA H800 datasheet; DeepSeek-V3 technical report (NVLink 160 GB/s achieved)"),
    "b200": DeviceModel("B200 180GB", 2250.0, 1365.0, 720.0, 40.0, 8000.0, peak_fp8_tflops=4500.0,
                        nvlink_line_gbs=900.0, memory_gib=180.0, source="NVIDIA HGX B200 datasheet"),
}


def device_model(name: str, calibration: str | None = None) -> DeviceModel:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; expected one of {sorted(DEVICES)}")
    device = DEVICES[name]
    return calibrate(device, calibration) if calibration else device


def calibrate(device: DeviceModel, path: str) -> DeviceModel:
    """Replace the sustained NS rate by one measured by `optimizer_step.py --calibrate-kimi` (its JSON
    "kimi_blocks_gflops", bf16 preferred). Link bandwidths stay assumptions: one GPU cannot measure them."""
    with open(path) as f:
        measured = json.load(f)
    rates = measured.get("kimi_blocks_gflops") or {}
    dtype = "bfloat16" if "bfloat16" in rates else next(iter(rates), None)
    if dtype is None:
        raise ValueError(f"{path}: no 'kimi_blocks_gflops' (run optimizer_step.py with --calibrate-kimi N)")
    return replace(device, sustained_tflops=rates[dtype] / 1e3,
                   source=f"NS rate {rates[dtype] / 1e3:.0f} TFLOP/s ({dtype}) measured on {measured.get('device')} "
                          f"({path}); links and HBM: assumptions")


@dataclass
class StepEstimate:
    step_s: float  # slowest rank
    compute_s: float  # of that rank
    comm_s: float
    exposed_s: float  # first/last bucket + latencies
    elementwise_s: float
    rank: int


def project(device: DeviceModel, flops, sent_intra, recv_intra, sent_inter, recv_inter, local_elems,
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


def lower_bound(total_flops: float, world: int, device: DeviceModel) -> float:
    """Total NS FLOPs spread perfectly over `world` GPUs at datasheet peak: no schedule beats it."""
    return total_flops / (world * device.peak_tflops * 1e12)
