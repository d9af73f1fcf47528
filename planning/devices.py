"""The one device table: per GPU kind, the datasheet figures every planner reads and the assumptions each
model adds, with where each comes from.

Per GPU (sources and assumptions):
  peak_tflops       dense bf16 tensor-core peak, datasheets: 989 TFLOP/s for H100 SXM5, H200 SXM and H800 SXM5
                    (same GH100 compute; "1,979" in the datasheets is with 2:4 sparsity), 2,250 for B200.
  peak_fp8_tflops   dense FP8 tensor-core peak (datasheet; 2x bf16 on Hopper and Blackwell).
  memory_gib        the HBM torch reports as total (torch.cuda.get_device_properties): 79.2 GiB on an H100 80GB
                    (H800 the same), 139.8 GiB on an H200 141GB; B200: the HGX datasheet's 180 GB (167.6 GiB),
                    no torch reading at hand. The memory estimates (planning/memory/) fit against it.
  runtime_gib       what the CUDA context, NCCL's buffers and the allocator's reserve hold before any tensor
                    (an assumption: ~0.5 GiB context, the rest NCCL and allocator slack).
  hbm_gbs           HBM3 3.35 TB/s (H100, H800), HBM3e 4.8 TB/s (H200), 8 TB/s (B200), datasheets.
  nvlink_line_gbs   NVLink per direction, line rate: 450 GB/s (NVLink 4, 900 bidirectional), H800 200 (400
                    bidirectional; DeepSeek-V3's report: ~160 achievable), B200 900 (NVLink 5).
  nic_line_gbs      network per GPU per direction, line rate: one 400 Gb/s NIC (ConnectX-7 NDR) per GPU = 50 GB/s
                    (DeepSeek-V3's H800 cluster, the torchtitan B200 run, DGX H100 / B200).
The optimizer-step projection (planning/optimizer_step.py) reads three more, each an assumption:
  sustained_tflops  what batched NS matmuls (2048 x 7168 blocks, bf16) sustain: 600 on Hopper (~60% of peak; large
                    cuBLAS bf16 GEMMs reach 650-750 on H100 SXM, NS also runs the smaller s x s products), 1,365 on
                    B200 (the same fraction); `--calibration` replaces it by a rate measured on the Kimi K2 blocks.
  nvlink_gbs        ~80% of NVLink line achieved by an all-to-all inside a node (H800: DeepSeek-V3's 160).
  network_gbs       ~80% of the NIC's line achieved by the optimizer's large all-to-alls: 40 GB/s.
  latency_us        per collective: 50 us, the NCCL all-to-all latency at small sizes across nodes.
The whole-step models read the line rates and planning/network.py's efficiencies instead.
"""

import json
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DeviceModel:
    name: str
    peak_tflops: float
    peak_fp8_tflops: float
    memory_gib: float
    hbm_gbs: float
    nvlink_line_gbs: float = 450.0
    nic_line_gbs: float = 50.0
    runtime_gib: float = 4.0
    sustained_tflops: float = 600.0
    nvlink_gbs: float = 360.0
    network_gbs: float = 40.0
    latency_us: float = 50.0
    gpus_per_node: int = 8
    source: str = "datasheet + assumptions (planning/devices.py)"


DEVICES = {
    "h100": DeviceModel("H100 SXM5 80GB", 989.0, 1979.0, memory_gib=79.2, hbm_gbs=3350.0,
                        source="NVIDIA H100 datasheet"),
    "h200": DeviceModel("H200 SXM 141GB", 989.0, 1979.0, memory_gib=139.8, hbm_gbs=4800.0,
                        source="NVIDIA H200 datasheet"),
    "h800": DeviceModel("H800 SXM5 80GB", 989.0, 1979.0, memory_gib=79.2, hbm_gbs=3350.0, nvlink_line_gbs=200.0,
                        nvlink_gbs=160.0,
                        source="NVIDIA H800 datasheet; DeepSeek-V3 technical report (NVLink 160 GB/s achieved)"),
    "b200": DeviceModel("B200 180GB", 2250.0, 4500.0, memory_gib=167.6, hbm_gbs=8000.0, nvlink_line_gbs=900.0,
                        sustained_tflops=1365.0, nvlink_gbs=720.0, source="NVIDIA HGX B200 datasheet"),
}


def device_model(name: str, calibration: str | None = None) -> DeviceModel:
    """The device `name` (DEVICES), its NS rate replaced by a measured one when `calibration` is given."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; expected one of {sorted(DEVICES)}")
    device = DEVICES[name]
    return calibrate(device, calibration) if calibration else device


def read_calibration(path: str) -> dict:
    """The JSON benchmarks/gpu_check.py writes (its calibration keys at the top level); ValueError naming the file."""
    try:
        with open(path) as f:
            measured = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}); expected the JSON benchmarks/gpu_check.py writes") from None
    if not isinstance(measured, dict):
        raise ValueError(f"{path}: a JSON {type(measured).__name__}, expected the object benchmarks/gpu_check.py writes")
    return measured


def calibrate(device: DeviceModel, path: str) -> DeviceModel:
    """Replace the sustained NS rate by one measured on the Kimi K2 blocks (the JSON's "kimi_blocks_gflops", bf16
    preferred: benchmarks/gpu_check.py's calibration section, or optimizer_step.py --calibrate-kimi N). Link
    bandwidths stay assumptions: one GPU cannot measure them."""
    measured = read_calibration(path)
    rates = measured.get("kimi_blocks_gflops") or {}
    dtype = "bfloat16" if "bfloat16" in rates else next(iter(rates), None)
    if dtype is None:
        raise ValueError(f"{path}: no 'kimi_blocks_gflops' (the calibration benchmarks/gpu_check.py writes on a GPU; "
                         f"optimizer_step.py --calibrate-kimi N writes it too)")
    return replace(device, sustained_tflops=rates[dtype] / 1e3,
                   source=f"NS rate {rates[dtype] / 1e3:.0f} TFLOP/s ({dtype}) measured on {measured.get('device')} "
                          f"({path}); links and HBM: assumptions")
