"""The EP dispatch plan: where each routed token copy goes, and what every all-to-all of a MoE layer moves.

Pure functions of the routing (`experts_TK`) and the placement (which global rank holds which experts,
which node each rank sits on): no process group. The runtime (parallel/ep/direct.py,
parallel/ep/dedup.py) builds its send buffers and split sizes with them, and the whole-step projection
(benchmarks/step_projection.py) counts bytes with the same functions on sampled routing, so a byte
in the projection is a byte the runtime sends.

Two dispatch schemes:
  direct  every token copy (token, k) goes to the ep rank owning expert k: a token whose K experts
          sit on r distinct ranks crosses the wire r times (rows[src, dst] = copies).
  dedup   (DeepSeek-V3's node-limited dispatch) a token crosses to each destination NODE once, to
          that node's gateway rank for this source (`Placement.gateway`), with its K expert ids and
          routing weights (ids of experts elsewhere masked to -1, weights to 0); the gateway fans the
          copies out to the experts' ranks inside the node, sums the weighted expert outputs of each
          (token, node) pair and sends one row back. Inter-node rows = distinct (token, node) pairs.
Nodes are `ranks_per_node` consecutive global ranks (parallel.ranks_per_node).

Stages of one MoE layer's forward (`layer_traffic`): each is one all-to-all over the ep group, given
as rows[src, dst] (ep indices, self included) and the bytes of one row. The combine of each dispatch
stage is its transpose; the backward sends each differentiable stage's gradient the opposite way
(same rows; bytes per row `Stage.grad_row_bytes` where the gradient crosses in another dtype than the
forward's rows: FP8 dispatch, FP8 combine gradient), integer stages are not repeated.

Shape letters: T tokens of one rank, K top-k, E experts, L experts per ep rank, P ep ranks,
N nodes spanned by the ep group, Q (token, node) pairs.
"""

import functools
import math
from dataclasses import dataclass

import torch

ID_BYTES = 8  # expert ids and counts cross as int64


@dataclass(frozen=True)
class Placement:
    """Experts [p*L, (p+1)*L) on ep index p; ep index p is global rank ep_ranks[p]."""
    n_experts: int
    ep_ranks: tuple[int, ...]
    ranks_per_node: int

    @property
    def size(self) -> int:
        return len(self.ep_ranks)

    @property
    def local_experts(self) -> int:
        return self.n_experts // self.size

    @functools.cached_property
    def node_of_rank(self) -> tuple[int, ...]:
        """Node index (0..N-1, in order of first appearance) of each ep index."""
        nodes = list(dict.fromkeys(r // self.ranks_per_node for r in self.ep_ranks))
        return tuple(nodes.index(r // self.ranks_per_node) for r in self.ep_ranks)

    @property
    def n_nodes(self) -> int:
        return max(self.node_of_rank) + 1

    def members(self, node: int) -> list[int]:
        return [p for p, n in enumerate(self.node_of_rank) if n == node]

    def gateway(self, src: int) -> tuple[int, ...]:
        """The ep index that receives `src`'s tokens on each node: the member at src's position in its
        own node (mod the node's size), so each source has one gateway per node, itself on its own."""
        position = self.members(self.node_of_rank[src]).index(src)
        return tuple(self.members(n)[position % len(self.members(n))] for n in range(self.n_nodes))


@functools.lru_cache(maxsize=None)
def index_tensor(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small int64 index tensor made from host data once per device (a host-to-device copy: a
    host sync on CUDA, runtime/syncs.py), then reused by every layer and step."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def expert_nodes(experts_TK: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Node index of each copy's expert (int64 [T, K])."""
    return index_tensor(placement.node_of_rank, experts_TK.device)[experts_TK // placement.local_experts]


def copies_per_rank(experts_TK: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Token copies for each ep index (int64 [P]): the direct dispatch's send rows."""
    rank_N = (experts_TK // placement.local_experts).flatten()
    return torch.zeros(placement.size, dtype=torch.int64, device=rank_N.device).index_add_(
        0, rank_N, torch.ones_like(rank_N))


def pairs_per_node(node_TK: torch.Tensor, n_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(present_TN bool: token t has an expert on node n, pairs per node int64 [N]). No host sync."""
    present_TN = torch.zeros(node_TK.shape[0], n_nodes, dtype=torch.bool, device=node_TK.device)
    present_TN.scatter_(1, node_TK, True)
    return present_TN, present_TN.sum(0)


def pair_order(present_TN: torch.Tensor, n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_Q, node_Q) of the present pairs sorted by node, then token. `n_pairs` (a host int the
    caller already has from the split sizes) sizes the result, so this needs no host sync."""
    T, N = present_TN.shape
    key_TN = torch.arange(N, device=present_TN.device) * T + torch.arange(T, device=present_TN.device)[:, None]
    key_TN = key_TN.masked_fill(~present_TN, N * T)
    order_Q = torch.argsort(key_TN.flatten(), stable=True)[:n_pairs]
    return order_Q // N, order_Q % N


def distinct_nodes_per_token(experts_TK: torch.Tensor, placement: Placement) -> torch.Tensor:
    """How many nodes each token's experts span (int64 [T])."""
    present_TN, _ = pairs_per_node(expert_nodes(experts_TK, placement), placement.n_nodes)
    return present_TN.sum(1)


@dataclass(frozen=True)
class Stage:
    """One all-to-all: rows[src, dst] over ep indices (self included), `row_bytes` each;
    `backward`: its gradient crosses back in backward (same rows, `grad_row_bytes` each when given)."""
    name: str
    rows: torch.Tensor  # int64 [P, P]
    row_bytes: int
    backward: bool
    grad_row_bytes: int | None = None  # bytes of one gradient row when not row_bytes (FP8 dispatch; FP8 combine gradient)

    def bytes_PP(self, backward: bool = False) -> torch.Tensor:
        return self.rows * (self.grad_row_bytes or self.row_bytes if backward else self.row_bytes)


def capacity_slots(copies: int, n_ranks: int, factor: float) -> int:
    """C: the rows a rank sends every peer under a fixed capacity (parallel/ep/capacity.py), from
    host-known sizes only (T K copies of this rank)."""
    return max(1, math.ceil(factor * copies / n_ranks))


def layer_traffic(experts_by_rank: list[torch.Tensor], placement: Placement, dim: int, act_bytes: int,
                  dedup: bool, dispatch_bytes: int | None = None, capacity_factor: float = 0.0,
                  chunks: int = 1, combine_grad_bytes: int | None = None) -> list[Stage]:
    """Every all-to-all of one MoE layer's forward, given each ep rank's routing (experts_TK per ep
    index). `dispatch_bytes`: bytes of one dispatched row when it crosses in another dtype than the
    compute dtype (low-precision dispatch: values plus their scale); the combine uses act_bytes.
    `combine_grad_bytes`: bytes of one row of a combine's gradient when not dim x act_bytes
    (parallel.ep_combine_grad_dtype; with dedup both the fan-in's and the node combine's).
    `capacity_factor` > 0: the fixed-capacity dispatch (C rows to every peer, their expert ids);
    `chunks` > 1: the overlapped dispatch (parallel/ep/pieces.py: the same rows in `chunks` pieces,
    one count exchange of chunks x L ints per peer; with dedup, parallel/ep/pieces.py: the node
    hop's counts per piece, and each piece's fan-out exchanging L ints per peer)."""
    P, L, K = placement.size, placement.local_experts, experts_by_rank[0].shape[1]
    dispatch_bytes = dim * act_bytes if dispatch_bytes is None else dispatch_bytes
    combine = functools.partial(Stage, row_bytes=dim * act_bytes, backward=True, grad_row_bytes=combine_grad_bytes)
    if capacity_factor > 0:
        slots = torch.full((P, P), capacity_slots(experts_by_rank[0].numel(), P, capacity_factor), dtype=torch.int64)
        return [Stage("dispatch", slots, dispatch_bytes, True, dim * act_bytes),
                Stage("slot_ids", slots, ID_BYTES, False),
                combine("combine", slots)]
    counts = torch.full((P, P), L * chunks, dtype=torch.int64)  # the per-expert count exchange
    if not dedup:
        copies = torch.stack([copies_per_rank(e, placement) for e in experts_by_rank])
        return [Stage("counts", counts, ID_BYTES, False),
                Stage("dispatch", copies, dispatch_bytes, True, dim * act_bytes),
                combine("combine", copies.T.contiguous())]
    pairs, fan = torch.zeros(P, P, dtype=torch.int64), torch.zeros(P, P, dtype=torch.int64)
    for src, experts_TK in enumerate(experts_by_rank):
        gateway_N = torch.tensor(placement.gateway(src))
        node_TK = expert_nodes(experts_TK, placement)
        present_TN, pairs_N = pairs_per_node(node_TK, placement.n_nodes)
        pairs[src].index_add_(0, gateway_N, pairs_N)
        # the gateway of node n fans each copy with an expert on n out to the expert's rank
        fan.index_put_((gateway_N[node_TK].flatten(), (experts_TK // L).flatten()),
                       torch.ones(experts_TK.numel(), dtype=torch.int64), accumulate=True)
    node_counts = torch.full((P, P), 2 * chunks, dtype=torch.int64)  # pairs and their copies, per peer (and piece)
    return [Stage("node_counts", node_counts, ID_BYTES, False),
            Stage("node_dispatch", pairs, dispatch_bytes, True, dim * act_bytes),
            Stage("node_weights", pairs, K * act_bytes, True),
            Stage("node_ids", pairs, K * ID_BYTES, False),
            Stage("counts", counts, ID_BYTES, False),
            Stage("fan_out", fan, dispatch_bytes, True, dim * act_bytes),
            combine("fan_in", fan.T.contiguous()),
            combine("node_combine", pairs.T.contiguous())]


def sent_bytes(stages: list[Stage], placement: Placement, backward: bool = False) -> dict:
    """{"intra": int64 [P], "inter": int64 [P]}: bytes each ep index sends to peers on its own node
    and on other nodes (itself excluded), over the forward stages, or the backward ones (each
    differentiable stage's gradient, sent by its forward receiver)."""
    node_P = torch.tensor(placement.node_of_rank)
    same_PP = node_P[:, None] == node_P[None, :]
    not_self_PP = ~torch.eye(placement.size, dtype=torch.bool)
    total = torch.zeros(placement.size, placement.size, dtype=torch.int64)
    for s in stages:
        if backward and s.backward:
            total += s.bytes_PP(backward=True).T
        elif not backward:
            total += s.bytes_PP()
    return {"intra": (total * (same_PP & not_self_PP)).sum(1), "inter": (total * ~same_PP).sum(1)}


def host_syncs_per_layer(ep_config) -> int:
    """Host readbacks of split sizes per MoE layer forward under EP with the knobs `ep_config`
    (parallel/ep/config.py): the direct dispatch 1 (its count exchange), overlapped 1 (one for all
    pieces), dedup 2 (the node hop's, then the fan-out's), dedup in n pieces 1 + n (the node hop's, then
    each piece's fan-out: parallel/ep/pieces.py), fixed capacity 0 (tests/ranks/test_ep_dispatch.py and
    tests/ranks/test_host_syncs.py count them)."""
    if ep_config.ep_capacity_factor > 0:
        return 0
    if ep_config.ep_dedup:
        return 2 if ep_config.ep_overlap_chunks == 1 else 1 + ep_config.ep_overlap_chunks
    return 1
