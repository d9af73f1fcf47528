"""Node-deduplicated dispatch with its node hop pipelined (`parallel.ep_dedup` with `ep_overlap_chunks` = n > 1):
one piece's node hop (the all-to-alls that cross nodes) in flight while another piece fans out, computes
and sums inside the gateway's node.

The route of parallel/ep/dispatcher.py `DedupDispatcher` when `chunks` > 1 (parallel/ep_dedup.py's plan,
the pairs cut into pieces), the pipeline running inside ONE call of the experts (FSDP gathers them once
per micro-batch, not once per piece). For one MoE layer, on each rank:
  1. pairs: the distinct (token, node) pairs as in ep_dedup; those bound for each node are cut into n
     consecutive slices (pair at position `pos` of node m's c_m pairs -> piece floor(pos n / c_m)), so
     every piece goes to every gateway; the pairs are sent ordered by (piece, node, token);
  2. one count exchange for all pieces (all-to-all of [n, 2] ints per peer: pairs and their expert
     copies on that node) and one host read of the split sizes;
  3. the pipeline, in one GroupedExperts call: node hop(0) starts (rows, FP8 under ep_dispatch_dtype;
     K weights; K ids: three async all-to-alls); for each piece i: node hop(i+1) starts, node hop(i) is
     waited for, the gateway fans piece i's copies out inside its node (the direct EP dispatch:
     count exchange and host sync, dispatch, grouped matmul, combine; parallel/expert_parallel.py),
     weights and sums them per pair, and the node combine(i) starts; then the combines are waited for.
     The async all-to-alls are parallel/ep_overlap.py's start/wait autograd pair, so the backward
     mirrors it: piece i+1's gradient node hop is in flight while piece i's gradients compute (the node
     combine's and the fan-in's gradients as FP8 rows under parallel.ep_combine_grad_dtype).
Host syncs per layer: 1 (step 2) + n (each piece's fan-out counts, known only once the piece's ids
arrive; on a GPU the next piece's node hop is already queued, so it stays in flight during the wait).
Exact: each pair's row depends on its own token only, and the weight gradients sum the same products
in n groups (fp32: equal to a few ulps, tests/test_ep_dispatch.py).

Shape letters: T tokens of this rank, K top-k, D model dim, N nodes, P ep ranks, Q pairs this rank
sends (all pieces), R pairs of one piece a gateway receives, C their expert copies, n pieces.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.moe import expert_counts
from parallel.ep_dedup import fan_out
from parallel.ep_keep import kept
from parallel.ep_overlap import start_rows, wait_rows
from parallel.ep_plan import expert_nodes, index_tensor, pairs_per_node
from parallel.expert_parallel import direct_run, local_weight


@dataclass
class PiecePlan:
    """Host split sizes of one layer's pieces: send[i][p] / recv[i][p] pairs of piece i to / from ep
    index p, copies[i] expert copies this rank fans out for piece i as a gateway; E experts."""
    send: list
    recv: list
    copies: list
    n_experts: int


def pipelined_route(d, moe, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
    """The route of dispatcher `d` for MoE layer `moe` (module docstring, steps 1-2; the experts' call
    runs step 3)."""
    placement, group, n = d.placement, d.group, d.config.chunks
    T, K = experts_TK.shape
    node_TK = expert_nodes(experts_TK, placement)
    present_TN, pairs_N = pairs_per_node(node_TK, placement.n_nodes)
    piece_TN = (torch.cumsum(present_TN.long(), 0) - 1) * n // pairs_N.clamp(min=1)
    copies_TN = torch.zeros_like(piece_TN).scatter_add_(1, node_TK, torch.ones_like(node_TK))
    plan = kept("piece_pair_counts", lambda: _exchange(present_TN, piece_TN, copies_TN, n, placement,
                                                       d.rank, group, moe.router.n_experts))  # host sync
    token_Q, node_Q = _pair_order(present_TN, piece_TN, sum(map(sum, plan.send)))
    on_node_QK = node_TK[token_Q] == node_Q[:, None]
    ids_QK = experts_TK[token_Q].masked_fill(~on_node_QK, -1)
    w_QK = weights_TK[token_Q].to(x_TD.dtype) * on_node_QK  # rounded to the compute dtype, as MoE.routed does
    pipeline = _NodePipeline(d, w_QK, ids_QK, plan)
    back_QD = moe.experts(x_TD[token_Q], None, pipeline)  # communication: the pipeline (step 3)
    return back_QD.new_zeros(T, back_QD.shape[1]).index_add(0, token_Q, back_QD)


def _exchange(present_TN, piece_TN, copies_TN, n: int, placement, ep_rank: int, group, n_experts: int) -> PiecePlan:
    """All-to-all of [n, 2] ints per peer (pairs of each piece bound for that gateway, their copies on its
    node), then one read on the host."""
    gateway_N = index_tensor(placement.gateway(ep_rank), present_TN.device)
    P, N = placement.size, present_TN.shape[1]
    slot_TN = (gateway_N * n + piece_TN).masked_fill(~present_TN, P * n)  # absent pairs: a spare slot
    send_S2 = torch.zeros(P * n + 1, 2, dtype=torch.int64, device=present_TN.device)
    send_S2.index_add_(0, slot_TN.flatten(), torch.stack([present_TN.long(), copies_TN], dim=2).view(-1, 2))
    send_Pn2 = send_S2[:-1].view(P, n, 2)
    recv_Pn2 = torch.empty_like(send_Pn2)
    dist.all_to_all_single(recv_Pn2, send_Pn2, group=group)  # communication: counts of every piece
    send, recv, copies = torch.stack([send_Pn2[..., 0].T, recv_Pn2[..., 0].T, recv_Pn2[..., 1].T]).tolist()
    return PiecePlan(send, recv, [sum(c) for c in copies], n_experts)


def _pair_order(present_TN, piece_TN, n_pairs: int):
    """(token_Q, node_Q) of the present pairs sorted by (piece, node, token); `n_pairs` (host) sizes it."""
    T, N = present_TN.shape
    key_TN = (piece_TN * N + torch.arange(N, device=present_TN.device)) * T + torch.arange(T, device=present_TN.device)[:, None]
    key_TN = key_TN.masked_fill(~present_TN, torch.iinfo(torch.int64).max)
    order_Q = torch.argsort(key_TN.flatten(), stable=True)[:n_pairs]
    return order_Q // N, order_Q % N


class _NodePipeline:
    """The experts' call of step 3 (the experts module calls `run`): the pieces' node hops and fan-outs."""

    def __init__(self, d, w_QK: torch.Tensor, ids_QK: torch.Tensor, plan: PiecePlan):
        self.d, self.w_QK, self.ids_QK, self.plan = d, w_QK, ids_QK, plan

    def run(self, experts, x_QD: torch.Tensor, _counts) -> torch.Tensor:
        w13, w2 = local_weight(experts.w13), local_weight(experts.w2)
        return node_pipeline(self.d, x_QD, self.w_QK, self.ids_QK, self.plan, w13, w2)


def node_pipeline(d, x_QD, w_QK, ids_QK, plan: PiecePlan, w13, w2) -> torch.Tensor:
    """Module docstring, step 3: every pair's summed expert rows from its node (back_QD, in x_QD's order)."""
    n = len(plan.send)
    rows = [sum(s) for s in plan.send]
    pieces = list(zip(torch.split(x_QD, rows), torch.split(w_QK, rows), torch.split(ids_QK, rows)))

    def hop(i):  # communication: node hop (dispatch) of piece i, across nodes
        x, w, ids = pieces[i]
        return [start_rows(d, name, i, t, plan.recv[i], plan.send[i])
                for name, t in (("dispatch", x), ("weights", w), ("ids", ids))]

    def experts_call(x, counts):
        return direct_run(d, x, counts, w13, w2)

    started = [hop(0)] + [None] * (n - 1)
    combined = []
    for i in range(n):
        if i + 1 < n:
            started[i + 1] = hop(i + 1)
        x_RD, w_RK, ids_RK = (wait_rows(*s) for s in started[i])
        d.mark("compute_start", i)
        partial_RD = fan_out(d, x_RD, w_RK, ids_RK, plan.copies[i], plan.n_experts, experts_call)  # in the node
        d.mark("compute_end", i)
        combined.append(start_rows(d, "combine", i, partial_RD, plan.send[i], plan.recv[i]))
    return torch.cat([wait_rows(*c) for c in combined])
