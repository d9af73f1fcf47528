"""Pipeline parallelism equals one process: every schedule, two layouts of 8 ranks in two simulated nodes
(parallel.ranks_per_node = 4), Muon and AdamW, with and without full activation checkpointing, through the
runtime's own step (tests/helpers/pp_cases.py: seeded init, the schedule, clipping, the optimizer, QK-clip, the
expert-bias update, then a held-out evaluation through the schedule's forward). One fork per layout runs all
its cases; the single-process runs are the same jobs at pp = 1 on one rank.

  pp 2 x (dense dp_shard 2 x cp 2 = experts ep 4): 1f1b, gpipe, interleaved_1f1b, zbv, dualpipev
  pp 4 x (dense dp_shard 2 = experts ep 2): interleaved_1f1b (8 stages of 0 to 1 blocks), zbv, dualpipev

Each case, every rank: loss and gradient norm within 1e-5 relative, the max logit too and the clipped heads
equal (QK-clip acts), the clipped gradients within 2e-5 of each parameter's largest entry, the parameters after
the optimizer step and QK-clip within 1e-5, the expert biases (updated from the stage's counts) and the router
counts (summed over each stage) exactly equal, eval_loss within 1e-5, every parameter with a gradient, and
every rank reading the same loss, norm and skip decision (the divergence guard's inputs).

Traps (issue 53), each with a test here that fails on it:
  1. zero-bubble schedules with FSDP reshard_after_forward=True: wrong gradients, no error. The runtime's
     "auto" is False under pp (the zbv and dualpipev cases are exact), "true" is refused with them
     (tests/unit/test_pp_plan.py), and `test_zero_bubble_with_reshard_after_forward_is_wrong` shows the refusal is
     needed on this torch: forced, the zbv AdamW case misses gradients or is far off.
  2. a PipelineStage built without example inputs runs a real forward: the first step's router counts would
     count one more micro-batch; `test_router_counts_equal_one_process` compares them exactly.
  3. activation checkpointing under the zero-bubble schedules: refused in one line (tests/unit/test_pp_plan.py).
  4. the step's world-wide collectives: the grad norm (replicas counted over the stage), the expert-bias
     update (stages hold 2 and 3 MoE layers at pp 2: a world-wide all-reduce of [layers, E] would mix them or
     abort), QK-clip's maxima (per layer, across stages): the norm, bias and max-logit comparisons above.
"""

import pytest
import torch

from multirank import run_ranks
from pp_cases import GRAD_RTOL, NORM_RTOL, PARAM_RTOL, PP2, PP4, SINGLE, WORLD, job, run_job, stage_counts

MUON, ADAMW, FULL = "--optim.name=muon", "--optim.name=adamw", "--training.activation_checkpoint=full"
PP2_CASES = {  # name: (schedule, optimizer, extra), grad_accum 4
    "1f1b_muon": ("1f1b", MUON), "1f1b_muon_full": ("1f1b", MUON, FULL), "gpipe_adamw": ("gpipe", ADAMW),
    "interleaved_1f1b_muon": ("interleaved_1f1b", MUON), "interleaved_1f1b_adamw_full": ("interleaved_1f1b", ADAMW, FULL),
    "zbv_muon": ("zbv", MUON), "dualpipev_muon": ("dualpipev", MUON),
}
PP4_CASES = {  # grad_accum 8 (2 x pp for the V schedules)
    "interleaved_1f1b_muon": ("interleaved_1f1b", MUON), "interleaved_1f1b_adamw": ("interleaved_1f1b", ADAMW),
    "interleaved_1f1b_muon_full": ("interleaved_1f1b", MUON, FULL), "zbv_muon": ("zbv", MUON),
    "dualpipev_adamw": ("dualpipev", ADAMW),
}
STAGE_SIZE = {"pp2": 4, "pp4": 2}
ACCUM = {"pp2": 4, "pp4": 8}
TRAP_1 = "zbv_muon_reshard_true"


def _argv(layout: dict, accum: int, schedule: str, *extra: str) -> list[str]:
    return job({**layout, "pp_schedule": schedule}, accum, *extra)


def _run_cases(rank, world, cases: dict, references: dict | None = None):
    """Each case's run (`run_job`), against its reference when given (each case: argv, optimizer-extra key,
    and run_job's options)."""
    return {name: run_job(argv, references and references[extra], *options)
            for name, (argv, extra, *options) in cases.items()}


def _references(accum: int, cases: dict) -> dict:
    """The single-process run of each (optimizer, checkpointing) the cases use."""
    wanted = {tuple(extra) for _, *extra in cases.values()}
    jobs = {extra: (job(SINGLE, accum, *extra), extra) for extra in wanted}
    return run_ranks(_run_cases, 1, jobs, timeout=300)[0]


@pytest.fixture(scope="module")
def pp2():
    cases = {name: (_argv(PP2, ACCUM["pp2"], schedule, *extra), tuple(extra))
             for name, (schedule, *extra) in PP2_CASES.items()}
    cases[TRAP_1] = (_argv(PP2, ACCUM["pp2"], "zbv", ADAMW), (ADAMW,), None, "true")  # what the config refuses
    # a last-stage rank's NaN logits in the first of two steps
    cases["1f1b_muon_nan"] = (_argv(PP2, ACCUM["pp2"], "1f1b", MUON, "--training.steps=2"), (MUON,), 5)
    references = _references(ACCUM["pp2"], PP2_CASES)
    return references, run_ranks(_run_cases, WORLD, cases, references, timeout=900)


@pytest.fixture(scope="module")
def pp4():
    cases = {name: (_argv(PP4, ACCUM["pp4"], schedule, *extra), tuple(extra))
             for name, (schedule, *extra) in PP4_CASES.items()}
    references = _references(ACCUM["pp4"], PP4_CASES)
    return references, run_ranks(_run_cases, WORLD, cases, references, timeout=900)


def _check(per_rank, name):
    for rank, by_case in enumerate(per_rank):
        got = by_case[name]["errors"]
        print(name, rank, {k: v for k, v in got.items() if k != "no_grad"})
        assert got["no_grad"] == [], f"rank {rank}: no gradient for {got['no_grad']}"
        assert got["loss"] <= NORM_RTOL and got["norm"] <= NORM_RTOL and got["max_logit"] <= NORM_RTOL, (rank, got)
        assert got["clipped"] and got["bias"], (rank, got)
        assert got["grad"] <= GRAD_RTOL and got["param"] <= PARAM_RTOL and got["eval"] <= NORM_RTOL, (rank, got)
    first = per_rank[0][name]["steps"]
    for rank, by_case in enumerate(per_rank):  # the divergence guard's inputs: the same on every rank
        assert [(s["loss"], s["grad_norm"], s["skipped"]) for s in by_case[name]["steps"]] == \
               [(s["loss"], s["grad_norm"], s["skipped"]) for s in first], rank


@pytest.mark.parametrize("name", list(PP2_CASES))
def test_pp2_equals_one_process(pp2, name):
    _check(pp2[1], name)


@pytest.mark.parametrize("name", list(PP4_CASES))
def test_pp4_equals_one_process(pp4, name):
    _check(pp4[1], name)


def test_zero_bubble_with_reshard_after_forward_is_wrong(pp2):
    """Trap 1 on this torch: the zbv case with FSDP resharding after each forward leaves parameters without a
    gradient or far off the single process (the refusal in parallel/pp/plan.py stays needed)."""
    worst = [by_case[TRAP_1]["errors"] for by_case in pp2[1]]
    assert any(e["no_grad"] or e["grad"] > 1e-2 for e in worst), worst


def test_router_counts_equal_one_process(pp2, pp4):
    """Trap 2: the first step's token counts of every router, summed over its stage's ranks, equal the single
    process's exactly (a stage that inferred its shapes with a real forward would count one more micro-batch)."""
    for layout, (references, per_rank), cases in (("pp2", pp2, PP2_CASES), ("pp4", pp4, PP4_CASES)):
        for name, (_, *extra) in cases.items():
            reference = references[tuple(extra)]["counts"]
            counts = {n: c for stage in stage_counts(per_rank, name, STAGE_SIZE[layout]) for n, c in stage.items()}
            assert sorted(counts) == sorted(reference), name  # each MoE layer on one stage
            assert all(torch.equal(c, reference[n]) for n, c in counts.items()), name


def test_stages_hold_different_numbers_of_moe_layers(pp2):
    """Trap 4's abort case is exercised: at pp 2 the stages hold 2 and 3 MoE layers (6 blocks, the first dense:
    embedding + blocks 0-2, blocks 3-5 + head)."""
    _, per_rank = pp2
    assert [by_case["1f1b_muon"]["moe_layers"] for by_case in per_rank] == [2] * 4 + [3] * 4


def test_a_non_finite_loss_skips_the_step_on_every_rank(pp2):
    """One last-stage rank's NaN logits: every rank of both stages skips the first step and trains the next one."""
    _, per_rank = pp2
    for rank, by_case in enumerate(per_rank):
        steps = by_case["1f1b_muon_nan"]["steps"]
        assert [s["skipped"] for s in steps] == [True, False], rank


def test_steady_host_syncs_are_one_per_step(pp2):
    """A step after the first (the NaN run's second) reads one host value (the loss, the norm and the rest
    together) plus the EP count exchange's one per MoE layer and micro-batch, as without pipeline parallelism:
    the schedule adds none (its stages' one vote is read in the first step only)."""
    _, per_rank = pp2
    for rank, by_case in enumerate(per_rank):
        run = by_case["1f1b_muon_nan"]
        assert sum(run["steps"][1]["syncs"].values()) == 1 + run["moe_layers"] * ACCUM["pp2"], (rank, run["steps"][1]["syncs"])
