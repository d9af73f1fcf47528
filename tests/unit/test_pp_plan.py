"""Pipeline parallelism's plan and refusals, without a process group (parallel/pp/plan.py, parallel/layout.py,
runtime/config.py): stage sizes and layer spreads, which stages a rank runs, FSDP's reshard_after_forward,
the layout printout, and every refused value in one line naming the key and the numbers (traps 1 and 3 of
issue 53 among them)."""

import pytest

from models import preset
from parallel.layout import ParallelConfig
from parallel.meshes import describe, group_ranks
from parallel.pp import plan
from runtime.config import ConfigError
from runtime.config_parser import load_config

BASE = ["--model.n_layers=6", "--data.source=synthetic", "--data.seq_len=32", "--data.batch_size=16"]
PP2 = ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.cp=2", "--parallel.ep=4", "--parallel.edp_shard=1"]


def _layout(*argv, world=8):
    return load_config(BASE + list(argv)).layout(world)


def test_pp_is_the_outermost_axis_and_both_layouts_fill_a_stage():
    layout = ParallelConfig(pp=2, dp_shard=2, cp=2, ep=4, edp_shard=-1).resolve(8)
    assert (layout.stage_size, layout.dp, layout.edp_shard) == (4, 2, 1)
    assert group_ranks(layout, ("dp_replicate", "dp_shard", "cp"), ("cp",), 5) == [4, 5]
    assert group_ranks(layout, ("edp_replicate", "edp_shard", "ep"), ("ep",), 6) == [4, 5, 6, 7]
    assert ParallelConfig(pp=4, dp_shard=-1, ep=2, edp_shard=-1).resolve(8).dp_shard == 2


def test_default_spread_weighs_the_embedding_and_the_head_as_blocks():
    assert plan.stage_layers(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]  # 8 units / 4
    assert plan.stage_layers(6, 8) == [range(0, 0)] + [range(i, i + 1) for i in range(6)] + [range(6, 6)]
    assert [len(r) for r in plan.stage_layers(61, 16)] == [3] + [4] * 14 + [2]  # 63 units: 4 each, 15 extras
    assert [len(r) for r in plan.stage_layers(5, 2)] == [3, 2]  # 7 units: the extra one to stage 0 (middle first)
    assert plan.stage_layers(6, 2, (2, 4)) == [range(0, 2), range(2, 6)]


@pytest.mark.parametrize("schedule, stages", [("1f1b", [[0], [1]]), ("gpipe", [[0], [1]]),
                                              ("interleaved_1f1b", [[0, 2], [1, 3]]), ("zbv", [[0, 3], [1, 2]]),
                                              ("dualpipev", [[0, 3], [1, 2]])])
def test_rank_stages_loop_or_v(schedule, stages):
    layout = ParallelConfig(pp=2, pp_schedule=schedule).resolve(4)
    assert [plan.rank_stages(p, layout.pp_config) for p in range(2)] == stages


def test_reshard_after_forward_auto_is_false_under_pp():
    assert plan.reshard_after_forward(ParallelConfig()) is True
    assert plan.reshard_after_forward(ParallelConfig(pp=2)) is False
    assert plan.reshard_after_forward(ParallelConfig(pp=2, reshard_after_forward="true")) is True
    assert plan.reshard_after_forward(ParallelConfig(reshard_after_forward="false")) is False


def test_the_layout_printout_shows_the_stages():
    text = describe(_layout(*PP2, "--parallel.pp_schedule=zbv", "--training.grad_accum=4"), preset("debug", n_layers=6))
    assert "world size 8 = pp 2 x 4" in text
    assert "pipeline pp=2 (outermost), schedule zbv, 4 stages (2 per rank), FSDP reshard_after_forward=False" in text
    assert "pipeline rank 0: ranks [0..3]  stage 0: embedding + block 0; stage 3: block 5 + norm + head" in text
    assert "pipeline rank 1: ranks [4..7]  stage 1: blocks 1-2; stage 2: blocks 3-4" in text


REFUSED = [
    (["--parallel.pp=0"], r"^parallel.pp=0: must be >= 1"),
    (["--parallel.pp=3"], r"^parallel.pp=3 does not divide the world size 8$"),
    (["--parallel.pp=2", "--parallel.dp_replicate=1", "--parallel.dp_shard=8", "--parallel.cp=1", "--parallel.ep=1"],
     r"^dense layout .* = 8 ranks, but a pipeline stage has 4 ranks \(world size 8 / parallel.pp=2\)$"),
    (["--parallel.pp_layers=3,3"], r"^parallel.pp_layers=\[3, 3\] with parallel.pp=1: set parallel.pp > 1"),
    ([*PP2, "--training.grad_accum=1"],
     r"^training.grad_accum=1 micro-batches with parallel.pp_schedule='1f1b': it needs at least parallel.pp = 2$"),
    ([*PP2, "--parallel.pp_schedule=zbv", "--training.grad_accum=2"],
     r"^training.grad_accum=2 micro-batches with parallel.pp_schedule='zbv': it needs at least 2 x parallel.pp = 4$"),
    ([*PP2, "--parallel.pp_schedule=dualpipev", "--training.grad_accum=2"], r"it needs at least 2 x parallel.pp = 4$"),
    ([*PP2, "--parallel.pp_schedule=interleaved_1f1b", "--training.grad_accum=5", "--data.batch_size=20"],
     r"^training.grad_accum=5 with parallel.pp_schedule='interleaved_1f1b' and parallel.pp=2: it runs grad_accum "
     r"// pp = 2 rounds, which must divide grad_accum"),
    ([*PP2, "--parallel.pp_stages_per_rank=2", "--training.grad_accum=2"],
     r"^parallel.pp_stages_per_rank=2 with parallel.pp_schedule='1f1b': it runs 1 stage\(s\) per rank$"),
    ([*PP2, "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=1", "--training.grad_accum=2"],
     r"^parallel.pp_stages_per_rank=1 with parallel.pp_schedule='interleaved_1f1b': it needs >= 2 stages per rank"),
    ([*PP2, "--parallel.pp_layers=2,3", "--training.grad_accum=2"],
     r"^parallel.pp_layers=\[2, 3\] sums to 5, but model.n_layers=6$"),
    ([*PP2, "--parallel.pp_layers=6", "--training.grad_accum=2"],
     r"^parallel.pp_layers=\[6\]: 1 numbers, but parallel.pp=2 x 1 stages per rank = 2 stages$"),
    ([*PP2, "--parallel.pp_schedule=zbv", "--parallel.pp_layers=3,0,0,3", "--training.grad_accum=4"],
     r"^parallel.pp_layers=\[3, 0, 0, 3\]: stage\(s\) \[1, 2\] hold no block"),
    ([*PP2, "--parallel.pp=4", "--parallel.dp_shard=1", "--parallel.ep=2", "--parallel.pp_schedule=interleaved_1f1b",
      "--parallel.pp_stages_per_rank=4", "--training.grad_accum=4"],
     r"^parallel.pp=4 x 4 stages per rank = 16 stages for model.n_layers=6 \+ the embedding \+ the head = 8 units$"),
    # trap 1: zero-bubble schedules compute weight gradients after FSDP resharded the weights
    ([*PP2, "--parallel.pp_schedule=zbv", "--parallel.reshard_after_forward=true", "--training.grad_accum=4"],
     r"^parallel.reshard_after_forward='true' with parallel.pp_schedule='zbv': a zero-bubble schedule computes "
     r"weight gradients after FSDP resharded the weights \(wrong gradients, no error\); use 'auto' or 'false'$"),
    # trap 3: activation checkpointing's recompute under the zero-bubble weight pass
    ([*PP2, "--parallel.pp_schedule=dualpipev", "--training.activation_checkpoint=full", "--training.grad_accum=4"],
     r"^training.activation_checkpoint='full' with parallel.pp_schedule='dualpipev': .* use parallel.pp_schedule="
     r"'1f1b' or 'interleaved_1f1b', or training.activation_checkpoint='none'$"),
    ([*PP2, "--parallel.pp_schedule=zbv", "--training.compile=true", "--training.grad_accum=4"],
     r"^training.compile=true with parallel.pp_schedule='zbv': torch's zero-bubble schedules refuse compiled"),
    ([*PP2, "--training.grad_accum=2", "--training.grad_sync=last"],
     r"^training.grad_sync='last' with parallel.pp=2: the schedule reduces each stage's gradients once per step"),
]


@pytest.mark.parametrize("argv, message", REFUSED)
def test_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        _layout(*argv)
    assert "\n" not in str(error.value)


def test_post_training_and_document_masking_refused_under_pp():
    with pytest.raises(ConfigError, match=r"^parallel.pp=2 with post-training \(data.source='rollouts'\): not "):
        load_config(["--data.source=rollouts", "--data.path=r.jsonl", *PP2, "--training.grad_accum=2"]).layout(8)
    with pytest.raises(ConfigError, match=r"^parallel.pp=2 with data.document_mask=true: not composed yet"):
        _layout("--data.source=bin", "--data.path=t.bin", "--data.document_mask=true", *PP2, "--training.grad_accum=2")


def test_valid_pipelines_pass():
    for schedule, accum in (("1f1b", 2), ("gpipe", 2), ("interleaved_1f1b", 2), ("zbv", 4), ("dualpipev", 4)):
        layout = _layout(*PP2, f"--parallel.pp_schedule={schedule}", f"--training.grad_accum={accum}")
        assert plan.n_stages(layout.pp_config) == (2 if schedule in ("1f1b", "gpipe") else 4)
