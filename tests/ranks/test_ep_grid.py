"""The EP dispatch grid: route (direct, dedup, capacity) x wire dtype (the compute dtype; FP8 dispatch with FP8
combine gradient) x recompute (resend, keep) x schedule (one pass, 2 pieces), under full activation
checkpointing, on 8 gloo ranks in two simulated nodes (tests/helpers/ep_cases.py HEADLINE: dp 4 x cp 2 | ep 8,
ranks_per_node 4), all in one set of forked ranks. The combinations the refusal table refuses (capacity with
pieces) are asserted refused; every other one:
- equals the single process: the compute dtype the fp32 step, FP8 the single process with the same per-row
  FP8 roundings (tests/helpers/ep_cases.py `Fp8LocalDispatcher`), both at the fp32 tolerances (2e-5 on gradients,
  1e-5 on loss and norm), except dedup + FP8, which rounds some rows twice (the node hop's rows again at the
  fan-out; the fan-in's and the node combine's gradients): there within the measured effect of one rounding
  (the FP8 single process against the fp32 one);
- sends the plan's bytes, every rank, forward and backward, in-node and across nodes (resend: the forward's
  again in the recompute), and reads the plan's host syncs in its forward;
- with keep, sends nothing again: its forward bytes are resend's, and resend's backward is keep's plus the
  forward once more; loss and norm equal resend's.
"""

import itertools

import pytest
import torch

from ep_cases import (BATCH, GRAD_RTOL, HEADLINE, MODEL, NORM_RTOL, SEQ, WORLD, assert_matches_single_process,
                      errors, fp8_reference, planned_bytes, reference_step, run_case)
from multirank import run_ranks
from parallel.ep import refusals
from parallel.layout import ParallelConfig

ROUTES = {"direct": {}, "dedup": {"ep_dedup": True}, "capacity": {"ep_capacity_factor": 8.0}}  # 8 = ep: no drops
WIRES = {"compute": {}, "fp8": {"ep_dispatch_dtype": "float8_e4m3", "ep_combine_grad_dtype": "float8_e4m3"}}
RECOMPUTES = {"resend": {}, "keep": {"ep_recompute": "keep"}}
SCHEDULES = {"one_pass": {}, "pieces2": {"ep_overlap_chunks": 2}}
GRID = {f"{route}_{wire}_{recompute}_{schedule}": ParallelConfig(**HEADLINE, **r, **w, **c, **s)
        for (route, r), (wire, w), (recompute, c), (schedule, s) in itertools.product(
            ROUTES.items(), WIRES.items(), RECOMPUTES.items(), SCHEDULES.items())}


def _refusal(config) -> str | None:
    """The refusal table's line for `config` under full checkpointing and this batch, or None."""
    try:
        refusals.check(config.resolve(WORLD, activation_checkpoint="full"), MODEL, SEQ, BATCH, grad_accum=1)
    except ValueError as e:
        return str(e)
    return None


ACCEPTED = {name: config for name, config in GRID.items() if _refusal(config) is None}
DOUBLE_ROUNDED = [n for n in ACCEPTED if n.startswith("dedup_fp8")]


def _run_grid(rank, world, references):
    torch.manual_seed(0)
    return {name: run_case(config, references[name.split("_")[1]], "full") for name, config in ACCEPTED.items()}


@pytest.fixture(scope="module")
def grid():
    references = {"compute": reference_step(), "fp8": fp8_reference()}
    return references, run_ranks(_run_grid, WORLD, references, timeout=600)


def test_only_capacity_with_pieces_is_refused():
    refused = {name: _refusal(config) for name, config in GRID.items() if name not in ACCEPTED}
    assert len(GRID) == 24 and len(ACCEPTED) == 20
    assert sorted(refused) == sorted(n for n in GRID if n.startswith("capacity") and n.endswith("pieces2"))
    assert all(line.startswith("parallel.ep_overlap_chunks=2 with parallel.ep_capacity_factor=8.0: not combined yet")
               for line in refused.values())


@pytest.mark.parametrize("name", [n for n in ACCEPTED if n not in DOUBLE_ROUNDED])
def test_each_combination_equals_the_single_process(grid, name):
    references, per_rank = grid
    wire = name.split("_")[1]
    assert_matches_single_process(references[wire], [by_case[name] for by_case in per_rank])
    if wire == "fp8":  # the FP8 path ran: the fp32 single process is farther than the tolerances
        far = errors(references["compute"], per_rank[0][name])
        assert far["norm"] > NORM_RTOL or far["grad"] > GRAD_RTOL, far


def _one_rounding(references) -> dict:
    """The measured effect of rounding each row once to FP8: the FP8 single process against the fp32 one
    (relative: loss, norm, worst gradient)."""
    fp32, fp8 = references["compute"], references["fp8"]
    grad = max((fp8["grads"][k] - g).abs().max().item() / g.abs().max().item() for k, g in fp32["grads"].items()
               if g.abs().max() > 0)
    return {"loss": abs(fp8["loss"] - fp32["loss"]) / abs(fp32["loss"]),
            "norm": abs(fp8["norm"] - fp32["norm"]) / abs(fp32["norm"]), "grad": grad}


@pytest.mark.parametrize("name", DOUBLE_ROUNDED)
def test_dedup_fp8_is_within_one_rounding_of_the_fp8_single_process(grid, name):
    """Dedup rounds the rows it forwards at its gateway a second time and its gradients twice: each of loss,
    norm and worst gradient is within the FP8 single process's own distance from fp32 (plus the fp32 tolerance)
    of the FP8 single process."""
    references, per_rank = grid
    yardstick = _one_rounding(references)
    tolerance = {"loss": NORM_RTOL, "norm": NORM_RTOL, "grad": GRAD_RTOL}
    for rank, by_case in enumerate(per_rank):
        got = errors(references["fp8"], by_case[name])
        print(name, rank, {k: f"{v:.3g} (one rounding {yardstick[k]:.3g})" for k, v in got.items()})
        assert all(got[k] <= yardstick[k] + tolerance[k] for k in got), (rank, got, yardstick)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_counted_bytes_and_host_syncs_are_the_plans(grid, name):
    """Every rank's all-to-all bytes (forward; backward: the gradients, plus with resend the recompute's
    forward again) equal the plan's for the run's own routing; forward host syncs = MoE layers x
    parallel/ep/plan.host_syncs_per_layer."""
    from parallel.ep.plan import host_syncs_per_layer

    _, per_rank = grid
    config = ACCEPTED[name]
    forward, backward = (planned_bytes(per_rank, name, config, b) for b in (False, True))
    if config.ep_recompute == "resend":
        backward = {r: (a + forward[r][0], b + forward[r][1]) for r, (a, b) in backward.items()}
    syncs = len(per_rank[0][name]["routing"]) * host_syncs_per_layer(config.resolve(WORLD).ep_config)
    for rank, by_case in enumerate(per_rank):
        assert (by_case[name]["forward"], by_case[name]["backward"]) == (forward[rank], backward[rank]), rank
        assert sum(by_case[name]["syncs"].values()) == syncs, by_case[name]["syncs"]


@pytest.mark.parametrize("name", [n for n in ACCEPTED if "_keep_" in n])
def test_keep_sends_nothing_again(grid, name):
    _, per_rank = grid
    resend = name.replace("_keep_", "_resend_")
    for rank, by_case in enumerate(per_rank):
        got, want = by_case[name], by_case[resend]
        assert [torch.equal(a, b) for a, b in zip(got["routing"], want["routing"])] == [True] * len(want["routing"])
        assert got["forward"] == want["forward"] and sum(got["forward"]) > 0, rank
        assert tuple(a + b for a, b in zip(got["backward"], got["forward"])) == want["backward"], rank
        assert got["loss"] == pytest.approx(want["loss"], rel=NORM_RTOL)
        assert got["norm"] == pytest.approx(want["norm"], rel=NORM_RTOL)
