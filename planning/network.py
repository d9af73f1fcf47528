"""Seconds of one collective on a GPU cluster, and the compute it slows: the network model of every whole-step
projection (planning/step.py, planning/dual_mesh.py). Each efficiency rests on a published measurement of the
collective itself; none is fitted to a training run.

One collective of a rank that sends `intra` bytes to peers on its node and `inter` bytes to peers on other
nodes (NVLink and the NICs are separate hardware, so the two run at once):
    seconds = count x LATENCY_S + max(intra / (NVLink line x its efficiency), inter / (NIC line x its efficiency))
NIC efficiency by kind and dispatcher:
  ring collectives (FSDP/ZeRO all-gather, reduce-scatter, all-reduce; PP point-to-point): RING_EFFICIENCY
  all-to-all, "nccl" (torch all_to_all_single, Megatron's "alltoall" dispatcher): by the message to each peer,
      nccl_efficiency(m) = NCCL_PEAK x m / (m + NCCL_HALF_BYTES)       (latency and bandwidth per peer message)
  all-to-all, "deepep" (DeepEP-class kernels, Megatron's DeepEP and HybridEP: GPU-initiated RDMA, one copy per
      destination node, then NVLink forwarding to each destination rank; callers pass those bytes):
      deepep_rdma_efficiency() of NIC line and DEEPEP_NVLINK of NVLink line, from DeepEP's own table

Where each comes from:
  NCCL_PEAK 0.96        CX-7 NICs at NDR rate reach 48-49 of 50 GB/s in an all-to-all (NVIDIA, nccl-tests issue
                        267); the multi-node all-to-all busbw tends to the NIC bandwidth x N / (N - 1) (NVIDIA,
                        nccl-tests issue 130): line rate at large messages, whatever the node count.
  NCCL_HALF_BYTES       the message per peer at which half of that is reached: 160 KiB, from an NCCL all-to-all
                        across 64 H800 (8 nodes, NVIDIA/nccl issue 1531): 24.4 GB/s busbw at 8 MiB per rank
                        (128 KiB per peer) against 50 x 8 / 7 = 57.1 at line, 0.43 of it: 0.96 m / (m + h) = 0.43.
  DEEPEP_TABLE          DeepEP's normal kernels on H800 with CX7 (50 GB/s), DeepSeek-V3 routing (4 of 8 groups,
                        top 8 of 256 experts, 4,096 tokens, FP8 dispatch): "RDMA bottleneck bandwidth" 58 GB/s at
                        EP 32, 51 at EP 64 (their README, normal kernels). That figure counts a token once per
                        destination node, its own node included; only the other nodes cross the NIC (2.72 of 3.62
                        at EP 32, 3.49 of 3.99 at EP 64 under that routing, `deepep_nic_share`): 43.5 and 44.6 GB/s
                        on the NIC, 0.88 of line. The EP 16 row (43 GB/s, 2 nodes) is NVLink-bound on H800's
                        200 GB/s NVLink and not used; tests/unit/test_calibrate.py checks the model reproduces it.
  DEEPEP_NVLINK 0.77    its intranode EP 8 row: 153 GB/s dispatch on H800's 200 GB/s NVLink line.
  RING_EFFICIENCY 0.80  nccl-tests all-reduce busbw on 400 Gb/s NDR: 40-45 GB/s per GPU at large sizes.
  NVLINK_EFFICIENCY 0.80  nccl-tests all-reduce busbw inside an H100 node: ~360 of 450 GB/s per direction.
  LATENCY_S 50 us       per collective: the NCCL all-to-all latency at small sizes across nodes, charged to every
                        EP, FSDP, CP and TP collective.
  COMM_SM_SHARE 0.15    DeepSeek-V3 gave 20 of 132 H800 SMs to communication during DualPipe's overlap: compute
                        overlapped with communication runs at (1 - share) speed (`contended_compute_s`).
"""

import functools

import torch

NCCL_PEAK = 0.96
NCCL_HALF_BYTES = 160 * 2**10
DEEPEP_TABLE = {32: 58.0, 64: 51.0}  # EP size -> RDMA bottleneck bandwidth, GB/s (H800, CX7 50 GB/s)
DEEPEP_TABLE_NIC_GBS = 50.0
DEEPEP_NVLINK = 153.0 / 200.0
RING_EFFICIENCY = 0.80
NVLINK_EFFICIENCY = 0.80
LATENCY_S = 50e-6
COMM_SM_SHARE = 0.15
DISPATCHERS = ("nccl", "deepep")


def nccl_efficiency(bytes_per_peer: float) -> float:
    """Fraction of NIC line rate an NCCL all-to-all reaches with `bytes_per_peer` to each remote peer."""
    return NCCL_PEAK * bytes_per_peer / (bytes_per_peer + NCCL_HALF_BYTES)


@functools.lru_cache(maxsize=None)
def deepep_nic_share(ep: int, gpus_per_node: int = 8, experts: int = 256, topk: int = 8, tokens: int = 4096) -> float:
    """Of the destination nodes DeepEP's benchmark counts per token (its own node included), the share that crosses
    the NIC, under that benchmark's routing: random scores, one group per node, the tokens' top min(nodes, 4)
    groups, their top `topk` experts (DeepEP's internode test, test_internode.py)."""
    g = torch.Generator().manual_seed(0)
    nodes = ep // gpus_per_node
    scores = torch.randn(tokens, experts, generator=g).abs() + 1
    groups = torch.topk(scores.view(tokens, nodes, -1).amax(-1), min(nodes, 4), dim=-1).indices
    allowed = torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, groups, True)
    masked = scores.view(tokens, nodes, -1).masked_fill(~allowed[..., None], 0).view(tokens, experts)
    node_TK = torch.topk(masked, topk, dim=-1).indices // (experts // nodes)
    present = torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
    crossing = sum((present.sum(1) - present[:, n].long()).float().mean().item() for n in range(nodes)) / nodes
    return crossing / present.sum(1).float().mean().item()


def deepep_rdma_efficiency() -> float:
    """Fraction of NIC line DeepEP's normal kernels reach on the NIC (module docstring): the mean over the
    NIC-bound rows of its table."""
    rows = [gbs * deepep_nic_share(ep) / DEEPEP_TABLE_NIC_GBS for ep, gbs in DEEPEP_TABLE.items()]
    return sum(rows) / len(rows)


def ring_s(device, intra: float, inter: float, count: int = 1) -> float:
    """Seconds of `count` ring collectives (FSDP, ZeRO-1, TP, CP) moving `intra` + `inter` bytes per rank in all."""
    nvlink = intra / (device.nvlink_line_gbs * 1e9 * NVLINK_EFFICIENCY)
    network = inter / (device.nic_line_gbs * 1e9 * RING_EFFICIENCY)
    return count * LATENCY_S + max(nvlink, network)


def all_to_all_links_s(device, intra: float, inter: float, dispatcher: str = "nccl", inter_peers: int = 1,
                       count: int = 1) -> tuple[float, float]:
    """(NVLink seconds, NIC seconds) of `count` all-to-alls moving `intra` + `inter` bytes per rank in all: "nccl"
    with each call's inter-node bytes split over `inter_peers` remote peers (its message size), "deepep" at
    DeepEP's rates."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher {dispatcher!r}: expected one of {', '.join(DISPATCHERS)}")
    if dispatcher == "deepep":
        nvlink_rate, nic_rate = DEEPEP_NVLINK, deepep_rdma_efficiency()
    else:
        nvlink_rate = NVLINK_EFFICIENCY
        nic_rate = nccl_efficiency(inter / max(1, count) / max(1, inter_peers)) if inter else 1.0
    return (intra / (device.nvlink_line_gbs * 1e9 * nvlink_rate),
            inter / (device.nic_line_gbs * 1e9 * nic_rate) if inter else 0.0)


def all_to_all_s(device, intra: float, inter: float, dispatcher: str = "nccl", inter_peers: int = 1,
                 count: int = 1) -> float:
    """Seconds of `count` all-to-alls (`all_to_all_links_s`), the slower link plus a latency per call."""
    return count * LATENCY_S + max(all_to_all_links_s(device, intra, inter, dispatcher, inter_peers, count))


def contended_compute_s(compute_s: float, overlapped_comm_s: float) -> float:
    """Compute seconds when `overlapped_comm_s` of communication runs beside it: the part of the compute
    that shares the device with communication runs at (1 - COMM_SM_SHARE) speed."""
    shared = min(compute_s, overlapped_comm_s)
    return compute_s - shared + shared / (1 - COMM_SM_SHARE)
