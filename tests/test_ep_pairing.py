"""Each micro-batch's backward paired with the next one's forward (parallel/ep_pairing.py) on 8 gloo ranks in two
simulated nodes: the paired steps against the single-process steps (fp32, 1e-5 as tests/test_ep_dispatch.py) and
against the unpaired steps of the same layout (bitwise: the same operations in the same order per micro-batch),
with the halves and full checkpointing + kept exchanges (split by positions; by sequences under cp = 2 in the
folded HSDP layout with the gradients all-reduced once per step), and with the pieces; the bytes every
all-to-all moved and the host syncs equal the unpaired run's; recorded timestamps show the next micro-batch's
forward all-to-alls in flight while the backward computes, and the backward's while the forward computes.
Recompute ahead (parallel/recompute_ahead.py), paired and not, in the folded layout with FSDP prefetch and with
K2's knobs: each block below reruns inside the block above's dispatch-gradient waits, and the losses, gradients,
parameters, all-to-all bytes, host syncs and FSDP all-gathers per unit are the in-order run's to the bit.
"""

import collections
import os
import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from benchmarks.lib.ep_traffic import count_all_to_all, split_by_node
from models import Transformer, preset
from multirank import run_ranks
from parallel.context_parallel import load_balanced_positions
from parallel.ep.dispatcher import dispatchers
from parallel.gradients import clip_grad_norm_, global_loss, loss_fn
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.overlap import set_fsdp_prefetch
from parallel.parallelize import parallelize
from runtime.syncs import count_syncs
from runtime.train import forward_backward
from test_recompute_prefetch import _counting_unshard

WORLD, SEQ, RPN = 8, 32, 4
MICRO = 8  # sequences per micro-batch (all ranks)
N_LAYERS = 5  # 4 MoE blocks: the forward going up and the backward going down cross mid-model
LR = 0.5
TOL = 1e-5  # fp32, other summation orders than one process (tests/test_ep_dispatch.py)
BY_POSITION = dict(dp_shard=8, cp=1, ep=8, edp_shard=1, ranks_per_node=RPN)  # 1 sequence per rank
FOLDED = dict(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4, expert_inner="edp_shard", ranks_per_node=RPN)
CASES = {  # name: (layout knobs, activation checkpoint, grad sync, FSDP prefetch depth, SGD steps, micro-batches)
    "position_halves_full_keep": (dict(BY_POSITION, ep_interleave=True, ep_recompute="keep"), "full", "every", 0, 2, 3),
    "folded_halves_full_keep": (dict(FOLDED, ep_interleave=True, ep_recompute="keep"), "full", "replicas_last", 1, 1, 2),
    "position_pieces": (dict(BY_POSITION, ep_overlap_chunks=2), "none", "every", 0, 1, 2),
    "folded_halves_full_keep_ahead": (dict(FOLDED, ep_interleave=True, ep_recompute="keep", ep_recompute_ahead=True),
                                      "full", "replicas_last", 1, 1, 2),
    "position_k2_knobs": (dict(BY_POSITION, ep_interleave=True, ep_recompute="keep", ep_dispatch_dtype="float8_e4m3",
                               ep_combine_grad_dtype="float8_e4m3", ep_recompute_ahead=True), "full", "every", 1, 1, 2),
}
INEXACT = ("position_k2_knobs",)  # FP8 rows: compared with its unpaired run only (bitwise)
AHEAD = {"folded_halves_full_keep_ahead": "folded_halves_full_keep"}  # recompute ahead: its in-order twin


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset("debug", n_layers=N_LAYERS))
    model.init_weights()
    return model


def _batches(vocab_size: int, steps: int, M: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """steps x M micro-batches of MICRO sequences (inputs, labels)."""
    tokens = torch.randint(0, vocab_size, (steps * M * MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens.split(MICRO)]


def _reference(steps: int, M: int) -> dict:
    """One process: per step the loss summed over the micro-batches, the gradient norm, SGD; first-step gradients."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    batches, losses, norms, grads = _batches(model.config.vocab_size, steps, M), [], [], None
    for step in range(steps):
        total = 0.0
        for inputs, labels in batches[step * M:(step + 1) * M]:
            loss = loss_fn(model(inputs), labels, M * MICRO * SEQ)
            loss.backward()
            total += loss.item()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        sgd.step()
        sgd.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads}


class _ThreadTimeline(list):
    """A dispatcher's timeline that also notes whether the main thread (the backward) or another (the paired forward) marked."""

    def append(self, item):
        super().append((*item, threading.current_thread() is threading.main_thread()))


def _run(knobs: dict, checkpoint: str, grad_sync: str, prefetch: int, steps: int, M: int, paired: bool) -> dict:
    model = _model()
    layout = ParallelConfig(**knobs, ep_pair_micro_batches=paired).resolve(WORLD)
    meshes = build_meshes(layout, "cpu")
    parallelize(model, meshes, layout, activation_checkpoint=checkpoint)
    set_fsdp_prefetch(model, prefetch)
    timeline = _ThreadTimeline()  # every MoE layer's: the paired forward and backward are in different layers
    for d in dispatchers(model):
        d.timeline = timeline
    sgd = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    rows = slice(meshes.dp_rank() * (MICRO // layout.dp), (meshes.dp_rank() + 1) * (MICRO // layout.dp))
    positions = load_balanced_positions(SEQ, layout.cp, meshes.cp_rank())
    batches = [(x[rows][:, positions], y[rows][:, positions], positions)
               for x, y in _batches(model.config.vocab_size, steps, M)]
    losses, norms, grads, calls, gathers = [], [], {}, [], collections.Counter()
    for step in range(steps):
        with (count_all_to_all() as step_calls, count_syncs() as syncs,
              mock.patch.object(FSDPParamGroup, "unshard", _counting_unshard(gathers))):
            local = forward_backward(model, batches[step * M:(step + 1) * M], M * MICRO * SEQ, torch.device("cpu"),
                                     grad_sync)
        calls += step_calls
        losses.append(global_loss(local).item())
        if step == 0:
            grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        norms.append(clip_grad_norm_(model.parameters(), 1.0).item())
        sgd.step()
        sgd.zero_grad()
    params = {k: p.full_tensor() for k, p in model.named_parameters()}  # collectives: on every rank
    first = dist.get_rank() == 0
    return {"losses": losses, "norms": norms, "grads": grads if first else None, "params": params if first else None,
            "bytes": split_by_node(calls, RPN), "syncs": {k: v for k, v in syncs.by_kind.items() if k != "copy"},
            "timeline": list(timeline), "gathers": dict(gathers)}


def _run_all(rank, world):
    return {(name, paired): _run(*CASES[name], paired) for name in CASES for paired in (False, True)}


@pytest.fixture(scope="module")
def results():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = {(steps, M): _reference(steps, M) for *_, steps, M in CASES.values()}
    finally:
        torch.set_num_threads(threads)
    return reference, run_ranks(_run_all, WORLD, timeout=400)


@pytest.mark.parametrize("name", [n for n in CASES if n not in INEXACT])
@pytest.mark.parametrize("paired", [False, True])
def test_matches_single_process(results, name, paired):
    references, ranks = results
    reference = references[CASES[name][-2:]]
    for out in ranks:
        got = out[name, paired]
        assert len(got["losses"]) == len(reference["losses"]) == CASES[name][-2]
        for step, expected in enumerate(reference["losses"]):
            assert got["losses"][step] == pytest.approx(expected, rel=TOL), (name, step)
            assert got["norms"][step] == pytest.approx(reference["norms"][step], rel=TOL), (name, step)
    for fqn, grad in ranks[0][name, paired]["grads"].items():
        expected = reference["grads"][fqn]
        assert (grad - expected).abs().max() <= TOL * max(expected.abs().max(), 1e-3), (name, fqn)


@pytest.mark.parametrize("name", CASES)
def test_paired_equals_unpaired_bitwise(results, name):
    """Each micro-batch meets the same operations in the same order, so every loss, norm, gradient and the
    parameters after the SGD steps are the unpaired run's to the bit."""
    _, ranks = results
    for out in ranks:
        assert out[name, True]["losses"] == out[name, False]["losses"]
        assert out[name, True]["norms"] == out[name, False]["norms"]
    paired, unpaired = ranks[0][name, True], ranks[0][name, False]
    for fqn in unpaired["grads"]:
        assert torch.equal(paired["grads"][fqn], unpaired["grads"][fqn]), fqn
        assert torch.equal(paired["params"][fqn], unpaired["params"][fqn]), fqn


@pytest.mark.parametrize("name", CASES)
def test_same_bytes_host_syncs_and_fsdp_gathers(results, name):
    _, ranks = results
    for out in ranks:
        assert out[name, True]["bytes"] == out[name, False]["bytes"] != (0, 0)
        assert out[name, True]["syncs"] == out[name, False]["syncs"]
        assert out[name, True]["gathers"] == out[name, False]["gathers"]


def _in_flight(timeline, forward: bool) -> int:
    """Exchanges of one side (forward: the paired forward's dispatch/combine, marked off the main thread;
    else the backward's gradient all-to-alls) during which the other side marked something: its compute ran."""
    start, end = ("start", "wait") if forward else ("grad_start", "grad_wait")
    count = 0
    for i, (event, piece, t, main) in enumerate(timeline):
        name = event[:-len(start) - 1]
        if main == forward or name not in ("dispatch", "combine") or event != f"{name}_{start}":
            continue
        j = next(j for j in range(i + 1, len(timeline))
                 if timeline[j][0] == f"{name}_{end}" and timeline[j][1] == piece and timeline[j][3] == main)
        count += any(timeline[k][3] != main for k in range(i + 1, j))
    return count


@pytest.mark.parametrize("name", CASES)
def test_each_side_computes_while_the_others_all_to_alls_cross(results, name):
    """On the MoE layers' timestamps: unpaired, nothing runs beside the main thread; paired, some of
    the next forward's dispatches/combines are in flight while the backward marks (its gradient all-to-alls
    issued: compute done), and some of the backward's gradient all-to-alls while the forward marks."""
    _, ranks = results
    for out in ranks:
        assert all(main for *_, main in out[name, False]["timeline"])
        paired = out[name, True]["timeline"]
        assert _in_flight(paired, forward=True) > 0, name
        assert _in_flight(paired, forward=False) > 0, name


def _recomputes_inside_dispatch_gradient_waits(timeline) -> int:
    """Attention starts (forward or recompute) that the backward (main thread) marks while one of its dispatch
    gradients is in flight (started, not yet waited for): in order none, ahead every recompute below the top."""
    in_flight, count = set(), 0
    for event, piece, _, main in timeline:
        if main and event == "dispatch_grad_start":
            in_flight.add(piece)
        elif main and event == "dispatch_grad_wait":
            in_flight.discard(piece)
        elif main and event == "attention_start":
            count += bool(in_flight)
    return count


@pytest.mark.parametrize("name", [*AHEAD, "position_k2_knobs"])
@pytest.mark.parametrize("paired", [False, True])
def test_recompute_ahead_runs_the_block_below_inside_the_dispatch_gradient_waits(results, name, paired):
    """Per micro-batch's backward, each MoE block with a MoE block below starts that block's recompute (its
    two halves' attention) inside its own dispatch-gradient wait; in order (the twin) none does."""
    _, ranks = results
    *_, steps, M = CASES[name]
    moe_below = N_LAYERS - 2  # MoE blocks 1..4 (block 0 is dense): 3 have a MoE block below
    for out in ranks:
        assert _recomputes_inside_dispatch_gradient_waits(out[name, paired]["timeline"]) == steps * M * moe_below * 2
    for twin in AHEAD.values():
        for out in ranks:
            assert _recomputes_inside_dispatch_gradient_waits(out[twin, paired]["timeline"]) == 0


@pytest.mark.parametrize("name", AHEAD)
@pytest.mark.parametrize("paired", [False, True])
def test_recompute_ahead_equals_in_order_bitwise(results, name, paired):
    """Only the time of each recompute moves: every loss, norm, gradient, parameter after SGD, all-to-all byte,
    host sync and FSDP all-gather per unit is the in-order run's."""
    _, ranks = results
    for out in ranks:
        ahead, twin = out[name, paired], out[AHEAD[name], paired]
        assert (ahead["losses"], ahead["norms"], ahead["bytes"], ahead["syncs"]) == \
            (twin["losses"], twin["norms"], twin["bytes"], twin["syncs"])
        assert ahead["gathers"] == twin["gathers"] and sum(twin["gathers"].values()) > 0
    ahead, twin = ranks[0][name, paired], ranks[0][AHEAD[name], paired]
    for fqn in twin["grads"]:
        assert torch.equal(ahead["grads"][fqn], twin["grads"][fqn]), fqn
        assert torch.equal(ahead["params"][fqn], twin["params"][fqn]), fqn


@pytest.mark.parametrize("argv, message", [
    ([], "parallel.ep_pair_micro_batches needs parallel.ep_interleave = true or parallel.ep_overlap_chunks > 1"),
    (["--parallel.ep_interleave=true", "--training.grad_accum=1"],
     "parallel.ep_pair_micro_batches with training.grad_accum=1: nothing to pair"),
    (["--parallel.ep_overlap_chunks=2", "--parallel.ep_dedup=true", "--training.grad_accum=2"],
     "parallel.ep_pair_micro_batches with parallel.ep_dedup: not combined yet"),
    (["--parallel.ep=1", "--parallel.edp_shard=8", "--training.grad_accum=2"],
     "parallel.ep_pair_micro_batches=True has no effect with parallel.ep=1"),
])
def test_the_launch_config_refuses_what_pairing_cannot_run(argv, message):
    """The debug config on 8 ranks: refused before launch, in one line."""
    from runtime.config import load_config

    with pytest.raises(ValueError) as error:
        load_config(["--parallel.ep_pair_micro_batches=true", "--data.batch_size=16", *argv]).layout(WORLD)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("argv, got", [(["--training.activation_checkpoint=none"], "'none' and True"),
                                       (["--parallel.ep_interleave=false"], "'full' and False")])
def test_the_launch_config_refuses_recompute_ahead_without_full_checkpointing_and_halves(argv, got):
    from runtime.config import load_config

    argv = ["--parallel.ep_recompute_ahead=true", "--parallel.ep_interleave=true", "--training.activation_checkpoint=full",
            "--data.batch_size=16", *argv]
    with pytest.raises(ValueError) as error:
        load_config(argv).layout(WORLD)
    assert str(error.value) == ("parallel.ep_recompute_ahead needs training.activation_checkpoint='full' and "
                                f"parallel.ep_interleave = true (got {got}): the block below reruns inside the halves' "
                                "dispatch-gradient waits")


def test_post_training_refuses_pairing_and_recompute_ahead_in_one_line():
    from launch import posttrain
    from runtime.config import load_config

    rollouts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "rollouts.jsonl")
    config = load_config(["--data.source=rollouts", f"--data.path={rollouts}", "--parallel.ep_interleave=true",
                          "--parallel.ep_pair_micro_batches=true", "--training.grad_accum=2"])
    with pytest.raises(ValueError, match="parallel.ep_pair_micro_batches: pretraining only"):
        posttrain.check_environment(config)
    config = load_config(["--data.source=rollouts", f"--data.path={rollouts}", "--parallel.ep_interleave=true",
                          "--parallel.ep_recompute_ahead=true", "--training.activation_checkpoint=full"])
    with pytest.raises(ValueError, match="parallel.ep_recompute_ahead: pretraining only"):
        posttrain.check_environment(config)
