"""The pipeline memory estimate's micro-batches in flight (planning/memory/stages.py) against torch 2.13's own
schedules: each schedule is built for real (PipelineStage on a fake process group of pp ranks, one forked
process), and every rank's action list (`pipeline_order`, which torch computes for all ranks) is walked, keeping a
stage's micro-batch from its forward until its full backward or its weight pass. The estimate's moments must
reach the same heaviest state under every weighting of the stages (stages of unequal size); and the estimate
per pipeline rank (planning/memory/pretrain.py `estimate_stages`) holds the runtime's stages."""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multirank import run_ranks
from planning.memory.stages import in_flight
from parallel.pp.config import PipelineConfig
from parallel.pp.plan import rank_stages

CASES = [("gpipe", 2, 1, 3), ("1f1b", 4, 1, 4), ("1f1b", 4, 1, 9), ("interleaved_1f1b", 4, 2, 8),
         ("interleaved_1f1b", 4, 2, 12), ("interleaved_1f1b", 2, 3, 6), ("interleaved_1f1b", 3, 2, 4),
         ("zbv", 2, 2, 4), ("zbv", 4, 2, 10), ("dualpipev", 2, 2, 4), ("dualpipev", 4, 2, 9)]


def _config(schedule, pp, v) -> PipelineConfig:
    return PipelineConfig(pp=pp, pp_schedule=schedule, pp_stages_per_rank=v if schedule == "interleaved_1f1b" else -1)


def _orders(rank, world_size, cases):
    """{case: {pp rank: [(kind, stage, micro-batch)]}} of torch's schedules (kinds F, B, I, W; an overlapped
    forward-backward as its two actions, in order)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                        OVERLAP_F_B)

    from parallel.fake_backend import register_fake_backend
    from parallel.pp.schedule import SCHEDULE_CLASSES, SINGLE_STAGE

    kinds = {FORWARD: "F", FULL_BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}
    register_fake_backend()
    out = {}
    for schedule, pp, v, m in cases:
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=pp)
        try:
            x = torch.empty(1, 4, device="meta")
            stages = [PipelineStage(nn.Linear(4, 4), s, pp * v, torch.device("cpu"), input_args=x, output_args=x)
                      for s in rank_stages(0, _config(schedule, pp, v))]
            order = SCHEDULE_CLASSES[schedule](stages[0] if schedule in SINGLE_STAGE else stages, m,
                                               loss_fn=lambda y, t: y.sum()).pipeline_order
            out[(schedule, pp, v, m)] = {
                r: [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
                    for action in actions if action is not None
                    for a in (action.sub_actions if action.computation_type == OVERLAP_F_B else (action,))
                    if a.computation_type in kinds]
                for r, actions in order.items()}
        finally:
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def orders():
    return run_ranks(_orders, 1, CASES, as_torchrun=True)[0]


def _states(actions, stages: list[int]) -> list[tuple[int, ...]]:
    """The rank's micro-batches alive per local stage after each action (forward in, full backward or weight
    pass out; an input-gradient pass keeps what the weight pass still reads)."""
    alive, states = [0] * len(stages), []
    for kind, stage, _ in actions:
        alive[stages.index(stage)] += {"F": 1, "B": -1, "W": -1, "I": 0}[kind]
        assert min(alive) >= 0
        states.append(tuple(alive))
    return states


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_the_estimate_s_micro_batches_in_flight_are_torch_s(orders, case):
    schedule, pp, v, m = case
    for r in range(pp):
        stages = rank_stages(r, _config(schedule, pp, v))
        states, moments = _states(orders[case][r], stages), in_flight(schedule, pp, v, m, r)
        assert states[-1] == (0,) * v and all(len(mo) == v for mo in moments)  # every micro-batch freed
        for weights in itertools.product((1, 2, 5), repeat=v):
            heaviest = max(sum(w * n for w, n in zip(weights, s)) for s in states)
            assert max(sum(w * n for w, n in zip(weights, mo)) for mo in moments) == heaviest, (r, weights)


def test_each_pipeline_rank_holds_the_runtime_s_stages_and_the_worst_decides():
    """estimate_stages on the debug model at pp 2 (1f1b) and pp 2 zbv: each pipeline rank's sharded state is its
    stages' parameters (the ranks' states add up to the whole model's on the stage's ranks), the first holds the
    embedding and pp micro-batches in flight, the head's stage the logits; the worst is the largest peak."""
    from planning.memory.pretrain import Job, estimate, estimate_stages, sharded_state, stage_layout
    from runtime.config_parser import load_config

    base = ["--config", "configs/debug.toml", "--model.n_layers=6", "--model.n_dense_layers=1",
            "--parallel.dp_shard=-1"]
    whole = load_config(base)
    for schedule in ("1f1b", "zbv"):
        config = load_config([*base, "--parallel.pp=2", f"--parallel.pp_schedule={schedule}",
                              "--training.grad_accum=4"])
        layout = config.layout(4)
        result = estimate_stages(Job(config, layout, 1, "cpu"))
        rows = result["stages"]
        assert [r["rank"] for r in rows] == [1, 3]
        assert result["worst"] == max(range(2), key=lambda p: rows[p]["total_gib"])
        plain = sharded_state(Job(whole, stage_layout(layout), 1, "cpu"))  # the whole model on 2 ranks
        assert {k: rows[0]["states_bytes"][k] + rows[1]["states_bytes"][k] for k in plain} == plain
        first, last = (r["stage"] for r in rows)
        if schedule == "1f1b":
            assert first["embedding"] and not first["head"] and last["head"] and first["moments"] == ((2,),)
            assert rows[0]["per_rank_gib"]["logits"] == 0 and "head" not in rows[0]["peak_at"]
        else:  # the V: rank 0 holds stages 0 and 3, the embedding and the head
            assert first["embedding"] and first["head"] and len(first["chunks"]) == 2
    one = estimate(Job(whole, whole.layout(2), 1, "cpu"))  # pp = 1: the whole model, as before pipelines
    assert one["stage"]["chunks"] == (tuple(range(6)),) and one["stage"]["moments"] == ((1,),)
