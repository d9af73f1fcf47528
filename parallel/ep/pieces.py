"""EP dispatch in pieces (`parallel.ep_overlap_chunks` = n > 1): one piece's all-to-alls in flight while
another piece computes, in forward and in backward; the direct dispatch's pieces (`pieces_run`) and the
node-deduplicated dispatch's node hop in pieces (`pipelined_route`, section below), both on one
asynchronous start/wait autograd pair (`start_rows`, `wait_rows`).

`pieces_run`: the dispatcher's experts' call (parallel/ep/dispatcher.py; the direct path's inputs and output: token
copies sorted by expert, out in the same order), so FSDP gathers the experts once per micro-batch, not
once per piece:
  1. pieces: the copies bound for each ep rank are cut into n consecutive slices (copy at position
     `pos` of destination p's n_p rows -> piece floor(pos n / n_p)), so every piece sends to every
     peer; within a piece the rows stay sorted by expert;
  2. one count exchange for all pieces (all-to-all of [n, L] ints per peer) and one host read of the
     split sizes: the layer's one host sync, as in the direct path;
  3. the pipeline: dispatch(0) starts; for each piece i: dispatch(i+1) starts, dispatch(i) is
     waited for, piece i's grouped matmul runs, combine(i) starts; then the combines are waited for.
     The all-to-alls are asynchronous (`async_op=True`; gloo runs them on its own threads, NCCL on
     its stream) and split into a start and a wait autograd node. In backward the wait node starts
     the gradient's all-to-all and the start node waits for it; autograd runs ready nodes latest
     first, so piece i+1's gradient all-to-all is in flight while piece i's matmul gradients run.
Under parallel.ep_dispatch_dtype = "float8_e4m3" each piece's dispatch crosses as FP8 rows (parallel/ep/direct.py:
encoded at the start, decoded at the wait; the gradient in the compute dtype), so the start node returns
an empty link tensor and the rows travel in the box. Under parallel.ep_combine_grad_dtype = "float8_e4m3"
each piece's combine gradient crosses as FP8 rows (box["grad_fp8"]: encoded by the wait node's backward,
decoded by the start node's). Under parallel.ep_recompute = "keep" a recompute
replays the kept receive buffers and issues nothing (parallel/ep/keep.py).
Exact: each copy's output depends on its own row only, and the weight gradients sum the same
products in n groups (fp32: equal to a few ulps, tests/ranks/test_ep_dispatch.py). The dispatcher's
`timeline`, when a list, receives (event, piece, time) records: tests/benchmarks read the overlap from it.

Node-deduplicated, its node hop in pieces (`parallel.ep_dedup` with `ep_overlap_chunks` = n > 1): one
piece's node hop (the all-to-alls that cross nodes) in flight while another piece fans out, computes and
sums inside the gateway's node.

`pipelined_route`: the route of parallel/ep/dispatcher.py `DedupDispatcher` when `chunks` > 1
(parallel/ep/dedup.py's plan, the pairs cut into pieces), the pipeline running inside ONE call of the
experts (FSDP gathers them once per micro-batch, not once per piece). For one MoE layer, on each rank:
  1. pairs: the distinct (token, node) pairs as in parallel/ep/dedup.py; those bound for each node are
     cut into n consecutive slices (pair at position `pos` of node m's c_m pairs -> piece
     floor(pos n / c_m)), so every piece goes to every gateway; sent ordered by (piece, node, token);
  2. one count exchange for all pieces (all-to-all of [n, 2] ints per peer: pairs and their expert
     copies on that node) and one host read of the split sizes;
  3. the pipeline, in one GroupedExperts call: node hop(0) starts (rows, FP8 under ep_dispatch_dtype;
     K weights; K ids: three async all-to-alls); for each piece i: node hop(i+1) starts, node hop(i) is
     waited for, the gateway fans piece i's copies out inside its node (the direct EP dispatch:
     count exchange and host sync, dispatch, grouped matmul, combine; parallel/ep/direct.py),
     weights and sums them per pair, and the node combine(i) starts; then the combines are waited for.
     The async all-to-alls are the start/wait autograd pair above, so the backward
     mirrors it: piece i+1's gradient node hop is in flight while piece i's gradients compute (the node
     combine's and the fan-in's gradients as FP8 rows under parallel.ep_combine_grad_dtype).
Host syncs per layer: 1 (step 2) + n (each piece's fan-out counts, known only once the piece's ids
arrive; on a GPU the next piece's node hop is already queued, so it stays in flight during the wait).
Exact: each pair's row depends on its own token only, and the weight gradients sum the same products
in n groups (fp32: equal to a few ulps, tests/ranks/test_ep_dispatch.py).

Shape letters: N token copies of this rank (sorted by expert), D model dim, E experts, P ep ranks,
L local experts, n pieces, M rows of one piece sent, R rows of one piece received; in the dedup section
T tokens of this rank, K top-k, Q pairs this rank sends (all pieces), R pairs of one piece a gateway
receives, C their expert copies.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.ep.dedup import fan_out
from parallel.ep.direct import decode, direct_run, encode, local_experts, local_weight
from parallel.ep.keep import kept
from parallel.ep.plan import expert_nodes, index_tensor, pairs_per_node


def pieces_run(d, x_ND: torch.Tensor, counts_E: torch.Tensor, w13, w2) -> torch.Tensor:
    """The experts' call of dispatcher `d` with `d.config.ep_overlap_chunks` pieces (module docstring)."""
    n, P = d.config.ep_overlap_chunks, d.n_ranks
    L = counts_E.shape[0] // P
    piece_N, piece_counts_nPL = _pieces(counts_E, P, L, n, x_ND.shape[0])
    recv_counts_nPL, sizes = kept(d.tape, "piece_counts", lambda: _exchange(piece_counts_nPL, d.group))  # parallel/ep/keep.py
    order_N = torch.argsort(piece_N, stable=True)  # pieces in order, each still sorted by expert
    rows = [sum(s) for s in sizes[0]]
    x_pieces = torch.split(x_ND[order_N], rows)
    y_pieces = _pipeline(d, x_pieces, sizes, recv_counts_nPL, w13, w2)
    return torch.empty_like(x_ND).index_copy(0, order_N, torch.cat(y_pieces))


def _pieces(counts_E, P: int, L: int, n: int, N: int):
    """(piece of each copy, copies per (piece, ep rank, local expert) [n, P, L]), on the device."""
    counts_PL = counts_E.view(P, L)
    expert_N = torch.repeat_interleave(torch.arange(P * L, device=counts_E.device), counts_E, output_size=N)
    rank_N = expert_N // L
    per_rank_P = counts_PL.sum(1)
    position_N = torch.arange(N, device=counts_E.device) - (torch.cumsum(per_rank_P, 0) - per_rank_P)[rank_N]
    piece_N = position_N * n // per_rank_P[rank_N].clamp(min=1)
    flat = torch.zeros(n * P * L, dtype=torch.int64, device=counts_E.device)
    flat.index_add_(0, piece_N * P * L + expert_N, torch.ones_like(expert_N))
    return piece_N, flat.view(n, P, L)


def _exchange(counts_nPL: torch.Tensor, group):
    """All-to-all of the [n, L] counts bound for each peer: (what each peer sends me [n, P, L], the split
    sizes [[send per piece and peer], [receive per piece and peer]] read on the host: the host sync)."""
    n, P, L = counts_nPL.shape
    send_PnL = counts_nPL.transpose(0, 1).contiguous()
    recv_PnL = torch.empty_like(send_PnL)
    dist.all_to_all_single(recv_PnL, send_PnL, group=group)  # communication: counts of every piece
    recv_counts_nPL = recv_PnL.transpose(0, 1).contiguous()
    return recv_counts_nPL, torch.stack([counts_nPL.sum(2), recv_counts_nPL.sum(2)]).tolist()


def _pipeline(d, x_pieces, sizes, recv_counts_nPL, w13, w2) -> list[torch.Tensor]:
    """Dispatch, grouped matmul and combine of every piece, the all-to-alls of one piece in flight while
    another computes (module docstring, step 3)."""
    send, recv = sizes
    n = len(x_pieces)
    dispatched = [None] * n
    dispatched[0] = start_rows(d, "dispatch", 0, x_pieces[0], recv[0], send[0])
    combined = []
    for i in range(n):
        if i + 1 < n:
            dispatched[i + 1] = start_rows(d, "dispatch", i + 1, x_pieces[i + 1], recv[i + 1], send[i + 1])
        x_RD = wait_rows(*dispatched[i])
        d.mark("compute_start", i)
        y_RD = local_experts(x_RD, recv_counts_nPL[i], w13, w2)
        d.mark("compute_end", i)
        combined.append(start_rows(d, "combine", i, y_RD, send[i], recv[i]))
    return [wait_rows(*c) for c in combined]


def start_rows(d, name, piece, x_MD, out_splits, in_splits):
    """Start an async all-to-all of x_MD's rows over dispatcher `d`'s group (a dispatch in FP8 under
    `d.config.dispatch_fp8`, a combine's gradient under `d.config.combine_grad_fp8`); returns (autograd
    link, handle box) for `wait_rows`. Other names (dedup's node hop: weights, ids) cross as they are."""
    box = {"mark": lambda event: d.mark(f"{name}_{event}", piece),
           "fp8": name == "dispatch" and d.config.dispatch_fp8,
           "grad_fp8": name == "combine" and d.config.combine_grad_fp8, "tape": d.tape}
    link = _Start.apply(x_MD, out_splits, in_splits, d.group, box)
    return link, box


def wait_rows(link, box):
    """The received rows of the all-to-all `start_rows` issued, in x's dtype (FP8 rows decoded)."""
    return _Wait.apply(link, box)


class _Start(torch.autograd.Function):
    """Forward: issue the all-to-all (async) into a new buffer (in the box) and return an empty link
    tensor that ties `_Wait` to this node. Backward: wait for the gradient's all-to-all that
    `_Wait.backward` issued, and return its result in the gradient's dtype (decoded from FP8 rows when
    box["grad_fp8"]; a dispatch's FP8 is its forward's wire format only, as in parallel/ep/direct.py)."""

    @staticmethod
    def forward(ctx, x_MD, out_splits, in_splits, group, box):
        ctx.box = box
        box["mark"]("start")
        box["source"] = encode(x_MD) if box["fp8"] else x_MD.contiguous()  # alive until the wait
        box["work"], box["dtype"] = None, x_MD.dtype

        def issue():
            out_RB = box["source"].new_empty((sum(out_splits), *box["source"].shape[1:]))
            box["work"] = dist.all_to_all_single(out_RB, box["source"], out_splits, in_splits, group=group,
                                                 async_op=True)
            return out_RB

        box["splits"], box["group"] = (out_splits, in_splits), group
        box["out"] = kept(box["tape"], "fp8_rows" if box["fp8"] else "rows", issue)  # a replayed recompute issues nothing
        return x_MD.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_link):  # the received rows' gradient is already on its way (`_Wait.backward`)
        ctx.box["grad_work"].wait()
        ctx.box["mark"]("grad_wait")
        del ctx.box["grad_source"]
        grad_in = ctx.box.pop("grad_in")
        grad_in = decode(grad_in, ctx.box["grad_dtype"]) if ctx.box["grad_fp8"] else grad_in
        return grad_in, None, None, None, None


class _Wait(torch.autograd.Function):
    """Forward: wait for the all-to-all `_Start` issued; its rows (decoded from FP8 when they crossed so).
    Backward: issue the gradient's all-to-all (async) back along the rows' way (FP8 rows when
    box["grad_fp8"]); `_Start.backward` waits for it."""

    @staticmethod
    def forward(ctx, link, box):
        ctx.box = box
        if box["work"] is not None:
            box["work"].wait()
        box["mark"]("wait")
        del box["source"]
        out = box.pop("out")
        return decode(out, box["dtype"]) if box["fp8"] else out

    @staticmethod
    def backward(ctx, grad_RD):
        out_splits, in_splits = ctx.box["splits"]
        ctx.box["mark"]("grad_start")
        ctx.box["grad_dtype"] = grad_RD.dtype
        source = encode(grad_RD) if ctx.box["grad_fp8"] else grad_RD.contiguous()
        ctx.box["grad_source"] = source  # alive until the wait
        ctx.box["grad_in"] = source.new_empty((sum(in_splits), *source.shape[1:]))
        ctx.box["grad_work"] = dist.all_to_all_single(ctx.box["grad_in"], ctx.box["grad_source"], in_splits,
                                                      out_splits, group=ctx.box["group"], async_op=True)
        return grad_RD.new_empty(0), None  # the link's gradient: `_Start.backward` returns grad_in


# -- node-deduplicated, the node hop in pieces (module docstring)

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
    placement, group, n = d.placement, d.group, d.config.ep_overlap_chunks
    T, K = experts_TK.shape
    node_TK = expert_nodes(experts_TK, placement)
    present_TN, pairs_N = pairs_per_node(node_TK, placement.n_nodes)
    piece_TN = (torch.cumsum(present_TN.long(), 0) - 1) * n // pairs_N.clamp(min=1)
    copies_TN = torch.zeros_like(piece_TN).scatter_add_(1, node_TK, torch.ones_like(node_TK))
    plan = kept(d.tape, "piece_pair_counts", lambda: _exchange_pairs(present_TN, piece_TN, copies_TN, n, placement,
                                                             d.rank, group, moe.router.n_experts))  # host sync
    token_Q, node_Q = _pair_order(present_TN, piece_TN, sum(map(sum, plan.send)))
    on_node_QK = node_TK[token_Q] == node_Q[:, None]
    ids_QK = experts_TK[token_Q].masked_fill(~on_node_QK, -1)
    w_QK = weights_TK[token_Q].to(x_TD.dtype) * on_node_QK  # rounded to the compute dtype, as MoE.routed does
    pipeline = _NodePipeline(d, w_QK, ids_QK, plan)
    back_QD = moe.experts(x_TD[token_Q], None, pipeline)  # communication: the pipeline (step 3)
    return back_QD.new_zeros(T, back_QD.shape[1]).index_add(0, token_Q, back_QD)


def _exchange_pairs(present_TN, piece_TN, copies_TN, n: int, placement, ep_rank: int, group, n_experts: int) -> PiecePlan:
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
