"""Seconds of one collective on a GPU cluster, and the compute it slows: the calibrated network model
shared by benchmarks/lib/layout_step.py (the published runs of benchmarks/calibrate.py, PP/TP/ZeRO-1
layouts) and benchmarks/step_projection.py (the runtime's dual-mesh layouts).

One collective of a rank that sends `intra` bytes to peers on its node and `inter` bytes to peers on
`nodes - 1` other nodes (alpha-beta; NVLink and the NICs are separate hardware, so the two run at once):
    seconds = LATENCY_S + max(intra / (nvlink line x NVLINK_EFFICIENCY), inter / (NIC line x efficiency))
Inter-node efficiency by kind and dispatcher (the parameters, each with the published figure it rests on):
  ring collectives (FSDP/ZeRO all-gather, reduce-scatter, all-reduce; PP point-to-point): RING_EFFICIENCY
  all-to-all, "nccl" (torch all_to_all_single; the runtime's path): falls with the nodes in the group,
      nccl_efficiency(nodes) = NCCL_A2A_2_NODES / (1 + (nodes - 2) / NCCL_A2A_HALF_NODES)
  all-to-all, "deepep" (a DeepEP-class kernel: GPU-initiated RDMA, one copy per destination node then
      NVLink forwarding; callers pass node-deduplicated bytes): DEEPEP_EFFICIENCY, flat in nodes
Compute under communication (`contended_compute_s`): the communication kernels hold COMM_SM_SHARE of the
SMs (and HBM bandwidth) while in flight, so compute overlapped with them runs at (1 - share) speed.

How each was chosen (sources in docs/performance.md#calibration):
  NCCL_A2A_2_NODES 0.80   the old model's single figure (80% of line), kept for the smallest group: two nodes,
                          few peers, large messages.
  NCCL_A2A_HALF_NODES 9   from the published NCCL all-to-all across 64 H800 (8 nodes): ~24 GB/s busbw on
                          50 GB/s NICs = 0.48 -> 0.80 / (1 + 6 / 9) = 0.48. Not fitted to a training run.
  DEEPEP_EFFICIENCY 0.45  FITTED on torchtitan's DeepEP run (benchmarks/calibration/torchtitan_dsv3_b200_deepep.toml).
                          DeepEP's README (H800, CX7 50 GB/s) reports 43-58 GB/s "RDMA bottleneck bandwidth" for
                          its normal kernels at EP 16-64, about line rate in its own accounting; inside that
                          training run it reached less, and its gain over NCCL is the deduplication.
  RING_EFFICIENCY 0.80    the old model's figure for every inter-node collective (nccl-tests all-reduce busbw on
                          400 Gb/s NDR: 40-45 GB/s per GPU at large sizes).
  NVLINK_EFFICIENCY 0.80  nccl-tests all-reduce busbw inside an H100 node: ~360 of 450 GB/s per direction.
  LATENCY_S 50 us         per collective: the NCCL all-to-all latency at small sizes across nodes (the old
                          optimizer model's figure), now charged to every EP, FSDP, CP, TP and PP collective.
  COMM_SM_SHARE 0.15      DeepSeek-V3 gave 20 of 132 H800 SMs to communication during DualPipe's overlap.
"""

NCCL_A2A_2_NODES = 0.80
NCCL_A2A_HALF_NODES = 9.0
DEEPEP_EFFICIENCY = 0.45
RING_EFFICIENCY = 0.80
NVLINK_EFFICIENCY = 0.80
LATENCY_S = 50e-6
COMM_SM_SHARE = 0.15
DISPATCHERS = ("nccl", "deepep")
# projected / measured tokens/s/GPU of the committed published runs (benchmarks/calibrate.py on
# benchmarks/calibration/*.toml; tests/unit/test_calibrate.py keeps these equal to what it computes): the spread
# that projections quote as their band.
CALIBRATION_RATIOS = (0.868, 1.075, 1.119)


def nccl_efficiency(nodes: int) -> float:
    """Fraction of NIC line rate an NCCL all-to-all over `nodes` nodes reaches (module docstring)."""
    return NCCL_A2A_2_NODES / (1 + max(0, nodes - 2) / NCCL_A2A_HALF_NODES)


def inter_efficiency(kind: str, nodes: int, dispatcher: str = "nccl") -> float:
    """Fraction of NIC line rate for a collective of `kind` ("all_to_all" or a ring collective)."""
    if kind != "all_to_all":
        return RING_EFFICIENCY
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher {dispatcher!r}: expected one of {', '.join(DISPATCHERS)}")
    return DEEPEP_EFFICIENCY if dispatcher == "deepep" else nccl_efficiency(nodes)


def collective_s(device, kind: str, intra: float, inter: float, nodes: int, dispatcher: str = "nccl",
                 count: int = 1) -> float:
    """Seconds of `count` collectives moving `intra` + `inter` bytes per rank in all (module docstring)."""
    nvlink = intra / (device.nvlink_line_gbs * 1e9 * NVLINK_EFFICIENCY)
    network = inter / (device.nic_line_gbs * 1e9 * inter_efficiency(kind, nodes, dispatcher)) if inter else 0.0
    return count * LATENCY_S + max(nvlink, network)


def contended_compute_s(compute_s: float, overlapped_comm_s: float) -> float:
    """Compute seconds when `overlapped_comm_s` of communication runs beside it: the part of the compute
    that shares the device with communication runs at (1 - COMM_SM_SHARE) speed."""
    shared = min(compute_s, overlapped_comm_s)
    return compute_s - shared + shared / (1 - COMM_SM_SHARE)
