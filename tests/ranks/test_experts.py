"""The fused w13 routed experts against plain references written without it.

- Forward and gradients equal a per-expert loop over separate w1, w3, w2 matrices (fp32 to rounding;
  bf16 within the bf16-vs-fp32 difference of that loop), on the torch._grouped_mm path and the loop
  fallback, with experts that get no tokens.
- A whole model gives the loss and gradients of the same model with the pre-fusion experts (w1 and w3
  two parameters, two grouped matmuls) holding the same weights.
- The seeded init draws w13[:, :F] and w13[:, F:] from the documented streams of w1 and w3 (unchanged
  weights for a seed).
- Muon orthogonalizes w1[e] and w3[e] apart: one step on w13 equals a hand-written per-matrix loop on
  separate w1 and w3 (8 ranks against this reference: tests/ranks/test_sharded_muon.py, w13 in every
  expert layout).
- On 6 ranks with an FSDP shard across w13's w1/w3 boundary (Shard(1), edp_shard=3), the seeded init
  and the Hugging Face loader fill exactly the single-process rows.
- A checkpoint from before the fusion fails to resume with one line, and exports as the same weights.
- benchmarks/expert_block.py's launch proxy counts 2 grouped matmuls forward and 4 backward for the fused
  block (3 and 6 before), and the benchmark runs; its `separate_swiglu` (the pre-fusion code) is the
  reference of the whole-model comparison above.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.expert_block import grouped_mm_launches, separate_swiglu
from models import Transformer, preset
from models.experts import GroupedExperts, _grouped_mm_ok, swiglu_experts
from models.splits import PER_EXPERT, muon_splits
from optim.config import OptimConfig
from optim.muon_reference import ReferenceMuon
from parallel.gradients import loss_fn
from plain_references import stream_reference, naive_muon_step
from seeded_models import seeded_model

COUNTS = torch.tensor([5, 0, 9, 3, 0, 7])  # experts 1 and 4 get no tokens


def _weights(E, F_, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, F_, D, generator=g) * D**-0.5 for _ in range(2))
    w2 = torch.randn(E, D, F_, generator=g) * F_**-0.5
    x = torch.randn(int(COUNTS.sum()), D, generator=g)
    return x.to(dtype), w1.to(dtype), w3.to(dtype), w2.to(dtype)


def _loop_reference(x_TD, w1, w3, w2, counts_E):
    """out rows of expert e = w2[e] (silu(w1[e] x) * w3[e] x), one plain matmul per expert."""
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):
        x = x_TD[start:start + n]
        outs.append(F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e]))
        start += n
    return torch.cat(outs)


def _fused_and_reference(x, w1, w3, w2, grad_out=None):
    """(fused out, grads of x, w1, w3, w2) and the loop reference's, for one incoming gradient."""
    leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
    fused_in = [leaves[0].detach().clone().requires_grad_(),
                torch.cat([w1, w3], dim=1).requires_grad_(), leaves[3].detach().clone().requires_grad_()]
    fused = swiglu_experts(fused_in[0], fused_in[1], fused_in[2], COUNTS)
    ref = _loop_reference(*leaves, COUNTS)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(ref.dtype)
    fused.backward(grad_out)
    ref.backward(grad_out)
    g1, g3 = fused_in[1].grad.chunk(2, dim=1)
    return [fused, fused_in[0].grad, g1, g3, fused_in[2].grad], [ref] + [t.grad for t in leaves]


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("D", [16, 6])  # 16: torch._grouped_mm; 6 (24-byte rows): the per-expert loop fallback
def test_fused_experts_equal_per_expert_loop_fp32(D):
    x, w1, w3, w2 = _weights(6, 8, D)
    assert _grouped_mm_ok(x, torch.cat([w1, w3], dim=1)) == (D == 16)
    fused, ref = _fused_and_reference(x, w1, w3, w2)
    for name, a, b in zip(("out", "x", "w1", "w3", "w2"), fused, ref):
        # the same sums in another order (grouped vs per-expert matmuls): a few fp32 ulps, observed <= 1.1e-7
        assert _rel(a, b) < 1e-6, (name, _rel(a, b))
    assert torch.all(fused[2][[1, 4]] == 0) and torch.all(fused[4][[1, 4]] == 0)  # no tokens: zero gradient


def test_fused_experts_bf16_within_the_bf16_rounding_of_the_loop():
    x, w1, w3, w2 = _weights(6, 32, 64)
    fp32 = _fused_and_reference(x, w1, w3, w2)[1]
    fused, loop_bf16 = _fused_and_reference(*(t.bfloat16() for t in (x, w1, w3, w2)))
    for name, a, b16, b32 in zip(("out", "x", "w1", "w3", "w2"), fused, loop_bf16, fp32):
        assert a.dtype == torch.bfloat16
        # yardstick: what bf16 does to the plain loop (~1e-2 relative); the fused bf16 result must be as
        # close to fp32 as that, up to a factor 2 (other rounding points; a wrong half or expert is O(1) off)
        yardstick = _rel(b16, b32)
        assert 1e-4 < yardstick < 5e-2, (name, yardstick)
        assert _rel(a, b32) <= 2 * yardstick, (name, _rel(a, b32), yardstick)


def test_one_grouped_matmul_for_w1_and_w3():
    """Launch proxy: the fused block dispatches 2 grouped matmuls forward and 4 backward (before: 3 and 6)."""
    x, w1, w3, w2 = (t.requires_grad_() for t in _weights(6, 8, 16))
    fused = grouped_mm_launches(lambda: swiglu_experts(x, torch.cat([w1, w3], dim=1), w2, COUNTS))
    before = grouped_mm_launches(lambda: separate_swiglu(x, w1, w3, w2, COUNTS))
    assert fused == {"forward": 2, "backward": 4} and before == {"forward": 3, "backward": 6}
    from benchmarks.expert_block import main
    assert main(["--small", "--repeats", "1"]) == 0  # the benchmark itself runs


class SeparateExperts(nn.Module):
    """The experts as they were before the fusion: w1 and w3 two parameters, two grouped matmuls."""

    def __init__(self, fused: GroupedExperts):
        super().__init__()
        w1, w3 = fused.w13.detach().chunk(2, dim=1)
        self.w1, self.w3 = nn.Parameter(w1.clone()), nn.Parameter(w3.clone())
        self.w2 = nn.Parameter(fused.w2.detach().clone())

    def forward(self, x_TD, counts_E, dispatcher=None):
        return separate_swiglu(x_TD, self.w1, self.w3, self.w2, counts_E)


def test_model_loss_and_grads_equal_the_pre_fusion_experts():
    model = seeded_model("debug")
    before = Transformer(preset("debug"))
    before.load_state_dict(model.state_dict())
    for layer in before.layers[before.config.n_dense_layers:]:
        layer.feed_forward.experts = SeparateExperts(layer.feed_forward.experts)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, before):
        loss = loss_fn(m(tokens[:, :-1]), tokens[:, 1:], 4 * 32)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[1]), losses
    grads_before = {n: p.grad for n, p in before.named_parameters()}
    for name, p in model.named_parameters():
        if name.endswith("experts.w13"):
            want = torch.cat([grads_before[name[:-3] + "w1"], grads_before[name[:-3] + "w3"]], dim=1)
        else:
            want = grads_before[name]
        # fp32 ulps: the x-gradient is one grouped matmul over 2F instead of two summed (observed <= 4.3e-7)
        assert _rel(p.grad, want) < 1e-5, (name, _rel(p.grad, want))


def test_seeded_w13_holds_the_w1_and_w3_streams():
    c = preset("debug")
    model = Transformer(c)
    model.init_weights(seed=3)
    experts = model.layers[1].feed_forward.experts
    shape = (c.n_routed_experts, c.moe_inter_dim, c.dim)
    for half, name in zip(experts.w13.detach().chunk(2, dim=1), ("w1", "w3")):
        assert torch.equal(half, stream_reference(shape, c.init_std, 3, f"layers.1.feed_forward.experts.{name}"))
    assert torch.equal(experts.w2.detach(), stream_reference(tuple(experts.w2.shape), c.init_std, 3,
                                                              "layers.1.feed_forward.experts.w2"))


def _muon_steps(w13_init, grads, splits):
    config = OptimConfig(lr=0.02, weight_decay=0.1, momentum=0.9)
    w13 = nn.Parameter(w13_init.clone())
    opt = ReferenceMuon([("w13", w13)], splits, config)
    for grad in grads:
        w13.grad = grad.clone()
        opt.step()
    return w13.detach(), config


def test_muon_orthogonalizes_w1_and_w3_apart():
    E, F_, D = 3, 8, 16
    g = torch.Generator().manual_seed(0)
    w13_init = torch.randn(E, 2 * F_, D, generator=g)
    grads = [torch.randn(E, 2 * F_, D, generator=g) for _ in range(3)]
    got, config = _muon_steps(w13_init, grads, {"w13": GroupedExperts(D, F_, E).muon_splits()["w13"]})
    for i, name in enumerate(("w1", "w3")):  # separate w1 and w3 parameters, each expert's matrix alone
        p, buf = w13_init.chunk(2, dim=1)[i], torch.zeros(E, F_, D)
        for grad in grads:
            p, buf = naive_muon_step(p, grad.chunk(2, dim=1)[i], buf, "experts", 1, config, config.lr)
        torch.testing.assert_close(got.chunk(2, dim=1)[i], p, rtol=1e-6, atol=1e-6)  # fp32 ulps, as test_muon_reference
    whole, _ = _muon_steps(w13_init, grads, {"w13": PER_EXPERT})  # one [2F, D] block per expert: another update
    assert _rel(whole - w13_init, got - w13_init) > 0.1  # the parameter changes differ by O(1)
    assert muon_splits(Transformer(preset("debug")))["layers.1.feed_forward.experts.w13"].parts == 2


# ---------------------------------------------------------------- a shard across w13's w1/w3 boundary

# 4 experts / ep=2 = 2 local experts < edp_shard=3: Shard(1), w13's 2F = 48 rows in thirds of 16, so
# edp_shard rank 1 holds rows [16, 32) = the last 8 rows of w1 and the first 8 of w3
ODD = dict(dim=48, moe_inter_dim=24, n_routed_experts=4)


def _odd_layout_weights(rank, world, hf_dir):
    """(seeded init, loaded from hf_dir) boxes of every expert weight on this rank, with the boxes."""
    from models.boxes import dtensor_box
    from models.hf.checkpoint import load_state
    from parallel.layout import ParallelConfig
    from parallel.meshes import build_meshes
    from parallel.parallelize import parallelize

    layout = ParallelConfig(dp_shard=6, ep=2, edp_shard=3).resolve(world)
    with torch.device("meta"):
        model = Transformer(preset("debug", **ODD))
    parallelize(model, build_meshes(layout, "cpu"), layout)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    seeded = {n: (dtensor_box(p), p.to_local().clone()) for n, p in experts.items()}
    load_state(model, hf_dir)
    return seeded, {n: (dtensor_box(p), p.to_local().clone()) for n, p in experts.items()}


def test_a_shard_across_the_w1_w3_boundary_gets_its_seeded_and_loaded_rows(tmp_path):
    from models.hf.checkpoint import save_pretrained
    from multirank import run_ranks

    seeded_full = seeded_model("debug", 3, **ODD)
    other = seeded_model("debug", 4, **ODD)
    save_pretrained(other, str(tmp_path / "hf"))
    straddles = 0
    for seeded, loaded in run_ranks(_odd_layout_weights, 6, str(tmp_path / "hf"), timeout=120):
        for (name, (box, local)), (_, (_, from_hf)) in zip(seeded.items(), loaded.items()):
            index = tuple(slice(a, b) for a, b in box)
            assert torch.equal(local, seeded_full.get_parameter(name).detach()[index]), name
            assert torch.equal(from_hf, other.get_parameter(name).detach()[index]), name
            straddles += name.endswith("w13") and box[1][0] < ODD["moe_inter_dim"] < box[1][1]
    assert straddles > 0


# ---------------------------------------------------------------- checkpoints from before the fusion

ARGS = ["--data.source=synthetic", "--data.seq_len=32", "--data.batch_size=4", "--training.warmup_steps=1",
        "--checkpoint.interval=0", "--training.steps=1", "--parallel.dp_shard=1", "--parallel.cp=1",
        "--parallel.ep=1", "--parallel.edp_shard=1"]


def _legacy_copy(step_dir: str, out_dir: str) -> None:
    """`step_dir` rewritten as a pre-fusion checkpoint: each experts.w13 (and its optimizer state)
    stored as w1 and w3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, os.path.join(out_dir, "full.pt"))
    state = torch.load(os.path.join(out_dir, "full.pt"), weights_only=False)
    os.remove(os.path.join(out_dir, "full.pt"))

    def split(tree):
        if not isinstance(tree, dict):
            return tree
        out = {}
        for k, v in tree.items():
            if isinstance(k, str) and k.endswith("experts.w13") and isinstance(v, torch.Tensor):
                out[k[:-3] + "w1"], out[k[:-3] + "w3"] = (t.clone() for t in v.chunk(2, dim=1))
            else:
                out[k] = split(v)
        return out

    dcp.save(split(state), checkpoint_id=out_dir, no_dist=True)
    with open(os.path.join(step_dir, "COMPLETE")) as f, open(os.path.join(out_dir, "COMPLETE"), "w") as g:
        json.dump(json.load(f), g)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pre_fusion_checkpoint_fails_to_resume_in_one_line_and_exports_the_same(tmp_path, capfd):
    from launch.export_hf import export
    from launch.pretrain import main
    from models.hf.checkpoint import load_pretrained
    from multirank import run_ranks

    run_dir = str(tmp_path / "run")
    assert run_ranks(lambda r, w: main(ARGS + [f"--run.dir={run_dir}"]), 1, as_torchrun=True) == [0]
    new = str(tmp_path / "new_export")
    export(run_dir, new, dtype="float32")
    step = os.path.join(run_dir, "checkpoints", "step_1")
    legacy = os.path.join(run_dir, "checkpoints", "step_2")
    os.makedirs(legacy)
    _legacy_copy(step, legacy)
    old = str(tmp_path / "old_export")
    export(run_dir, old, step=2, dtype="float32")
    for (name, a), (_, b) in zip(load_pretrained(new).state_dict().items(), load_pretrained(old).state_dict().items()):
        assert torch.equal(a, b), name
    capfd.readouterr()
    assert run_ranks(lambda r, w: main(ARGS + [f"--run.dir={run_dir}", "--training.steps=3"]), 1,
                     as_torchrun=True) == [2]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_2 stores the routed experts' w1 and w3 apart" in err[0], err
