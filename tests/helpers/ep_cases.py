"""Shared fixtures of the EP tests (tests/ranks/test_ep_dispatch.py, tests/ranks/test_ep_grid.py): the debug model without
its dense block on 8 gloo ranks in two simulated nodes (`ranks_per_node` = 4), its single-process step, one
parallelized step per case with every all-to-all byte counted (planning/recording.py), the plan's
bytes for the run's own routing, and the single-process step with FP8 rows (`fp8_reference`).

Tolerances as in tests/ranks/test_parallel_parity.py (fp32, different summation orders: observed <= 1e-6
relative; allowed 2e-5 on gradients, 1e-5 on the loss and the norm).

The model is the debug preset without its dense block (MODEL): two MoE blocks, so every per-layer question
(caches, kept exchanges replayed per layer under recompute) still meets a second layer, and the dense FFN
under these layouts is tests/ranks/test_parallel_parity.py's. Cases of one layout share its meshes (`meshes_for`):
the process groups are not what is tested here.
"""

import torch
import torch.distributed as dist

from planning.recording import record_collectives, split_by_node
from models import Transformer, preset
from models.experts import swiglu_experts
from models.moe import LocalDispatcher, MoE
from parallel.context_parallel import load_balanced_positions
from parallel.ep.direct import decode, encode
from parallel.ep.dispatcher import dispatchers, read_drop_counts
from parallel.ep.plan import Placement, sent_bytes
from parallel.gradients import clip_grad_norm_, global_loss, loss_fn
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize
from runtime.syncs import count_syncs
from seeded_models import seeded_model

WORLD, BATCH, SEQ, RPN = 8, 8, 32, 4
MODEL = preset("debug", n_layers=2, n_dense_layers=0)  # two MoE blocks (module docstring)
GRAD_RTOL, NORM_RTOL = 2e-5, 1e-5
HEADLINE = dict(dp_shard=4, cp=2, ep=8, edp_shard=1, ranks_per_node=RPN)  # dp 4 x cp 2 | ep 8 over two nodes
FOLDED = dict(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4, expert_inner="edp_shard", ranks_per_node=RPN)


def build_model(config=MODEL) -> Transformer:
    return seeded_model(config, init="default")


def batch(vocab_size):
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def reference_step(build=None) -> dict:
    """The single-process step of `build()` (default: `build_model`): loss, clipped gradient norm, gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = (build or build_model)()
        inputs, labels = batch(model.config.vocab_size)
        loss = loss_fn(model(inputs), labels, BATCH * SEQ)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        torch.set_num_threads(threads)
    return {"loss": loss.item(), "norm": norm.item(), "grads": grads}


class Fp8LocalDispatcher(LocalDispatcher):
    """The single process with the EP wire's FP8 rows: each token copy's row rounded through e4m3 with its own
    scale before the experts (its gradient straight through), and each copy's expert-output gradient rounded
    the same way in backward. Both roundings are per row, so an EP run with `ep_dispatch_dtype` and
    `ep_combine_grad_dtype = "float8_e4m3"` that rounds each row once computes the same values on any layout."""

    def run(self, experts, x_TD, counts_E):
        y_TD = swiglu_experts(_RoundRows.apply(x_TD), experts.w13, experts.w2, counts_E)
        return _RoundGradRows.apply(y_TD)


class _RoundRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD):
        return decode(encode(x_TD), x_TD.dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        return grad_TD


class _RoundGradRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_TD):
        return y_TD.view_as(y_TD)

    @staticmethod
    def backward(ctx, grad_TD):
        return decode(encode(grad_TD), grad_TD.dtype)


def fp8_reference() -> dict:
    """`reference_step` of the model whose MoE layers dispatch through `Fp8LocalDispatcher`."""
    def build():
        model = build_model()
        for module in model.modules():
            if isinstance(module, MoE):
                module.dispatcher = Fp8LocalDispatcher()
        return model
    return reference_step(build)


_MESHES = {}  # this rank process's meshes, by what build_meshes reads of a layout


def meshes_for(layout):
    """build_meshes(layout), built once per rank process for each distinct set of degrees and numbering
    (parallel/meshes.py reads nothing else of the layout)."""
    key = (layout.world_size, layout.dp_replicate, layout.dp_shard, layout.cp, layout.ep, layout.edp_replicate,
           layout.edp_shard, layout.expert_inner)
    if key not in _MESHES:
        _MESHES[key] = build_meshes(layout, "cpu")
    return _MESHES[key]


def collect_tapes() -> list:
    """The tapes parallel/ep/keep.py makes from now on (this rank process only), to weigh what they keep."""
    from parallel.ep import keep as ep_keep

    tapes = []
    base = getattr(ep_keep.Tape, "original", ep_keep.Tape)  # not a subclass of the previous case's

    class Tape(base):
        original = base

        def __init__(self):
            super().__init__()
            tapes.append(self)

    ep_keep.Tape = Tape
    return tapes


def run_case(config, reference, checkpoint="none") -> dict:
    """One step of `config` (a ParallelConfig) on this rank, against `reference` (`reference_step`): its
    loss and gradient norm, each gradient's largest error, the forward's routing, the kept bytes, the
    forward's and backward's all-to-all bytes (in-node, across nodes), host syncs, drops, the first MoE
    layer's timeline."""
    from torch.distributed.tensor import distribute_tensor

    model = build_model()
    layout = config.resolve(dist.get_world_size(), activation_checkpoint=checkpoint)
    layout.validate(model.config, SEQ, BATCH)
    meshes = meshes_for(layout)
    parallelize(model, meshes, layout)
    routing, timeline = [], []
    dispatchers(model)[0].timeline = timeline  # the first MoE layer's pieces
    for router in model.routers():
        router.register_forward_hook(lambda m, args, out: routing.append(out[1].clone()))
    tapes = collect_tapes()
    inputs, labels = batch(model.config.vocab_size)
    rows = slice(meshes.dp_rank() * (BATCH // layout.dp), (meshes.dp_rank() + 1) * (BATCH // layout.dp))
    positions = load_balanced_positions(SEQ, layout.cp, meshes.cp_rank())
    with record_collectives() as forward, count_syncs() as syncs:
        loss = loss_fn(model(inputs[rows][:, positions], positions_S=positions), labels[rows][:, positions],
                       BATCH * SEQ)
    forward_routing = list(routing)  # the forward's (a recompute routes again)
    kept = sum(v.numel() * v.element_size() for tape in tapes for _, v in tape.entries if isinstance(v, torch.Tensor))
    with record_collectives() as backward:
        loss.backward()
    grad_err = {}
    for fqn, p in model.named_parameters():
        expected = distribute_tensor(reference["grads"][fqn], p.grad.device_mesh, p.grad.placements,
                                     src_data_rank=None).to_local()
        diff = p.grad.to_local() - expected
        grad_err[fqn] = (diff.abs().max().item() if diff.numel() else 0.0, reference["grads"][fqn].abs().max().item())
    drops = read_drop_counts(model)
    return {"timeline": timeline, "drops": None if drops is None else drops.tolist(),
            "loss": global_loss(loss).item(), "norm": clip_grad_norm_(model.parameters(), 1.0).item(),
            "grad_err": grad_err, "routing": forward_routing, "kept_bytes": kept,
            "ep_ranks": dist.get_process_group_ranks(meshes.ep.get_group()),
            "forward": split_by_node(forward, RPN), "backward": split_by_node(backward, RPN),
            "syncs": {k: v for k, v in syncs.by_kind.items() if k != "copy"}}


def errors(reference: dict, got: dict) -> dict:
    """Relative errors of one rank's case against a reference: loss, norm, and the worst gradient's
    (largest error over the gradient's largest magnitude)."""
    return {"loss": abs(got["loss"] - reference["loss"]) / abs(reference["loss"]),
            "norm": abs(got["norm"] - reference["norm"]) / abs(reference["norm"]),
            "grad": max(err / scale if scale else err for err, scale in got["grad_err"].values())}


def assert_matches_single_process(reference: dict, per_rank: list[dict]) -> None:
    """Every rank's loss and norm within NORM_RTOL of the reference's, every gradient within GRAD_RTOL."""
    import pytest

    for rank, got in enumerate(per_rank):
        assert got["loss"] == pytest.approx(reference["loss"], rel=NORM_RTOL), f"rank {rank} loss"
        assert got["norm"] == pytest.approx(reference["norm"], rel=NORM_RTOL), f"rank {rank} grad norm"
        for fqn, (err, scale) in got["grad_err"].items():
            assert err <= GRAD_RTOL * scale, f"rank {rank} grad {fqn}: max error {err:.3g}, max |grad| {scale:.3g}"


def planned_bytes(per_rank, name, config, backward=False, stages=None) -> dict[int, tuple[int, int]]:
    """{global rank: (intra, inter) bytes} the whole-step projection's per-layer EP stages
    (planning/ep_traffic.layer_stages: the runtime's dispatch plan) give for case `name`'s own
    routing (`config`: its ParallelConfig), summed over the MoE layers (only the named `stages` when given)."""
    from planning.ep_traffic import layer_stages

    out = {}
    layout = config.resolve(WORLD)
    for ep_ranks in {tuple(r[name]["ep_ranks"]) for r in per_rank}:
        placement = Placement(MODEL.n_routed_experts, ep_ranks, RPN)
        totals = {r: [0, 0] for r in ep_ranks}
        for layer in range(len(per_rank[ep_ranks[0]][name]["routing"])):
            routing = [per_rank[r][name]["routing"][layer] for r in ep_ranks]
            planned = [s for s in layer_stages(MODEL, layout, routing, 4, placement) if stages is None or s.name in stages]
            sent = sent_bytes(planned, placement, backward)
            for i, r in enumerate(ep_ranks):
                totals[r][0] += int(sent["intra"][i])
                totals[r][1] += int(sent["inter"][i])
        out.update({r: tuple(v) for r, v in totals.items()})
    return out
