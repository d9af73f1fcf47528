"""Attention kernels and context-parallel attention against a plainly written softmax loop.

The outside reference is `plain_attention`: for each query, softmax(q K^T * scale over the keys
at positions <= its own) V, in float64. Checked against it:
  - `prefix_causal_attention` (two flash calls merged by log-sum-exp), forward and gradients;
  - the debug models' loss and gradients with the model's attention (padded values, flash kernel,
    `is_causal`), 1 process;
  - context parallelism on 8 ranks (cp = 8: each rank gathers the compact KV, attends over its
    prefix + causal diagonal): the global loss and the summed gradients.
Which SDPA kernel runs is read from the dispatcher (`_scaled_dot_product_flash_attention_for_cpu`
vs the math fallback's `_safe_softmax`).

Tolerances, from a measured yardstick: torch's own single fused SDPA call with an explicit
lower-right mask, same inputs, against the same float64 loop (fp32: 2e-7..1e-6 absolute on values
of magnitude ~1, a few fp32 ulps; bf16: 3e-3..1.4e-2, bf16's 2^-8 rounding). The merged pieces add
one rounding of the merge weights; their error measured at most 1.7x the single call's (bf16 out,
prefix 5), 1.3x in fp32. We allow 2.5x (plus 1e-7): a real bug (a wrong scale, a missing key, a
wrong causal boundary) changes outputs by > 1e-2. Losses: 1e-6 relative (measured <= 1.6e-7, 1
process and 8 ranks). Gradients relative to each tensor's largest entry: 2e-5 as in
tests/ranks/test_parallel_parity.py (measured <= 7.4e-7).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from models.block_attention import lower_right_mask, prefix_causal_attention
from multirank import run_ranks
from parallel.context_parallel import apply_context_parallel, balanced_chunk_attention, load_balanced_positions
from parallel.gradients import loss_fn
from seeded_models import seeded_model

FLASH, MATH = "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._safe_softmax.default"
LOSS_RTOL = 1e-6
BATCH, SEQ, CP = 2, 48, 8


def plain_attention(q_BHQE, k_BHKE, v_BHKE, q_pos_Q, kv_pos_K, scale):
    """float64 [B, H, Q, Ev]: one query at a time, softmax over the keys it may see."""
    q, k, v = q_BHQE.double(), k_BHKE.double(), v_BHKE.double()
    rows = []
    for i in range(q.shape[2]):
        visible = kv_pos_K <= q_pos_Q[i]
        weights = torch.softmax((q[:, :, i:i + 1] @ k[:, :, visible].transpose(-1, -2)) * scale, dim=-1)
        rows.append(weights @ v[:, :, visible])
    return torch.cat(rows, dim=2)


class PlainAttention(torch.nn.Module):
    """Drop-in `sdpa`: the plain loop, cast back to the queries' dtype."""

    def forward(self, q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, scale):
        return plain_attention(q_BHSE, k_BHTE, v_BHTE, q_pos_S, kv_pos_T, scale).to(q_BHSE.dtype)


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _qkv(dtype, n_q, n_k, width=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    # keys as a strided view ([B, K, H, E] transposed), as the model hands them over
    q = torch.randn(2, 3, n_q, width, generator=g)
    k = torch.randn(2, n_k, 3, width, generator=g).transpose(1, 2)
    v = torch.randn(2, 3, n_k, width, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _errors(out, grads, q, k, v, grad_out, q_pos, kv_pos):
    """Relative Frobenius error of out and of (dq, dk, dv) against the float64 loop. Not the max abs
    error: over 60 input seeds the merged call's max abs error reached 2.97x the single call's (a
    max over a few hundred elements is one element's rounding luck, which another CPU's kernels,
    e.g. AMX-bf16, change), its relative Frobenius error at most 1.97x, fp32 and bf16 alike."""
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = plain_attention(*ref_in, q_pos, kv_pos, 0.3)
    ref.backward(grad_out.double())
    return [((a.double() - b).norm() / b.norm()).item()
            for a, b in zip([out, *grads], [ref] + [t.grad for t in ref_in])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,prefix", [(6, 0), (6, 5), (4, 12), (1, 7)])
def test_prefix_causal_attention_equals_the_plain_loop(dtype, n_q, prefix):
    n_k = prefix + n_q
    q_pos, kv_pos = torch.arange(prefix, n_k), torch.arange(n_k)
    grad_out = torch.randn(2, 3, n_q, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    q, k, v = _qkv(dtype, n_q, n_k)
    with OpNames() as ops:
        out = prefix_causal_attention(q, k, v, 0.3)
        out.backward(grad_out)
    assert FLASH in ops.names and MATH not in ops.names, "the flash kernel must run, not the math fallback"
    got = _errors(out, [t.grad for t in (q, k, v)], q, k, v, grad_out, q_pos, kv_pos)
    # yardstick: torch's single fused call with an explicit lower-right mask, same inputs
    q2, k2, v2 = _qkv(dtype, n_q, n_k)
    single = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=lower_right_mask(n_q, n_k, "cpu"), scale=0.3)
    single.backward(grad_out)
    yard = _errors(single, [t.grad for t in (q2, k2, v2)], q2, k2, v2, grad_out, q_pos, kv_pos)
    for name, e, y in zip(("out", "dq", "dk", "dv"), got, yard):
        assert e <= 2.5 * y + 1e-7, f"{name}: error {e:.3g} vs single fused call {y:.3g}"


def test_prefix_causal_attention_float64_takes_the_masked_call():
    """No fused kernel returns a float64-accurate lse: float64 runs one masked SDPA call."""
    q, k, v = _qkv(torch.float64, 5, 13)
    grad_out = torch.randn(2, 3, 5, 24, dtype=torch.float64)
    out = prefix_causal_attention(q, k, v, 0.3)
    out.backward(grad_out)
    errors = _errors(out, [t.grad for t in (q, k, v)], q, k, v, grad_out, torch.arange(8, 13), torch.arange(13))
    assert max(errors) < 1e-12


@pytest.mark.parametrize("cp", [1, 3])
def test_balanced_chunks_of_every_rank_equal_the_plain_loop(cp):
    """Each cp rank's queries (chunks r and 2P-1-r) against the keys in global order, values
    narrower than q/k as in MLA; no process group."""
    L, scale = 6 * cp, 0.3
    q_all, k, v = _qkv(torch.float32, L, L)
    v = v[..., :16].detach()  # MLA: v narrower than q/k
    reference = plain_attention(q_all, k, v, torch.arange(L), torch.arange(L), scale)
    for rank in range(cp):
        positions = load_balanced_positions(L, cp, rank)
        out = balanced_chunk_attention(q_all[:, :, positions], k, v, rank, cp, scale)
        assert out.shape[-1] == 16
        # 2e-6: the fp32 yardstick of the module docstring (single fused call: up to 1e-6)
        torch.testing.assert_close(out.double(), reference[:, :, positions], rtol=0, atol=2e-6)


def _tokens(vocab):
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(model, inputs, labels, positions=None):
    loss = loss_fn(model(inputs, positions), labels, BATCH * SEQ)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _plain_reference(name):
    """Loss and gradients of the debug model with every `sdpa` replaced by the plain loop."""
    model = seeded_model(name, init="default")
    for block in model.layers:
        block.attention.sdpa = PlainAttention()
    return _loss_and_grads(model, *_tokens(model.config.vocab_size))


def _grad_errors(grads, reference):
    return {k: ((g - reference[k]).abs().max() / reference[k].abs().max()).item() for k, g in grads.items()}


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_model_attention_runs_flash_and_equals_the_plain_loop(name):
    model = seeded_model(name, init="default")
    with OpNames() as ops:
        loss, grads = _loss_and_grads(model, *_tokens(model.config.vocab_size))
    assert FLASH in ops.names and MATH not in ops.names
    ref_loss, ref_grads = _plain_reference(name)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=LOSS_RTOL)
    assert max(_grad_errors(grads, ref_grads).values()) < 2e-5


def _cp_rank(rank, world, names):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = {}
    for name in names:
        model = seeded_model(name, init="default")
        apply_context_parallel(model, mesh)
        inputs, labels = _tokens(model.config.vocab_size)
        positions = load_balanced_positions(SEQ, world, rank)
        with OpNames() as ops:
            loss, grads = _loss_and_grads(model, inputs[:, positions], labels[:, positions], positions)
        dist.all_reduce(loss)  # every rank's share of the global mean
        for g in grads.values():
            dist.all_reduce(g)  # each rank's parameter gradient covers its own queries
        out[name] = {"loss": loss.item(), "grads": grads, "ops": ops.names}
        try:
            model(inputs[:, positions], 2 * torch.arange(SEQ // world))  # not the balanced layout
            out[name]["bad_layout"] = "accepted"
        except ValueError as e:
            out[name]["bad_layout"] = str(e)
    return out


@pytest.fixture(scope="module")
def cp_results():
    names = ["debug", "debug_gqa"]
    return {n: _plain_reference(n) for n in names}, run_ranks(_cp_rank, CP, names, timeout=300)


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_context_parallel_equals_the_plain_single_process_loop(cp_results, name):
    references, per_rank = cp_results
    ref_loss, ref_grads = references[name]
    for rank, result in enumerate(per_rank):
        got = result[name]
        assert got["loss"] == pytest.approx(ref_loss.item(), rel=LOSS_RTOL), rank
        assert max(_grad_errors(got["grads"], ref_grads).values()) < 2e-5, rank
        assert FLASH in got["ops"] and MATH not in got["ops"], rank
        assert "load_balanced_positions" in got["bad_layout"], rank


def test_benchmark_small_runs_and_sees_the_kernels():
    """benchmarks/attention_kernels.py --small: the same code path as the table in docs/performance.md, so it cannot rot."""
    from benchmarks.attention_kernels import main

    rows = main(["--small", "--repeats", "1", "--dtypes", "float32"])["rows"]
    kernels = {(r["group"], r["variant"]): r["kernels"] for r in rows}
    assert kernels[("causal", "unpadded")] == ["math"] and kernels[("causal", "padded")] == ["flash"]
    assert kernels[("cp", "dense_mask")] == ["math"] and kernels[("cp", "chunked")] == ["flash"]
    assert all(r["max_abs_diff_vs_first"] < 2e-6 for r in rows)  # the same attention (fp32 yardstick above)


class FlashInputs(TorchDispatchMode):
    """Records, for every call of the CPU flash pair, whether its q, k, v (and grad_out) are contiguous."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            tensors = args[:4] if name.endswith("backward") else args[:3]
            self.calls.append((name, [t.is_contiguous() for t in tensors]))
        return func(*args, **(kwargs or {}))


def test_the_flash_pair_gets_contiguous_inputs_from_transposed_views():
    """The model hands attention [B, T, H, E] -> [B, H, T, E] transposed views; the private flash ops
    under context parallelism must get contiguous q, k, v and grad_out, as torch's ring attention
    passes them (models/block_attention.py)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 24, generator=gen).transpose(1, 2).requires_grad_() for n in (6, 11, 11))
    with FlashInputs() as seen:
        prefix_causal_attention(q, k, v, 0.3).backward(torch.randn(2, 6, 3, 24).transpose(1, 2))
    assert len(seen.calls) == 4, seen.calls  # two pieces, forward and backward
    assert all(all(flags) for _, flags in seen.calls), seen.calls


def test_values_are_padded_only_where_torch_would_fall_back_to_math(monkeypatch):
    """MLA's values (narrower than q/k) are padded for the CPU flash kernel, which takes one width; where
    torch's dispatcher would pick a kernel that takes them as they are (cuDNN or memory-efficient on an
    H200), they pass unpadded. The dispatcher's choice is stood in for by its own function's result."""
    from torch.nn.attention import SDPBackend

    from models.attention import CausalAttention

    q, k = torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24)
    v = torch.randn(1, 2, 8, 16)
    pos = torch.arange(8)
    widths = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: widths.append(v.shape[-1]) or sdpa(q, k, v, **kw))
    reference = CausalAttention()(q, k, v, pos, pos, 0.3)
    assert widths == [24]  # CPU: unpadded would run math, so padded for flash
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: int(SDPBackend.EFFICIENT_ATTENTION))
    out = CausalAttention()(q, k, v, pos, pos, 0.3)
    assert widths == [24, 16]
    torch.testing.assert_close(out, reference, rtol=0, atol=2e-6)  # the same attention (fp32 yardstick above)
