"""ReferenceMuon against a plain per-block loop (Muon) and torch.optim.AdamW (everything else)."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from models.splits import PER_EXPERT, WHOLE, MatrixSplit, muon_splits, per_head_cols, per_head_rows
from optim.config import OptimConfig
from optim.adamw import adamw_multi_tensor, adamw_update, init_adamw_state
from optim.muon_reference import ReferenceMuon, orthogonalize_blocks
from optim.newton_schulz import orthogonalize
from plain_references import naive_muon_step

MUON_NAMES = ("wq.weight", "wo.weight", "experts", "gate.weight")
STEPS = 3


class Toy(nn.Module):
    """Every split kind; wq's head blocks and the experts share the block shape [8, 16]."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 16)  # AdamW
        self.wq = nn.Linear(16, 4 * 8, bias=False)  # [32, 16]: 4 heads along rows -> 4 x [8, 16]
        self.wo = nn.Linear(4 * 8, 16)  # [16, 32]: 4 heads along cols -> 4 x [16, 8]; bias AdamW
        self.experts = nn.Parameter(torch.randn(3, 8, 16) / 4)  # 3 experts -> 3 x [8, 16]
        self.gate = nn.Linear(16, 3, bias=False)  # whole [3, 16]
        self.norm = nn.Parameter(torch.ones(16))  # AdamW

    def muon_splits(self):
        return {"wq.weight": per_head_rows(4), "wo.weight": per_head_cols(4), "experts": PER_EXPERT,
                "gate.weight": WHOLE}


def make_toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def random_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()


@pytest.mark.parametrize("nesterov,ns_method", [(True, "standard"), (False, "standard"), (True, "gram")])
def test_muon_blocks_equal_naive_loop(nesterov, ns_method):
    # with "gram", the gate [3, 16] takes the Gram path (aspect > 2), the [8, 16] blocks stay standard
    config = OptimConfig(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_method=ns_method)
    model = make_toy()
    splits = muon_splits(model)
    opt = ReferenceMuon(model, splits, config)
    expected = {name: p.detach().clone() for name, p in model.named_parameters() if name in MUON_NAMES}
    bufs = {name: torch.zeros_like(p) for name, p in expected.items()}
    for step in range(STEPS):
        grads = random_grads(model, step)
        set_grads(model, grads)
        opt.step()
        for name in MUON_NAMES:
            split = splits[name]
            expected[name], bufs[name] = naive_muon_step(expected[name], grads[name], bufs[name], split.kind,
                                                         split.parts, config, config.lr)
    params = dict(model.named_parameters())
    for name in MUON_NAMES:
        # Same maths; only the rounding order of the final multiply-adds differs (a few fp32 ulps per step).
        torch.testing.assert_close(params[name], expected[name], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[params[name]]["momentum_buffer"], bufs[name], rtol=0, atol=0)
        assert not torch.equal(params[name], make_toy().get_parameter(name))  # it did move


def run_torch_adamw(model: nn.Module, config: OptimConfig, names) -> dict[str, torch.Tensor]:
    params = [p for name, p in model.named_parameters() if name in names]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                            weight_decay=config.weight_decay, foreach=False)
    for step in range(STEPS):
        set_grads(model, random_grads(model, step))
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters() if name in names}


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_adamw_params_equal_torch_adamw(name):
    config = OptimConfig(name=name, lr=0.01, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6)
    model = make_toy()
    adamw_names = [n for n, _ in model.named_parameters() if name == "adamw" or n not in MUON_NAMES]
    expected = run_torch_adamw(copy.deepcopy(model), config, adamw_names)
    opt = ReferenceMuon(model.named_parameters(), muon_splits(model), config)
    # an empty group is left out (its settings would not survive a distributed checkpoint)
    assert [g["kind"] for g in opt.param_groups] == (["muon", "adamw"] if name == "muon" else ["adamw"])
    assert len(opt.param_groups[0]["params"]) == (4 if name == "muon" else len(adamw_names))
    for step in range(STEPS):
        set_grads(model, random_grads(model, step))
        opt.step()
    params = dict(model.named_parameters())
    for n in adamw_names:  # exactly torch's arithmetic (its foreach/fused kernels differ by rounding only)
        assert torch.equal(params[n], expected[n]), n
        assert set(opt.state[params[n]]) == {"step", "exp_avg", "exp_avg_sq"}
        assert opt.state[params[n]]["step"].item() == STEPS


def test_lr_scheduler_scales_both_groups():
    config = OptimConfig(lr=0.02)
    scheduled, plain = make_toy(), make_toy()
    opt = ReferenceMuon(scheduled, muon_splits(scheduled), config)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.005, 0.005]
    opt_plain = ReferenceMuon(plain, muon_splits(plain), dataclasses.replace(config, lr=0.005))
    for model, o in ((scheduled, opt), (plain, opt_plain)):
        set_grads(model, random_grads(model, 0))
        o.step()
    for (name, a), b in zip(scheduled.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_grad_none_is_skipped_and_state_is_fp32():
    model = make_toy()
    opt = ReferenceMuon(model, muon_splits(model), OptimConfig())
    set_grads(model, random_grads(model, 0))
    model.wo.weight.grad = None
    model.norm.grad = None
    opt.step()
    fresh = make_toy()
    assert torch.equal(model.wo.weight, fresh.wo.weight) and torch.equal(model.norm, fresh.norm)
    assert model.wo.weight not in opt.state and model.norm not in opt.state
    assert opt.state[model.experts]["momentum_buffer"].dtype == torch.float32


def test_one_newton_schulz_call_per_block_shape():
    model = make_toy()
    splits = muon_splits(model)
    blocks = [splits[n].to_blocks(p.detach()) for n, p in model.named_parameters() if n in MUON_NAMES]
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.linalg.vector_norm:  # once per orthogonalize call
                calls.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Count():
        out = orthogonalize_blocks(blocks, steps=5, coefficients="jordan", ns_dtype=torch.float32)
    # wq (4 heads) + experts (3) share [8, 16]; wo heads [16, 8] run transposed as [8, 16]; gate [3, 16]
    assert sorted(calls) == sorted([(7, 8, 16), (4, 8, 16), (1, 3, 16)])
    for b, o in zip(blocks, out):
        assert torch.equal(o, orthogonalize(b))


def test_ns_dtype_bfloat16_stays_close():
    updates = {}
    for ns_dtype in ("float32", "bfloat16"):
        model = make_toy()
        opt = ReferenceMuon(model, muon_splits(model), OptimConfig(ns_dtype=ns_dtype, weight_decay=0.0))
        set_grads(model, random_grads(model, 0))
        opt.step()
        fresh = dict(make_toy().named_parameters())
        updates[ns_dtype] = {n: p.detach() - fresh[n] for n, p in model.named_parameters() if n in MUON_NAMES}
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for p in opt.param_groups[0]["params"])
    for name in MUON_NAMES:
        # bf16 keeps 8 significant bits (2^-9 relative); NS amplifies per-iteration rounding (the
        # singular-value error reaches ~3e-2, tests/unit/test_newton_schulz.py); 5e-2 relative Frobenius
        # error of the update still means "same direction", while a wrong block would be off by ~1.
        a, b = updates["float32"][name], updates["bfloat16"][name]
        assert (a - b).norm() / a.norm() < 5e-2, name


def test_bad_splits_raise():
    model = make_toy()
    with pytest.raises(ValueError, match="not given.*'missing'"):
        ReferenceMuon(model, {**muon_splits(model), "missing": WHOLE}, OptimConfig())
    with pytest.raises(ValueError, match=r"wq.weight: rows split into 5 parts.*\(32, 16\) is 32"):
        ReferenceMuon(model, {"wq.weight": MatrixSplit("rows", 5)}, OptimConfig())
    with pytest.raises(ValueError, match=r"norm: split 'whole' needs a 2-D parameter, got shape \(16,\)"):
        ReferenceMuon(model, {"norm": WHOLE}, OptimConfig())


@pytest.mark.parametrize("key, value", [
    ("name", "sgd"), ("coefficients", "newton"), ("lr_adjust", "max"), ("ns_dtype", "float16"), ("ns_method", "svd"),
    ("lr", -1.0), ("lr", float("nan")), ("weight_decay", -0.1), ("momentum", 1.0), ("momentum", -0.1),
    ("ns_steps", 0), ("adam_beta1", 1.0), ("adam_beta2", -0.5), ("adam_eps", 0.0),
])
def test_config_rejects(key, value):
    with pytest.raises(ValueError, match=f"optim.{key}={value!r}"):
        OptimConfig(**{key: value})
    OptimConfig()  # the defaults are valid


def test_multi_tensor_adamw_equals_single_tensor_adamw():
    # the sharded optimizer's AdamW (torch's foreach AdamW on local shards) against the reference's
    # per-tensor arithmetic: the same elementwise maths, bitwise equal on CPU (measured, torch 2.13)
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(50, 30, generator=g), torch.randn(100, generator=g), torch.randn(0, 4)]
    single, multi = [p.clone() for p in params], [p.clone() for p in params]
    s_states, m_states = [init_adamw_state(p) for p in single], [init_adamw_state(p) for p in multi]
    hyper = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, grad, s in zip(single, grads, s_states):
            adamw_update(p, grad, s, **hyper)
        adamw_multi_tensor(multi, grads, m_states, **hyper)
    for a, b, sa, sb in zip(single, multi, s_states, m_states):
        assert torch.equal(a, b) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]) and sa["step"] == sb["step"]
    assert not torch.equal(single[0], params[0])


def test_ns_dtype_auto_is_bf16_on_cuda_fp32_on_cpu():
    config = OptimConfig()
    assert config.ns_dtype == "auto"
    assert config.ns_torch_dtype() == config.ns_torch_dtype("cpu") == torch.float32
    assert config.ns_torch_dtype(torch.device("cuda", 0)) == torch.bfloat16  # a device name: no GPU needed
    assert OptimConfig(ns_dtype="float32").ns_torch_dtype("cuda") == torch.float32
