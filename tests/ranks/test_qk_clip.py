"""QK-clip (MuonClip): the recorded max logits against a plain loop over every (query, key) pair, the
clip's exact effect on each head's logits (MLA with and without q_lora, GQA with shared key heads), and
1 process against the 8-rank headline layout (CP=2 x EP=8) through the real entry point."""

import os

import pytest
import torch

from entry_point import run_ok
from models.attention import CausalAttention, max_logits
from optim.qk_clip import clip_metrics, enable_recording, gqa_row_scales, qk_clip_, reset_recording, step_max_logits
from seeded_models import seeded_model


def plain_max_logits(q_BHSE, k_BHSE, q_pos_S, kv_pos_S, scale):
    """The definition, one (head, query, key) at a time."""
    q_BHSE, k_BHSE = q_BHSE.detach(), k_BHSE.detach()
    B, H, Sq, _ = q_BHSE.shape
    best = [-float("inf")] * H
    for h in range(H):
        for b in range(B):
            for i in range(Sq):
                for j in range(k_BHSE.shape[2]):
                    if kv_pos_S[j] <= q_pos_S[i]:
                        best[h] = max(best[h], scale * float(q_BHSE[b, h, i] @ k_BHSE[b, h, j]))
    return torch.tensor(best)


def test_blockwise_max_logits_equal_the_plain_loop():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 6, 5, generator=g), torch.randn(2, 3, 12, 5, generator=g)
    q_pos = torch.tensor([0, 1, 2, 9, 10, 11])  # a CP rank's two chunks, against all 12 gathered keys
    kv_pos = torch.tensor([0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11])
    expected = plain_max_logits(q, k, q_pos, kv_pos, 0.3)
    for block in (1, 4, 256):
        torch.testing.assert_close(max_logits(q, k, q_pos, kv_pos, 0.3, block=block), expected, rtol=1e-6, atol=0)


def _model(name, **overrides):
    model = seeded_model(name, init="generator", **overrides)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(3.0)  # larger logits than at init: a spread of per-head maxima to clip
    enable_recording(model)
    return model


def _record(model, tokens_BS):
    """Per-layer, per-head max logits recorded by one forward, and the (q, k, v, q_pos, kv_pos, scale)
    each layer's attention was called with."""
    captured = []
    hooks = [m.register_forward_hook(lambda mod, args, out: captured.append(args))
             for m in model.modules() if isinstance(m, CausalAttention)]
    model(tokens_BS)
    for h in hooks:
        h.remove()
    return step_max_logits(model), captured


def _layer_inputs(model, tokens_BS):
    """The (x, positions) each layer's attention module gets in a forward of `tokens_BS`."""
    inputs = []
    hooks = [block.attention.register_forward_hook(lambda mod, args, out: inputs.append(args))
             for block in model.layers]
    model(tokens_BS)
    for h in hooks:
        h.remove()
    return inputs


@pytest.mark.parametrize("name, overrides", [("debug", {}), ("debug", {"q_lora_rank": 0}), ("debug_gqa", {})])
def test_clip_scales_each_violating_heads_logits_to_tau_exactly(name, overrides):
    model = _model(name, **overrides)
    tokens_BS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    inputs = _layer_inputs(model, tokens_BS)  # also records the maxima
    before_LH = step_max_logits(model)
    tau = float(before_LH.flatten().median())  # about half the heads violate
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    max_logit, clipped = clip_metrics(before_LH, tau).tolist()
    assert max_logit == float(before_LH.max()) and clipped == int((before_LH > tau).sum()) > 0
    reset_recording(model)
    qk_clip_(model, before_LH, tau)
    with torch.no_grad():  # each layer on the SAME input as before (clipping a layer changes the next one's input)
        for block, (x_BSD, positions_S) in zip(model.layers, inputs):
            block.attention(x_BSD, positions_S)
    # every head's logits scale by exactly gamma = min(1, tau / S_max): S_max -> min(S_max, tau); fp32 rounding
    # of the rescaled weights and of q.k gives ~1e-7 relative
    torch.testing.assert_close(step_max_logits(model), torch.minimum(before_LH, torch.tensor(tau)), rtol=1e-5, atol=0)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, params[n])}
    violating = [i for i in range(3) if (before_LH[i] > tau).any()]  # layers with no violation stay untouched
    weights = ("wq", "wk") if name == "debug_gqa" else ("wq_b" if overrides.get("q_lora_rank", 1) else "wq", "wkv_b")
    assert changed == {f"layers.{i}.attention.{w}.weight" for i in violating for w in weights}
    if name != "debug_gqa":
        for i in range(3):  # the shared rotary key and the values are never scaled
            a = model.layers[i].attention
            assert torch.equal(a.wkv_a.weight, params[f"layers.{i}.attention.wkv_a.weight"])
            rows = a.wkv_b.weight.view(a.n_heads, a.nope + a.v_dim, -1)
            old = params[f"layers.{i}.attention.wkv_b.weight"].view(a.n_heads, a.nope + a.v_dim, -1)
            assert torch.equal(rows[:, a.nope:], old[:, a.nope:])


def test_recorded_maxima_equal_the_plain_loop_on_a_model():
    model = _model("debug")
    tokens_BS = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    recorded_LH, calls = _record(model, tokens_BS)
    reference_LH = torch.stack([plain_max_logits(q, k, q_pos, kv_pos, scale) for q, k, _, q_pos, kv_pos, scale in calls])
    torch.testing.assert_close(recorded_LH, reference_LH, rtol=1e-5, atol=0)


def test_gqa_shared_key_takes_the_group_minimum_and_queries_compensate():
    gamma = torch.tensor([0.5, 1.0, 1.0, 0.8])  # 4 query heads, 2 kv heads of 2 query heads each
    q_R, k_R = gqa_row_scales(gamma, 0.5, n_kv_heads=2, head_dim=1)
    assert k_R.tolist() == pytest.approx([0.5**0.5, 0.8**0.5])
    assert (q_R * k_R.repeat_interleave(2)).tolist() == pytest.approx(gamma.tolist())  # each head: its own gamma


def test_eval_forwards_record_nothing():
    model = _model("debug")
    model.eval()
    model(torch.zeros(1, 8, dtype=torch.long))
    assert torch.isinf(step_max_logits(model)).all()


ARGS = ["--training.steps=3", "--training.warmup_steps=1", "--data.seq_len=32", "--data.batch_size=8",
        "--checkpoint.interval=0", "--eval.interval=0", "--optim.qk_clip_tau=0.05"]
HEADLINE = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"]
FOLDED_HSDP = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.cp=2", "--parallel.ep=4",
               "--parallel.edp_shard=2"]


def _run(run_dir, world_size, *extra):
    return run_ok(run_dir, world_size, ARGS + list(extra))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_8_rank_layouts_record_and_clip_like_one_process(tmp_path, optimizer):
    single = _run(tmp_path / "single", 1, f"--optim.name={optimizer}")
    assert all(r["clipped_heads"] > 0 for r in single)  # the debug model's max logits are 0.06-0.08: clipping happens
    for name, layout in (("headline", HEADLINE), ("folded", FOLDED_HSDP)):
        ranks = _run(tmp_path / name, 8, f"--optim.name={optimizer}", *layout)
        for step, (a, b) in enumerate(zip(single, ranks)):
            # The step's max logit is a MAX over ranks of each rank's queries against the keys it sees (CP: all
            # earlier positions). Step 0 runs on the initial weights: fp32 reduction order only, 1e-5. Later
            # steps inherit the layouts' training noise: measured <= 1.1e-6 with muon; AdamW divides by tiny
            # second moments and amplifies it (the unclipped grad norms of the folded layout already differ by
            # 9.5e-5 relative at step 2, the max logit by 1.1e-5), so 1e-4 there.
            tol = 1e-5 if step == 0 or optimizer == "muon" else 1e-4
            assert b["max_logit"] == pytest.approx(a["max_logit"], rel=tol), (name, a, b)
            assert b["clipped_heads"] == a["clipped_heads"], (name, a, b)
            assert b["loss"] == pytest.approx(a["loss"], rel=tol), (name, a, b)


def test_resume_with_clipping_continues_bitwise(tmp_path):
    full = _run(tmp_path / "full", 2, "--checkpoint.interval=1", "--checkpoint.keep=0")
    os.remove(tmp_path / "full" / "checkpoints" / "step_3" / "COMPLETE")  # resume from step_2
    resumed = _run(tmp_path / "full", 2, "--checkpoint.interval=1", "--checkpoint.keep=0")
    keys = ("loss", "grad_norm", "max_logit", "clipped_heads")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recompute_records_nothing_and_the_maxima_stay(monkeypatch, mode):
    """Activation checkpointing reruns attention in backward: the QK-clip scores are computed once per
    layer (in the original forward), and the maxima equal those of a run without checkpointing."""
    from models import attention
    from parallel.activation_checkpoint import apply_activation_checkpoint

    tokens_BS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    plain = _model("debug")
    plain(tokens_BS).float().square().mean().backward()
    expected_LH = step_max_logits(plain)

    calls = []
    original = attention.max_logits
    monkeypatch.setattr(attention, "max_logits", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _model("debug")
    apply_activation_checkpoint(model, mode)
    model(tokens_BS).float().square().mean().backward()
    assert len(calls) == len(model.layers), f"{len(calls)} score computations for {len(model.layers)} layers"
    assert all(a.sdpa.record_max_logits for a in (b.attention for b in model.layers))  # restored after the recompute
    assert torch.equal(step_max_logits(model), expected_LH)


def test_metrics_max_logit_records_it_without_qk_clip(tmp_path):
    """`[metrics] max_logit = true` (QK-clip off) records the same max_logit as QK-clip with a tau no head
    reaches (which clips nothing, so the weights are the same), bitwise, and no clipped_heads; off by default.
    The value joins the step's one readback: tests/ranks/test_host_syncs.py counts no sync of its own."""
    watched = _run(tmp_path / "watched", 1, "--optim.qk_clip_tau=0", "--metrics.max_logit=true")
    reference = _run(tmp_path / "reference", 1, "--optim.qk_clip_tau=1e9")
    assert [r["max_logit"] for r in watched] == [r["max_logit"] for r in reference]
    assert [r["loss"] for r in watched] == [r["loss"] for r in reference]
    assert all(r["max_logit"] > 0 and "clipped_heads" not in r for r in watched)
    assert all(r["clipped_heads"] == 0 for r in reference)
    assert all("max_logit" not in r for r in _run(tmp_path / "plain", 1, "--optim.qk_clip_tau=0"))


def test_metrics_max_logit_with_qk_clip_on_is_refused():
    from runtime.config import ConfigError
    from runtime.config_parser import load_config

    with pytest.raises(ConfigError, match=r"^metrics.max_logit=true has no effect with optim.qk_clip_tau=100.0: "):
        load_config(["--optim.qk_clip_tau=100", "--metrics.max_logit=true"])
