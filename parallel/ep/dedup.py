"""Node-deduplicated EP dispatch (`parallel.ep_dedup`): a token crosses to each destination node once.

The `route` of parallel/ep/dispatcher.py `DedupDispatcher` (the dispatch interface, models/moe.py). For
one MoE layer, on each rank (the plan: parallel/ep/plan.py, "dedup"):
  1. pairs: the distinct (token, node) pairs of this rank's routing, ordered by node then token;
     their counts and their expert copies' counts are exchanged with the gateways (all-to-all of 2
     ints per peer) and read on the host (host sync 1: split sizes),
  2. node hop: each pair's activation row, its K routing weights (compute dtype, 0 for experts on
     other nodes) and K expert ids (-1 for experts on other nodes) go to the node's gateway
     (three all-to-alls; the only ones that cross nodes on the way out),
  3. fan-out: the gateway sorts the received copies by expert and runs the EP experts
     (parallel/ep/direct.py: count exchange, host sync 2, dispatch, grouped matmul, combine;
     or their pieces pipelined, parallel/ep/pieces.py); every copy's expert is on the gateway's
     node, so these rows stay inside it (the node hop itself is not pipelined),
  4. the gateway weights each copy's output and sums them per pair (index_add), and one row per
     pair goes back to the source (the only combine rows that cross nodes), which sums its nodes'
     rows per token.
Every step is differentiable (index ops and autograd all-to-alls), so the backward mirrors it: the
gradient of a pair's row crosses nodes once each way (under parallel.ep_combine_grad_dtype the node
combine's and the fan-in's gradients as FP8 rows, parallel/ep/direct.py: rounded twice). Exact up to the
summation order of the K weighted outputs (node partial sums, then across nodes): fp32 results equal
the direct path's to a few ulps (tests/ranks/test_ep_dispatch.py).

A GPU backend (DeepEP's internode dispatch/combine, or a symmetric-memory dispatcher) slots in here:
it replaces steps 1-4 behind the same `route(moe, x_TD, weights_TK, experts_TK) -> out_TD` signature.

Shape letters: T tokens of this rank, K top-k, D model dim, N nodes, P ep ranks, Q pairs this rank
sends, R pairs it receives as a gateway, C expert copies it fans out.
"""

import torch
import torch.distributed as dist

from models.moe import expert_counts
from parallel.ep.direct import all_to_all, dispatch_rows
from parallel.ep.keep import kept
from parallel.ep.plan import Placement, expert_nodes, index_tensor, pair_order, pairs_per_node


def dedup_route(d, moe, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
    """The route of dispatcher `d` (a DedupDispatcher: placement, group, rank) for MoE layer `moe`
    (module docstring)."""
    placement, group = d.placement, d.group
    T, K = experts_TK.shape
    node_TK = expert_nodes(experts_TK, placement)
    present_TN, pairs_N = pairs_per_node(node_TK, placement.n_nodes)
    copies_N = torch.zeros_like(pairs_N).index_add_(0, node_TK.flatten(), torch.ones_like(node_TK.flatten()))
    send_splits, recv_splits, n_copies = kept(d.tape, "pair_counts", lambda: _exchange_pair_counts(
        pairs_N, copies_N, placement, d.rank, group))  # host sync (none when a recompute replays it)
    token_Q, node_Q = pair_order(present_TN, sum(send_splits))
    on_node_QK = node_TK[token_Q] == node_Q[:, None]
    ids_QK = experts_TK[token_Q].masked_fill(~on_node_QK, -1)
    w_QK = weights_TK[token_Q].to(x_TD.dtype) * on_node_QK  # rounded to the compute dtype, as MoE.combine does

    x_RD = dispatch_rows(d, x_TD[token_Q], recv_splits, send_splits)  # communication: node hop (dispatch)
    w_RK = all_to_all(d, w_QK, recv_splits, send_splits)
    ids_RK = all_to_all(d, ids_QK, recv_splits, send_splits)
    partial_RD = fan_out(d, x_RD, w_RK, ids_RK, n_copies, moe.router.n_experts,
                         lambda x, counts: moe.experts(x, counts, d))  # communication: inside the node
    back_QD = all_to_all(d, partial_RD, send_splits, recv_splits, d.config.combine_grad_fp8)  # communication: node hop (combine)
    return back_QD.new_zeros(T, back_QD.shape[1]).index_add(0, token_Q, back_QD)


def _exchange_pair_counts(pairs_N, copies_N, placement: Placement, ep_rank: int, group):
    """(send splits, recv splits per ep index, copies this rank fans out as a gateway): this rank's pairs
    go to its gateway on each node; all-to-all of two ints per peer (pairs, their expert copies on
    that node), then one read on the host (the hop's host sync)."""
    gateway_N = index_tensor(placement.gateway(ep_rank), pairs_N.device)
    send_P2 = torch.zeros(placement.size, 2, dtype=torch.int64, device=pairs_N.device).index_add_(
        0, gateway_N, torch.stack([pairs_N, copies_N], dim=1))
    recv_P2 = torch.empty_like(send_P2)
    dist.all_to_all_single(recv_P2, send_P2, group=group)  # communication: pair and copy counts
    send, recv, copies = torch.stack([send_P2[:, 0], recv_P2[:, 0], recv_P2[:, 1]]).tolist()
    return send, recv, sum(copies)


def fan_out(d, x_RD, w_RK, ids_RK, n_copies: int, n_experts: int, experts_call) -> torch.Tensor:
    """At the gateway: every received copy (pair, k with an expert on this node; `n_copies` of them,
    known on the host from the hop's count exchange) through the EP experts (`experts_call(x, counts)`:
    the direct dispatch inside the node), weighted and summed per pair (partial_RD)."""
    R, K = ids_RK.shape
    key_N = ids_RK.masked_fill(ids_RK < 0, n_experts).flatten()  # copies for other nodes sort last
    counts = d.exchange(expert_counts(key_N, n_experts + 1)[:n_experts])  # the experts' own count exchange
    order_C = torch.argsort(key_N, stable=True)[:n_copies]
    y_CD = experts_call(x_RD[order_C // K], counts)  # host sync: the fan-out's split sizes
    weighted_CD = y_CD * w_RK.flatten()[order_C][:, None]
    return weighted_CD.new_zeros(R, weighted_CD.shape[1]).index_add(0, order_C // K, weighted_CD)
