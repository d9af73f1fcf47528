"""Mixture-of-Experts layer (DeepSeek-V3 style): router, routed GroupedExperts, shared experts.

Balancing: aux-loss-free (DeepSeek-V3 sec. 2.1.2; Wang et al. 2024, arXiv 2408.15664) through the
`expert_bias` buffer, which only shifts top-k selection, plus an optional sequence-wise balance loss
(DeepSeek-V3 eq. 17-20) injected into the backward pass.

Shape letters: B batch, S sequence, D model dim, T tokens (B*S), E routed experts, K top-k,
N routed token copies (T*K).
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.experts import GroupedExperts, swiglu_experts
from models.layers import FeedForward
from models.region import Region
from models.splits import WHOLE, MatrixSplit


class Router(Region):
    """Token-choice top-k router.

    scores = sigmoid|softmax(gate x) in fp32; experts = top-k of (scores + expert_bias), restricted to
    the best n_limited_groups of n_expert_groups equal expert groups when n_expert_groups > 1 (a
    group's score is the sum of its two largest biased scores; DeepSeek-V3 sec. 2.1.2 node-limited
    routing); weights = the un-biased scores of those experts, normalized over the top-k for sigmoid
    when norm_topk_prob, times route_scale.
    Buffers: expert_bias [E] fp32 (moved by `update_expert_bias`, never by gradients) and
    tokens_per_expert [E] fp32 (top-k counts accumulated by every training-mode forward; eval-mode
    forwards leave it alone; a recompute under activation checkpointing restores it afterwards, see
    parallel/activation_checkpoint.py, so each micro-batch is counted once).
    """

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = c.n_routed_experts, c.n_activated_experts
        self.score_func, self.route_scale, self.norm_topk_prob = c.score_func, c.route_scale, c.norm_topk_prob
        self.n_groups, self.n_limited_groups = c.n_expert_groups, c.n_limited_groups
        self.aux_loss_alpha, self.bias_update_speed = c.aux_loss_alpha, c.bias_update_speed
        self.gate = nn.Linear(c.dim, c.n_routed_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(c.n_routed_experts, dtype=torch.float32))
        self.aux_loss = None  # last balance loss (detached), for logging; None when off
        # d(training loss)/d(aux loss) of one forward: the runtime sets it to this micro-batch's share
        # of the global batch's sequences, so the aux loss is the mean over ALL sequences of the step.
        self.aux_loss_weight = 1.0

    def body(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights_TK fp32, experts_TK int64) for the B*S flattened tokens."""
        B, S, D = x_BSD.shape
        scores_TE = self._scores(self._logits_fp32(x_BSD.reshape(B * S, D)))
        experts_TK = torch.topk(self._limit_groups(scores_TE + self.expert_bias), self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, experts_TK)
        if self.score_func == "sigmoid" and self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        weights_TK = weights_TK * self.route_scale
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(expert_counts(experts_TK, self.n_experts))  # in place: compiles under checkpointing
            if self.aux_loss_alpha > 0:
                weights_TK = self._with_aux_loss(weights_TK, scores_TE.view(B, S, -1), experts_TK.view(B, S, -1))
        return weights_TK, experts_TK

    def _with_aux_loss(self, weights_TK, scores_BSE, experts_BSK):
        """weights_TK carrying the balance loss's gradient."""
        aux_loss = self.aux_loss_alpha * sequence_balance_loss(scores_BSE, experts_BSK)
        self.aux_loss = aux_loss.detach()
        return _AddAuxLoss.apply(weights_TK, aux_loss, self.aux_loss_weight)

    def _logits_fp32(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Gate logits in fp32 even under autocast: routing decisions are sensitive to rounding."""
        with torch.autocast(x_TD.device.type, enabled=False):
            return F.linear(x_TD.float(), self.gate.weight.float())

    def _limit_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """-inf outside each token's best n_limited_groups expert groups (G groups of X experts)."""
        if self.n_groups == self.n_limited_groups:
            return choice_TE
        T, E = choice_TE.shape
        choice_TGX = choice_TE.view(T, self.n_groups, E // self.n_groups)
        group_scores_TG = choice_TGX.topk(2, dim=-1).values.sum(-1)
        groups_TL = group_scores_TG.topk(self.n_limited_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, groups_TL, True)
        return choice_TGX.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)

    def _scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.score_func == "sigmoid":
            return torch.sigmoid(logits_TE)
        return torch.softmax(logits_TE, dim=-1)

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor):
        """One aux-loss-free balancing step; call once per optimizer step.

        counts_E: tokens per expert summed over every rank and micro-batch of the step (the caller
        all-reduces `tokens_per_expert`). Under-loaded experts move up, over-loaded down, by
        bias_update_speed. Then zeroes the local `tokens_per_expert`.
        """
        counts_E = counts_E.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_speed * torch.sign(counts_E.mean() - counts_E)
        self.tokens_per_expert.zero_()

    def muon_splits(self) -> dict[str, MatrixSplit]:
        return {"gate.weight": WHOLE}


def expert_counts(experts_TK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Token copies per expert (int64 [E]) without a host sync: `torch.bincount` reads the
    maximum index on the host to size its output (a sync on CUDA); a scatter-add into a fixed-size
    buffer does not. Integer adds, so the counts are exact whatever the order."""
    idx_N = experts_TK.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=idx_N.device).scatter_add_(0, idx_N, torch.ones_like(idx_N))


def sequence_balance_loss(scores_BSE: torch.Tensor, experts_BSK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 without alpha, averaged over the B sequences.

    f_i = E / (K S) * #{t : i in topk_t};  P_i = 1/S * sum_t s_it / sum_j s_jt;  L = sum_i f_i P_i.
    Equals 1 for perfectly uniform routing. Under context parallelism each rank sees only its
    chunk of a sequence, so S is the local chunk (an approximation of the full-sequence loss).
    """
    B, S, E = scores_BSE.shape
    K = experts_BSK.shape[-1]
    with torch.no_grad():
        hits_BE = torch.zeros(B, E, device=scores_BSE.device, dtype=torch.float32)
        hits_BE.scatter_add_(1, experts_BSK.reshape(B, S * K), torch.ones(B, S * K, device=scores_BSE.device))
        f_BE = hits_BE * (E / (K * S))
    p_BE = (scores_BSE / scores_BSE.sum(-1, keepdim=True)).mean(1)
    return (f_BE * p_BE).sum(-1).mean()


class _AddAuxLoss(torch.autograd.Function):
    """Identity on the routing weights that also back-propagates d(aux_loss) = weight.

    Same effect as adding aux_loss to the training loss, without changing the model's return
    value (Megatron's MoEAuxLossAutoScaler idea). `weight` is how the training loop scales this
    forward's share of the loss (Router.aux_loss_weight).
    """

    @staticmethod
    def forward(ctx, weights_TK, aux_loss, weight):
        ctx.save_for_backward(aux_loss)
        ctx.weight = weight
        return weights_TK.view_as(weights_TK)

    @staticmethod
    def backward(ctx, grad_TK):
        (aux_loss,) = ctx.saved_tensors
        return grad_TK, torch.full_like(aux_loss, ctx.weight), None


class LocalDispatcher:
    """The dispatch interface of one MoE layer, single-process: every expert is on this rank.

    `route(moe, x_TD, weights_TK, experts_TK) -> out_TD`: sort the token copies by expert,
    `exchange(counts_E)`, run the experts' call (`run(experts, x, counts)`: dispatch -> grouped
    matmul -> combine), unsort and weight. Expert parallelism gives each MoE layer a dispatcher with
    the same calls that moves the rows to the ranks owning their experts (parallel/ep/dispatcher.py)."""

    def route(self, moe: "MoE", x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        K = experts_TK.shape[1]
        # Stable sort keeps each expert's tokens in token order (deterministic, EP-friendly).
        order_N = torch.argsort(experts_TK.flatten(), stable=True)
        counts = self.exchange(expert_counts(experts_TK, moe.router.n_experts))
        return moe.combine(moe.experts(x_TD[order_N // K], counts, self), order_N, weights_TK)

    def exchange(self, counts_E: torch.Tensor):
        """What the experts' call needs to know of the other ranks' counts: here nothing."""
        return counts_E

    def run(self, experts: GroupedExperts, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return swiglu_experts(x_TD, experts.w13, experts.w2, counts_E)


class MoE(Region):
    """router -> sort token copies by expert -> experts -> unsort -> weighted sum, + shared experts.

    The routed part runs through `dispatcher` (`LocalDispatcher` here; expert parallelism builds one
    per layer from its config). Under expert parallelism the count exchange (an all-to-all and a
    non-blocking copy of the split sizes to the host) is queued before the routed experts' FSDP
    all-gather is issued; their call then waits for the copy only (the layer's one host sync)
    while the all-gather proceeds. (Issuing the shared experts in between would hide more, but
    changes the order in which bf16 gradients of the layer input accumulate.)"""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.router = Router(c)
        self.experts = GroupedExperts(c.dim, c.moe_inter_dim, c.n_routed_experts)
        self.shared_experts = (
            FeedForward(c.dim, c.moe_inter_dim * c.n_shared_experts) if c.n_shared_experts > 0 else None
        )
        self.dispatcher = LocalDispatcher()  # not a module: no parameters, no state dict entries

    def body(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        weights_TK, experts_TK = self.router(x_BSD)
        out_TD = self.dispatcher.route(self, x_TD, weights_TK, experts_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(B, S, D)

    @staticmethod
    def combine(y_sorted_ND: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The expert outputs (sorted by expert, `order_N` the sort) back in token order, weighted and summed
        over each token's K experts (out_TD)."""
        T, K = weights_TK.shape
        y_ND = torch.empty_like(y_sorted_ND).index_copy(0, order_N, y_sorted_ND)
        # Combine in the compute dtype (the fp32 router weights are rounded to it; the sum over K
        # accumulates in fp32 inside torch's reduction): no fp32 copy of the N x D expert outputs.
        return (y_ND.view(T, K, -1) * weights_TK[..., None].to(y_ND.dtype)).sum(1)
