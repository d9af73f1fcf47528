"""Model tests: shapes, gradients, causality, positions, MoE math, routing, Muon splits, presets.

All on CPU in fp32. Tolerances: comparisons between two implementations of the same math that
only differ in summation order (grouped vs per-token matmuls, fused vs masked attention, RoPE at
shifted positions) use rtol=atol=1e-5 (fp32 epsilon is 1.2e-7; these sums have <= a few hundred
terms of O(1) values). Comparisons of the same code path on the same shapes are exact.
"""

import pytest
import torch
import torch.nn.functional as F

from models import (
    PRESETS,
    CausalAttention,
    GroupedExperts,
    ModelConfig,
    MoE,
    Transformer,
    count_params,
    preset,
)
from models.experts import _grouped_mm_ok, grouped_linear, looped_linear
from models.moe import sequence_balance_loss
from models.splits import muon_splits
from seeded_models import seeded_model

TOL = dict(rtol=1e-5, atol=1e-5)


def tokens(B=2, S=16, seed=1) -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, toks):
    logits = model(toks[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten())


# ---- forward / backward -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_forward_backward_every_param_gets_grad(name):
    model = seeded_model(name, init="generator")
    toks = tokens()
    assert model(toks).shape == (2, 16, 256)
    # Expert 0 of every MoE layer can never be selected: its weights must still get a zero grad.
    for router in model.routers():
        router.expert_bias[0] = -1e4
        router.tokens_per_expert.zero_()  # drop the counts of the shape-check forward
    loss = lm_loss(model, toks)
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    for layer in model.layers[model.config.n_dense_layers :]:
        experts, router = layer.feed_forward.experts, layer.feed_forward.router
        assert router.tokens_per_expert[0] == 0
        assert router.tokens_per_expert.sum() == 2 * 15 * model.config.n_activated_experts
        for w in (experts.w13, experts.w2):
            assert torch.all(w.grad[0] == 0) and w.grad[1:].abs().sum() > 0


def test_no_grad_experts_get_zero_grads_with_no_tokens_at_all():
    experts = GroupedExperts(dim=16, hidden_dim=8, n_experts=3)
    torch.nn.init.normal_(experts.w13), torch.nn.init.normal_(experts.w2)
    out = experts(torch.zeros(0, 16), torch.zeros(3, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0, 16)
    assert all(torch.all(w.grad == 0) for w in (experts.w13, experts.w2))


def test_causal_future_tokens_do_not_change_past_logits():
    model = seeded_model(init="generator")
    toks = tokens(B=1, S=24)
    changed = toks.clone()
    changed[0, 12:] = (changed[0, 12:] + 7) % 256
    with torch.no_grad():
        a, b = model(toks), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], **TOL)
    assert not torch.allclose(a[:, 12:], b[:, 12:])  # the test can see a change


# ---- positions and attention ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_explicit_positions(name):
    model = seeded_model(name, init="generator").eval()
    toks = tokens()
    with torch.no_grad():
        default = model(toks)
        explicit = model(toks, torch.arange(16))
        shifted = model(toks, torch.arange(16) + 1000)
    assert torch.equal(default, explicit)
    # RoPE scores depend on position differences only, so a global shift changes ~nothing.
    torch.testing.assert_close(default, shifted, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="strictly increasing"):
        model(toks, torch.arange(16).flip(0))


def test_causal_attention_mask_path_equals_fused_path_and_chunks():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 3, 10, 8, generator=g)
    v = torch.randn(2, 3, 10, 5, generator=g)  # v width differs from qk width, as in MLA
    pos = torch.tensor([4, 5, 6, 9, 10, 11, 12, 20, 21, 22])  # strictly increasing, gaps and neighbours
    sdpa = CausalAttention()
    fused = sdpa(q, k, v, pos, pos, 0.3)
    masked = sdpa(q, k, v, pos, pos.clone(), 0.3)
    torch.testing.assert_close(fused, masked, **TOL)
    # A context-parallel chunk: the last 4 queries against all keys, by global positions.
    chunk = sdpa(q[:, :, 6:], k, v, pos[6:], pos, 0.3)
    torch.testing.assert_close(chunk, fused[:, :, 6:], **TOL)


# ---- MoE --------------------------------------------------------------------------------------


def _tiny_moe(score_func="sigmoid", **kw):
    c = preset("debug", dim=16, moe_inter_dim=8, n_routed_experts=5, n_activated_experts=2,
               score_func=score_func, route_scale=1.7, **kw)
    moe = MoE(c)
    g = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5, generator=g)
    return moe, c


def _router_reference(moe, x_TD, bias_E):
    """Routing by hand: scores from the un-biased gate, selection with the bias."""
    logits_TE = x_TD @ moe.router.gate.weight.T
    scores_TE = torch.sigmoid(logits_TE) if moe.router.score_func == "sigmoid" else logits_TE.softmax(-1)
    experts_TK = (scores_TE + bias_E).topk(moe.router.top_k, dim=-1).indices
    weights_TK = scores_TE.gather(-1, experts_TK)
    if moe.router.score_func == "sigmoid":
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return weights_TK * moe.router.route_scale, experts_TK


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_moe_equals_per_token_reference(score_func):
    moe, c = _tiny_moe(score_func)
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.0, 0.1]))
    x_BSD = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3))
    out_BSD = moe(x_BSD)
    x_TD = x_BSD.reshape(14, 16)
    weights_TK, experts_TK = _router_reference(moe, x_TD, moe.router.expert_bias)
    e = moe.experts
    w1, w3 = e.w13.chunk(2, dim=1)
    ref = torch.stack([
        sum(
            weights_TK[t, j] * (e.w2[i] @ (F.silu(w1[i] @ x_TD[t]) * (w3[i] @ x_TD[t])))
            for j, i in enumerate(experts_TK[t].tolist())
        )
        for t in range(14)
    ]) + moe.shared_experts(x_TD)
    torch.testing.assert_close(out_BSD.reshape(14, 16), ref, **TOL)


def test_grouped_mm_path_equals_loop_with_empty_experts():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 6, 0, 2])
    x = torch.randn(11, 16, generator=g, requires_grad=True)
    w = torch.randn(5, 12, 16, generator=g, requires_grad=True)
    assert _grouped_mm_ok(x, w)  # fp32, 64-byte rows: the torch._grouped_mm path is taken on CPU
    grad = torch.randn(11, 12, generator=g)
    outs = [f(x, w, counts) for f in (grouped_linear, looped_linear)]
    grads = [torch.autograd.grad(o, (x, w), grad) for o in outs]
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.all(grads[0][1][1] == 0) and torch.all(grads[0][1][3] == 0)
    grouped_linear(x, w, counts).sum().backward()  # stride-0 incoming gradient is handled
    assert not _grouped_mm_ok(x[:, :15].contiguous(), w[:, :, :15].contiguous())  # 60-byte rows
    w_odd_out = torch.randn(5, 13, 16, generator=g)  # 52-byte output rows: torch._grouped_mm refuses them
    assert not _grouped_mm_ok(x, w_odd_out)
    torch.testing.assert_close(grouped_linear(x, w_odd_out, counts), looped_linear(x, w_odd_out, counts), **TOL)
    assert grouped_linear(x.bfloat16(), w.bfloat16(), counts).dtype == torch.bfloat16  # no cast inside


def test_router_bias_changes_selection_not_weights():
    moe, _ = _tiny_moe()
    x_TD = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    bias = torch.tensor([0.0, 0.0, 0.0, 50.0, 50.0])  # forces experts {3, 4} for every token
    moe.router.expert_bias.copy_(bias)
    weights_TK, experts_TK = moe.router(x_TD.view(1, 9, 16))
    assert torch.all(experts_TK.sort(-1).values == torch.tensor([3, 4]))
    ref_weights_TK, ref_experts_TK = _router_reference(moe, x_TD, bias)
    assert torch.equal(experts_TK, ref_experts_TK)
    torch.testing.assert_close(weights_TK, ref_weights_TK, **TOL)
    torch.testing.assert_close(weights_TK.sum(-1), torch.full((9,), 1.7), **TOL)  # normalized


def test_update_expert_bias_direction_and_reset():
    moe, c = _tiny_moe()
    moe(torch.randn(1, 6, 16))
    assert moe.router.tokens_per_expert.sum() == 6 * 2
    moe.router.update_expert_bias(torch.tensor([10, 0, 5, 5, 5]))  # mean 5
    step = c.bias_update_speed
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-step, step, 0, 0, 0]))
    assert torch.all(moe.router.tokens_per_expert == 0)


def test_aux_loss_gradient_is_injected():
    x_BSD = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(5))
    grads = []
    for alpha in (0.0, 1.0):
        moe, _ = _tiny_moe(aux_loss_alpha=alpha)
        out = moe(x_BSD)
        out.mean().backward()
        grads.append(moe.router.gate.weight.grad)
    # Reference: gradient of alpha * balance loss alone, by hand through the router math.
    gate = moe.router.gate.weight.detach().requires_grad_()
    scores_BSE = torch.sigmoid(x_BSD @ gate.T)
    experts_BSK = scores_BSE.topk(2, dim=-1).indices
    aux = 1.0 * sequence_balance_loss(scores_BSE, experts_BSK)
    (aux_grad,) = torch.autograd.grad(aux, gate)
    torch.testing.assert_close(grads[1] - grads[0], aux_grad, **TOL)
    assert aux_grad.abs().sum() > 0
    torch.testing.assert_close(moe.router.aux_loss, aux.detach())


# ---- Muon splits ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,overrides", [("debug", {}), ("debug", {"q_lora_rank": 0}), ("debug_gqa", {})])
def test_muon_splits_cover_matrices(name, overrides):
    model = seeded_model(name, init="generator", **overrides)
    splits = muon_splits(model)
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.ndim >= 2} - {"tok_embeddings.weight", "output.weight"}
    assert set(splits) == expected
    assert not any("norm" in n or "bias" in n for n in splits)
    for fqn, split in splits.items():
        full = params[fqn].detach()
        assert torch.equal(split.from_blocks(split.to_blocks(full), full.shape), full)


def test_kimi_k2_block_shapes_on_meta():
    with torch.device("meta"):
        model = Transformer(PRESETS["kimi_k2_1t"])
    splits, params = muon_splits(model), dict(model.named_parameters())

    def blocks(fqn):
        split = splits[fqn]
        return split.num_blocks(params[fqn].shape), split.block_shape(params[fqn].shape)

    attn, moe = "layers.1.attention", "layers.1.feed_forward"
    assert blocks(f"{attn}.wq_a.weight") == (1, (1536, 7168))
    assert blocks(f"{attn}.wq_b.weight") == (64, (192, 1536))
    assert blocks(f"{attn}.wkv_a.weight") == (1, (576, 7168))
    assert blocks(f"{attn}.wkv_b.weight") == (64, (256, 512))
    assert blocks(f"{attn}.wo.weight") == (64, (7168, 128))
    assert blocks(f"{moe}.experts.w13") == (2 * 384, (2048, 7168))  # w1[e] and w3[e] apart
    assert blocks(f"{moe}.experts.w2") == (384, (7168, 2048))
    assert blocks(f"{moe}.shared_experts.w1.weight") == (1, (2048, 7168))
    assert blocks(f"{moe}.router.gate.weight") == (1, (384, 7168))
    assert blocks("layers.0.feed_forward.w2.weight") == (1, (7168, 18432))


# ---- presets, counts, init ----------------------------------------------------------------------

PUBLISHED = {  # (total, active, counts_embeddings)
    "deepseek_v3_671b": (671e9, 37e9, True),
    "kimi_k2_1t": (1.04e12, 32.6e9, True),
    "moonlight_16b": (15.29e9, 2.24e9, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_published(name):
    c = PRESETS[name]
    total, active = count_params(c)
    pub_total, pub_active, with_embeddings = PUBLISHED[name]
    if not with_embeddings:
        total, active = total - 2 * c.vocab_size * c.dim, active - 2 * c.vocab_size * c.dim
    assert abs(total / pub_total - 1) < 0.02, (total, pub_total)
    assert abs(active / pub_active - 1) < 0.02, (active, pub_active)


def test_big_preset_builds_on_meta_without_storage():
    with torch.device("meta"):
        model = Transformer(PRESETS["deepseek_v3_671b"])
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert len(model.layers) == 61 and isinstance(model.layers[3].feed_forward, MoE)


@pytest.mark.parametrize("source", ["generator", "seed"])
def test_init_after_to_empty_is_deterministic(source):
    def init(model, seed):
        if source == "seed":
            model.init_weights(seed=seed)
        else:
            model.init_weights(torch.Generator().manual_seed(seed))
        return model

    with torch.device("meta"):
        meta_model = Transformer(PRESETS["debug"])
    meta_model.to_empty(device="cpu")
    for t in [*meta_model.parameters(), *meta_model.buffers()]:
        t.data.fill_(float("nan"))
    init(meta_model, 0)
    eager = init(Transformer(PRESETS["debug"]), 0)
    for (n, a), (_, b) in zip(meta_model.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.all(eager.layers[0].attention_norm.weight == 1)
    assert torch.all(eager.layers[1].feed_forward.router.expert_bias == 0)
    other = init(Transformer(PRESETS["debug"]), 1)
    assert not torch.equal(other.output.weight, eager.output.weight)
    w13 = eager.layers[1].feed_forward.experts.w13
    assert abs(w13.std().item() / eager.config.init_std - 1) < 0.05  # 16k samples: std error ~0.6%


def test_validation_errors():
    bad = [
        (dict(n_activated_experts=9), "n_activated_experts"),
        (dict(n_dense_layers=4), "n_dense_layers"),
        (dict(attn="mha"), "attn"),
        (dict(score_func="relu"), "score_func"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(attn="gqa", n_kv_heads=3, head_dim=16), "n_heads"),
        (dict(attn="gqa", n_kv_heads=0, head_dim=16), "n_kv_heads"),
        (dict(dim="64"), "dim"),
        (dict(dim=64.0), "dim"),
        (dict(route_scale=0.0), "route_scale"),
    ]
    for overrides, field in bad:
        with pytest.raises(ValueError, match=field):
            preset("debug", **overrides)
    with pytest.raises(ValueError, match="debug_gqa"):  # lists the valid names
        preset("nope")
    with pytest.raises(ValueError, match="n_experts"):
        preset("debug", n_experts=4)
    assert preset("debug", n_dense_layers=3).n_moe_layers == 0  # all-dense is valid
    assert isinstance(preset("debug"), ModelConfig)
