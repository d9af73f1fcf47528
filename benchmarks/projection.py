"""Project the optimizer step of Kimi K2 (1.04T parameters) on 64..4096 GPUs from the sharded Muon's plan.

    python benchmarks/projection.py [--json PATH] [--device h100|h200] [--calibration PATH]
        [--worlds 64,128,...] [--expert-layouts wide,narrow,capped] [--ns-methods standard,gram]
        [--replica-split auto|on|off] [--time-planning N]

`--time-planning N` only plans: each (expert layout, NS method, W) N times, printing the median wall
and CPU seconds of `plan_world` (specs and `make_plan`, with "auto" every candidate plan).

No process group. For each world size W the sharded Muon's own planner (`optim.planner.plan.make_plan`, fed by
`optim.planner.specs.model_specs`: the runtime's placements, nothing allocated) decides owners and
buckets; its per-rank NS FLOPs and intra-/inter-node bytes go through the device model
(`planning/optimizer_step.py`: step = max(compute, comm) + first/last bucket + elementwise).

Layout per W (8 GPUs per node):
  dense   dp_shard = 8 (inside a node: FSDP traffic on NVLink), dp_replicate = W / 8.
  experts ep = 8 (inside a node: the token all-to-all on NVLink), edp_shard = W / 8, edp_replicate = 1.
With 384 experts, an ep rank holds 48 per layer. "wide" (default) keeps edp_shard = W / 8 at every W:
up to W = 384 each rank holds whole experts (no Muon communication for them); beyond, parallel/ shards
experts on a matrix dim (Shard(1), no empty ranks) and the planner sends every expert block to one
owner inside its edp_shard group (a piece of 1/(W/8) of the block from each member). "capped" stops
at edp_shard = 16 (3 whole experts per rank) and adds edp_replicate = W / 128: the experts'
NS is then either repeated in every replica (400 TFLOP per rank at W = 1024: 0.74 s) or split across
replicas with the results all-gathered over the network (each replica group holds 1/16 of an ep
rank's experts: ~19 GB in bf16 into every rank, 0.58 s at W = 512), against 0.26 s (W = 512) and
0.15 s (W = 1024) for "wide", whose expert pieces cross the network once each way. Run
`--expert-layouts capped` to see it.
"narrow" turns the expert mesh around: edp_shard = 8 inside a node, ep = gcd(W / 8, 384) across nodes
(edp_replicate = the rest): an expert's pieces then stay on NVLink (its Muon all-to-all never leaves
the node) while the token all-to-all of ep crosses nodes (not modelled here: this is the optimizer
step only). The runtime builds this numbering with `parallel.expert_inner = "edp_shard"`, and so does the
projection's layout. Plans keep each expert block
with its holders while their load stays under the mean (`PlanOptions.prefer_holders`, the sharded
Muon's default in both layouts): without that the balancing greedy sends pieces to any rank of the
world and the traffic crosses nodes again (Kimi K2, W = 256, narrow, Gram: 0.471 s and 15.6 GB
inter-node per rank, against 0.295 s and 0.9 GB; wide: 0.472 s against 0.456 s).
Every row reports its distance to the lower bound (`vs_bound`: step / bound), and the NS method's
own FLOPs (`--ns-methods`: standard or Gram NS; bf16, so Gram restarts once) in both.

Also printed: the smallest W whose projected step is <= 0.2 s (the published target for a ~1T MoE),
the same projection for `gather_all` (Moonlight/ZeRO-1: every rank all-gathers every matrix of every
parameter it holds a shard of, for experts those of its ep rank, and orthogonalizes all of them;
given the same overlap formula with one bucket per parameter, which is generous: Moonlight's gathers
are sequential), and the lower bound total NS FLOPs / (W x peak).
"""

import argparse
import json
import math
import os
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/projection.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from models import preset
from models.boxes import all_boxes, placement_kind
from optim.newton_schulz import NS_METHODS, ns_flops
from optim.planner.plan import REPLICA_SPLIT, make_plan
from optim.planner.specs import model_specs
from parallel.layout import ParallelConfig
from planning.devices import DEVICES, device_model
from planning.optimizer_step import NS_DTYPE, gpu_plan_options, local_elements, lower_bound, project
from runtime.cli import user_errors
from runtime.paths import check_outputs

WORLDS = (64, 128, 256, 512, 1024, 2048, 4096)
TARGET_S = 0.2
GPUS_PER_NODE = 8


EXPERT_LAYOUTS = ("wide", "narrow", "capped")
N_EXPERTS = 384


def kimi_layout(world: int, expert_layout: str = "wide"):
    """The layout of the module docstring for `world` GPUs (a multiple of 8)."""
    if world % GPUS_PER_NODE or world < GPUS_PER_NODE:
        raise ValueError(f"world size {world} must be a positive multiple of {GPUS_PER_NODE} GPUs per node")
    nodes = world // GPUS_PER_NODE
    if expert_layout == "narrow":
        ep = math.gcd(nodes, N_EXPERTS)
        return ParallelConfig(dp_replicate=nodes, dp_shard=GPUS_PER_NODE, cp=1, ep=ep, edp_replicate=nodes // ep,
                              edp_shard=GPUS_PER_NODE, expert_inner="edp_shard").resolve(world)
    edp_shard = nodes if expert_layout == "wide" else min(nodes, 16)
    return ParallelConfig(dp_replicate=nodes, dp_shard=GPUS_PER_NODE, cp=1, ep=GPUS_PER_NODE,
                          edp_replicate=nodes // edp_shard, edp_shard=edp_shard).resolve(world)


def total_ns_flops(specs, method: str = "standard") -> int:
    """NS FLOPs of one step with every block computed once, by `method` in the NS dtype."""
    return sum(s.split.num_blocks(s.shape) * ns_flops(*s.split.block_shape(s.shape), method=method, dtype=NS_DTYPE)
               for s in specs)


def plan_world(config, world: int, device, *, expert_layout="wide", replica_split="auto", bucket_mb=256.0,
               ns_method="standard"):
    """(specs, plan) of Kimi K2 on `world` GPUs, planned with the device's own numbers."""
    layout = kimi_layout(world, expert_layout)
    specs = model_specs(config, layout, dtype=torch.float32)  # narrow: edp_shard innermost (parallel.expert_inner)
    options = gpu_plan_options(device, bucket_mb=bucket_mb, replica_split=replica_split, ns_method=ns_method)
    return specs, make_plan(specs, world, options)


def _gather_groups(spec, per_coordinate: np.ndarray):
    """(ranks [G, S], values [G, S]): the all-gather groups of a ZeRO-1 style optimizer (one row per
    group). Replicate axes and the `ep` axis (each ep rank's experts are its own parameter) separate
    groups; the other axes are the FSDP shard group that gathers one full parameter."""
    kinds = [placement_kind(p) for p in spec.placements]
    outer = [a for a, k in enumerate(kinds) if k[0] == "replicate" or spec.mesh_dim_names[a] == "ep"]
    order = outer + [a for a in range(len(kinds)) if a not in outer]
    G = int(np.prod([spec.mesh_ranks.shape[a] for a in outer]))
    return (np.transpose(spec.mesh_ranks, order).reshape(G, -1),
            np.transpose(per_coordinate, order).reshape(G, -1))


def gather_all_traffic(specs, world: int, method: str = "standard") -> dict:
    """Per-rank NS FLOPs and all-gather bytes when every rank gathers and orthogonalizes every
    parameter it holds a shard of: all-gather inside the FSDP shard group of its replica, and for
    experts only its ep rank's experts (1/ep of the stacked tensor)."""
    out = {k: np.zeros(world) for k in ("flops", "sent_intra", "recv_intra", "sent_inter", "recv_inter")}
    itemsize = torch.empty((), dtype=NS_DTYPE).element_size()
    cache = {}
    for s in specs:
        key = (s.shape, s.placements, s.mesh_ranks.shape, s.mesh_ranks.tobytes())
        if key not in cache:
            boxes = all_boxes(s.shape, s.mesh_ranks.shape, s.placements)
            ranks, nbytes = _gather_groups(s, np.prod(boxes[..., 1] - boxes[..., 0], axis=-1) * itemsize)
            node = ranks // GPUS_PER_NODE
            peer = ~np.eye(ranks.shape[1], dtype=bool)  # a rank sends nothing to itself
            intra = (node[:, :, None] == node[:, None, :]) & peer  # [R, S, S]: same node, not self
            inter = ~intra & peer
            cache[key] = (ranks.ravel(), {
                "recv_intra": np.einsum("rij,rj->ri", intra, nbytes).ravel(),
                "recv_inter": np.einsum("rij,rj->ri", inter, nbytes).ravel(),
                "sent_intra": (nbytes * intra.sum(2)).ravel(),
                "sent_inter": (nbytes * inter.sum(2)).ravel(),
            })
        ranks, traffic = cache[key]
        for k, v in traffic.items():
            np.add.at(out[k], ranks, v)
        ep = s.mesh_ranks.shape[s.mesh_dim_names.index("ep")] if "ep" in s.mesh_dim_names else 1
        np.add.at(out["flops"], ranks,
                  s.split.num_blocks(s.shape) // ep * ns_flops(*s.split.block_shape(s.shape), method=method, dtype=NS_DTYPE))
    return out


def rows_for_world(config, world: int, device, args, expert_layout: str, method: str) -> list[dict]:
    start, cpu = time.perf_counter(), time.process_time()
    specs, plan = plan_world(config, world, device, expert_layout=expert_layout,
                             replica_split=args.replica_split, bucket_mb=args.bucket_mb, ns_method=method)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    total = total_ns_flops(specs, method)
    elems = local_elements(specs, world)
    bound = lower_bound(total, world, device)
    s = plan.stats
    est = project(device, s.flops, s.sent_intra, s.recv_intra, s.sent_inter, s.recv_inter, elems, plan.num_buckets)
    layout = kimi_layout(world, expert_layout)
    common = dict(world=world, lower_bound_s=bound, total_ns_pflop=total / 1e15, expert_layout=expert_layout,
                  ns_method=method,
                  layout=f"dense {layout.dp_replicate}x{layout.dp_shard}, experts "
                         f"{layout.edp_replicate}x{layout.edp_shard}x{layout.ep}")
    traffic = {k: getattr(s, k) for k in ("sent_intra", "recv_intra", "sent_inter", "recv_inter")}
    rows = [dict(common, method="sharded", **_estimate(est, s.flops, traffic, plan.num_buckets),
                 load_ratio=float(s.load_ratio), replica_split=plan.replica_split, plan_seconds=seconds,
                 plan_cpu_seconds=cpu)]
    g = gather_all_traffic(specs, world, method)
    # one gather per parameter, the next one in flight during this one's NS (generous: Moonlight's is sequential)
    est_g = project(device, g["flops"], g["sent_intra"], g["recv_intra"], g["sent_inter"], g["recv_inter"], elems,
                    len(specs))
    rows.append(dict(common, method="gather_all", **_estimate(est_g, g["flops"], g, len(specs)),
                     load_ratio=float(g["flops"].max() / g["flops"].mean())))
    for row in rows:
        row["vs_bound"] = row["step_s"] / bound
    return rows


def _estimate(est, flops, traffic, buckets) -> dict:
    get = traffic.__getitem__
    return dict(step_s=est.step_s, compute_s=est.compute_s, comm_s=est.comm_s, exposed_s=est.exposed_s,
                elementwise_s=est.elementwise_s, ns_tflop_per_rank_max=float(np.max(flops)) / 1e12,
                ns_tflop_summed_over_ranks=float(np.sum(flops)) / 1e12,
                inter_gb_per_rank_max=float(np.max(np.maximum(get("sent_inter"), get("recv_inter")))) / 1e9,
                intra_gb_per_rank_max=float(np.max(np.maximum(get("sent_intra"), get("recv_intra")))) / 1e9,
                buckets=buckets)


def split_name(replica_split) -> str:
    """Plan.replica_split (True, False, "mixed") as replica_split's option names."""
    return {True: "on", False: "off", "mixed": "mixed"}.get(replica_split, "-")


def format_row(r: dict) -> str:
    split = split_name(r.get("replica_split"))
    return (f"{r['world']:5d} {r['method']:11s} {r['step_s']:9.3f} {r['compute_s']:9.3f} {r['comm_s']:8.3f} "
            f"{r['exposed_s'] + r['elementwise_s']:8.3f} {r['ns_tflop_per_rank_max']:9.1f} {r['load_ratio']:6.3f} "
            f"{r['inter_gb_per_rank_max']:8.2f} {r['intra_gb_per_rank_max']:8.2f} {r['buckets']:5d} {split:>5s} "
            f"{r['lower_bound_s']:9.4f} {r['vs_bound']:6.2f}  {r['expert_layout']:6s} {r['ns_method']:8s} "
            f"{r.get('plan_seconds', float('nan')):6.1f}  {r['layout']}")


HEADER = ("    W method         step s compute s   comm s  other s  NS TF/rk   load  inter GB intra GB "
          "bkts  rsplit  bound s  xbound  expert method   plan s  layout (dense rep x shard, experts rep x shard x ep)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write {'rows': [...]} to this path")
    p.add_argument("--device", default="h200", choices=sorted(DEVICES))
    p.add_argument("--calibration", help="JSON of optimizer_step.py --calibrate-kimi N (a GPU run)")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    p.add_argument("--expert-layouts", default="wide,narrow", help=f"comma-separated subset of {EXPERT_LAYOUTS}")
    p.add_argument("--ns-methods", default="standard,gram", help=f"comma-separated subset of {NS_METHODS}")
    p.add_argument("--replica-split", default="auto", choices=REPLICA_SPLIT)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--time-planning", type=int, default=0, metavar="N",
                   help="only plan, N times per (layout, method, W), and print median wall / CPU seconds")
    return p.parse_args(argv)


def time_planning(config, device, args) -> list[dict]:
    """Median wall and CPU seconds of planning each (expert layout, NS method, W), N runs each."""
    rows = []
    print(f"expert   method       W  plan wall s  plan cpu s  replica split  (medians of {args.time_planning})")
    for expert_layout in args.expert_layouts.split(","):
        for method in args.ns_methods.split(","):
            for world in map(int, args.worlds.split(",")):
                wall, cpu = [], []
                for _ in range(args.time_planning):
                    start, c = time.perf_counter(), time.process_time()
                    _, plan = plan_world(config, world, device, expert_layout=expert_layout,
                                         replica_split=args.replica_split, bucket_mb=args.bucket_mb, ns_method=method)
                    wall.append(time.perf_counter() - start), cpu.append(time.process_time() - c)
                rows.append(dict(expert_layout=expert_layout, ns_method=method, world=world, runs=len(wall),
                                 plan_wall_s=float(np.median(wall)), plan_cpu_s=float(np.median(cpu)),
                                 replica_split=plan.replica_split))
                print(f"{expert_layout:8s} {method:8s} {world:5d} {rows[-1]['plan_wall_s']:11.2f} "
                      f"{rows[-1]['plan_cpu_s']:11.2f}  {split_name(plan.replica_split):>13}", flush=True)
    return rows


@user_errors
def main(argv=None) -> dict:
    args = parse_args(argv)
    check_outputs([("--json", args.json)], [("the --calibration file", args.calibration)])
    device = device_model(args.device, args.calibration)
    config = preset("kimi_k2_1t")
    if args.time_planning:
        out = {"planning": time_planning(config, device, args)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return out
    print(f"Kimi K2 optimizer step on {device.name}: NS {device.sustained_tflops:.0f} TFLOP/s sustained "
          f"(peak {device.peak_tflops:.0f}), NVLink {device.nvlink_gbs:.0f} GB/s, network {device.network_gbs:.0f} "
          f"GB/s per GPU and direction, HBM {device.hbm_gbs:.0f} GB/s [{device.source}]")
    print("step = max(compute, comm) + comm/buckets + buckets x latency + elementwise (other s = the last two terms)")
    print(HEADER)
    rows = []
    for expert_layout in args.expert_layouts.split(","):
        for method in args.ns_methods.split(","):
            for world in map(int, args.worlds.split(",")):
                for row in rows_for_world(config, world, device, args, expert_layout, method):
                    rows.append(row)
                    print(format_row(row), flush=True)
    summary = _summary(rows)
    print(summary["text"])
    out = {"device": device.__dict__, "rows": rows,
           "smallest_world_reaching_0_2_s": summary["smallest"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return out


def _summary(rows) -> dict:
    """Smallest W reaching TARGET_S per (optimizer, expert layout, NS method)."""
    lines, smallest = [], {}
    keys = dict.fromkeys((r["method"], r["expert_layout"], r["ns_method"]) for r in rows)
    for key in keys:
        hits = [r["world"] for r in rows if (r["method"], r["expert_layout"], r["ns_method"]) == key
                and r["step_s"] <= TARGET_S]
        smallest["/".join(key)] = min(hits) if hits else None
        lines.append(f"smallest W with a projected step <= {TARGET_S} s, {' / '.join(key)}: "
                     f"{min(hits) if hits else 'none of the W planned'}")
    return {"text": "\n".join(lines), "smallest": smallest}


if __name__ == "__main__":
    main()
