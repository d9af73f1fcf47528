"""Layout resolution and validation, rank mapping and balanced cp positions (no process group)."""

import pytest
import torch

from models import preset
from parallel.context_parallel import load_balanced_positions
from parallel.layout import DENSE_AXES, EXPERT_AXES, Layout, ParallelConfig
from parallel.meshes import coordinates, describe, group_ranks, rank_mesh

DEBUG = preset("debug")  # 8 routed experts, dim 64, moe_inter_dim 32, max_seq_len 256


def test_resolve_infers_one_degree_per_layout():
    layout = ParallelConfig(dp_replicate=2, cp=2, ep=4, edp_shard=-1).resolve(16)
    assert (layout.dp_replicate, layout.dp_shard, layout.cp) == (2, 4, 2)
    assert (layout.edp_replicate, layout.edp_shard, layout.ep) == (1, 4, 4)
    assert layout.dp == 8 and layout.dense_shard == 8
    assert ParallelConfig().resolve(8) == Layout(
        world_size=8, dp_replicate=1, dp_shard=8, cp=1, ep=1, edp_replicate=1, edp_shard=8
    )


@pytest.mark.parametrize(
    "config, world, message",
    [
        (ParallelConfig(dp_shard=3), 8,
         r"dense layout parallel.dp_replicate=1 x parallel.dp_shard=3 x parallel.cp=1 = 3 ranks, but the world size is 8"),
        (ParallelConfig(ep=4, edp_shard=4), 8,
         r"expert layout parallel.edp_replicate=1 x parallel.edp_shard=4 x parallel.ep=4 = 16 ranks, but the world size is 8"),
        (ParallelConfig(dp_replicate=-1, dp_shard=-1), 8,
         r"dense layout .*at most one degree may be -1.*\['dp_replicate', 'dp_shard'\]"),
        (ParallelConfig(edp_replicate=-1), 8,
         r"expert layout .*at most one degree may be -1.*\['edp_replicate', 'edp_shard'\]"),
        (ParallelConfig(cp=0), 8, r"parallel.cp=0: degrees must be positive or -1"),
        (ParallelConfig(ep=-2), 8, r"parallel.ep=-2: degrees must be positive or -1"),
        (ParallelConfig(cp=3), 8, r"dense layout .*cp=3: world size 8 is not divisible by 3, cannot infer dp_shard"),
        (ParallelConfig(ep=3), 8, r"expert layout .*ep=3: world size 8 is not divisible by 3, cannot infer edp_shard"),
        (ParallelConfig(), 0, r"world size must be positive, got 0"),
        (ParallelConfig(expert_inner="cp"), 8, r"parallel.expert_inner='cp': must be one of 'ep', 'edp_shard'"),
    ],
)
def test_resolve_errors_name_fields_and_numbers(config, world, message):
    with pytest.raises(ValueError, match=message):
        config.resolve(world)


def _layout(world=8, **degrees) -> Layout:
    return ParallelConfig(**degrees).resolve(world)


@pytest.mark.parametrize(
    "layout, model, seq_len, batch, message",
    [
        (_layout(ep=8, edp_shard=1), preset("debug", n_routed_experts=12), 64, 8,
         r"parallel.ep=8 does not divide model.n_routed_experts=12"),
        (_layout(ep=2), preset("debug", n_dense_layers=3), 64, 8,
         r"parallel.ep=2 but the model has no routed experts \(n_routed_experts=8, n_layers=3, n_dense_layers=3\)"),
        (_layout(dp_shard=4, cp=2), DEBUG, 34, 8, r"seq_len=34 is not divisible by 2\*cp=4"),
        (_layout(), DEBUG, 512, 8, r"seq_len=512 exceeds model.max_seq_len=256"),
        (_layout(dp_replicate=2, dp_shard=4), DEBUG, 64, 12,
         r"global_batch=12 is not divisible by dp_replicate=2 x dp_shard=4 = 8 data-parallel ranks"),
        (_layout(world=64, ep=1), DEBUG, 64, 64,
         r"model.moe_inter_dim=32 is not divisible by parallel.edp_shard=64 .*8/1 = 8 do not split evenly over edp_shard"),
        (Layout(world_size=8, dp_replicate=1, dp_shard=4, cp=1, ep=1, edp_replicate=1, edp_shard=8), DEBUG, 64, 8,
         r"dense layout dp_replicate=1 x dp_shard=4 x cp=1 = 4 ranks, but the world size is 8"),
        (Layout(world_size=8, dp_replicate=1, dp_shard=8, cp=1, ep=0, edp_replicate=1, edp_shard=8), DEBUG, 64, 8,
         r"parallel.ep=0: degrees must be positive"),
        (Layout(world_size=8, dp_replicate=1, dp_shard=8, cp=1, ep=2, edp_replicate=1, edp_shard=4,
                expert_inner="edp_replicate"), DEBUG, 64, 8,
         r"parallel.expert_inner='edp_replicate': must be one of 'ep', 'edp_shard'"),
    ],
)
def test_validate_errors_name_fields_and_numbers(layout, model, seq_len, batch, message):
    with pytest.raises(ValueError, match=message):
        layout.validate(model, seq_len, batch)


def test_valid_layouts_pass():
    _layout(dp_shard=4, cp=2, ep=8, edp_shard=1).validate(DEBUG, 64, 8)
    _layout(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4).validate(preset("debug_gqa"), 32, 4)
    _layout(ep=1).validate(preset("debug", n_dense_layers=3), 64, 8)  # dense model without ep: fine


def test_expert_shard_dim_switches_to_a_matrix_dim_when_experts_run_out():
    assert _layout(ep=2, edp_shard=4).expert_shard_dim(8) == 0  # 4 local experts, 4 ranks: 1 each
    assert _layout(ep=2, edp_shard=4).expert_shard_dim(4) == 1  # 2 local experts, 4 ranks
    assert _layout(ep=1, edp_shard=8).expert_shard_dim(12) == 1  # 12 experts over 8 ranks: uneven
    assert "tensor dim 1" in describe(_layout(ep=2, edp_shard=4), preset("debug", n_routed_experts=4))


def test_rank_mapping_is_innermost_fastest():
    layout = _layout(world=64, dp_replicate=2, dp_shard=8, cp=4, edp_replicate=2, edp_shard=2, ep=16)
    for rank in range(64):
        r, s, c = coordinates(layout, DENSE_AXES, rank)
        assert rank == (r * 8 + s) * 4 + c
        r, s, e = coordinates(layout, EXPERT_AXES, rank)
        assert rank == (r * 2 + s) * 16 + e
    assert group_ranks(layout, DENSE_AXES, ("cp",), 5) == [4, 5, 6, 7]
    assert group_ranks(layout, DENSE_AXES, ("dp_replicate",), 5) == [5, 37]
    assert group_ranks(layout, DENSE_AXES, ("dp_shard", "cp"), 33) == list(range(32, 64))
    assert group_ranks(layout, EXPERT_AXES, ("ep",), 17) == list(range(16, 32))
    assert group_ranks(layout, EXPERT_AXES, ("edp_shard",), 1) == [1, 17]


def test_edp_shard_inner_numbers_the_expert_fsdp_group_on_consecutive_ranks():
    """256 ranks (32 nodes of 8), the recommended Kimi K2 expert layout edp_shard=2 x ep=128: the
    expert FSDP pair sits on one node, the ep group takes every second rank across all nodes."""
    layout = _layout(world=256, dp_replicate=32, dp_shard=8, edp_shard=2, ep=128, expert_inner="edp_shard")
    for rank in range(256):
        r, s, e = coordinates(layout, EXPERT_AXES, rank)
        assert rank == (r * 128 + e) * 2 + s
        assert rank_mesh(layout, EXPERT_AXES)[r, s, e] == rank
        assert coordinates(layout, DENSE_AXES, rank) == coordinates(_layout(world=256, dp_replicate=32, dp_shard=8,
                                                                            ep=128), DENSE_AXES, rank)
    assert group_ranks(layout, EXPERT_AXES, ("edp_shard",), 5) == [4, 5]
    assert group_ranks(layout, EXPERT_AXES, ("ep",), 5) == list(range(1, 256, 2))
    wide = _layout(world=256, dp_replicate=32, dp_shard=8, edp_shard=2, ep=128)
    assert group_ranks(wide, EXPERT_AXES, ("edp_shard",), 5) == [5, 133]  # the default strides across nodes
    hsdp = _layout(world=16, edp_replicate=2, edp_shard=2, ep=4, expert_inner="edp_shard")
    assert group_ranks(hsdp, EXPERT_AXES, ("edp_replicate",), 3) == [3, 11]  # edp_replicate stays outermost
    assert group_ranks(hsdp, EXPERT_AXES, ("ep",), 3) == [1, 3, 5, 7]
    assert rank_mesh(hsdp, EXPERT_AXES).tolist() == [[[0, 2, 4, 6], [1, 3, 5, 7]], [[8, 10, 12, 14], [9, 11, 13, 15]]]
    assert rank_mesh(wide, EXPERT_AXES).tolist() == torch.arange(256).reshape(1, 2, 128).tolist()


def test_describe_shows_both_layouts():
    text = describe(_layout(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4), DEBUG)
    assert "dense  mesh dp_replicate=2 x dp_shard=2 x cp=2" in text
    assert "expert mesh edp_replicate=1 x edp_shard=2 x ep=4" in text
    assert "cp                                 [0, 1]" in text
    assert "ep                                 [0, 1, 2, 3]" in text
    assert "8 / ep=4 = 2 per ep rank, FSDP-sharded on tensor dim 0" in text
    assert "(rank = (r*2 + s)*4 + e, expert_inner=ep)" in text
    text = describe(_layout(dp_replicate=2, dp_shard=2, cp=2, edp_shard=2, ep=4, expert_inner="edp_shard"), DEBUG)
    assert "(rank = (r*4 + e)*2 + s, expert_inner=edp_shard)" in text
    assert "ep                                 [0, 2, 4, 6]" in text
    assert "expert FSDP shard (edp_shard)      [0, 1]" in text


@pytest.mark.parametrize("seq_len, cp", [(16, 1), (16, 2), (48, 4)])
def test_load_balanced_positions_cover_the_sequence_with_equal_causal_work(seq_len, cp):
    parts = [load_balanced_positions(seq_len, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq_len))
    for part in parts:
        assert part.dtype == torch.int64 and bool((part[1:] > part[:-1]).all())
    work = {int((part + 1).sum()) for part in parts}  # keys seen by the rank's queries (causal)
    assert len(work) == 1
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_load_balanced_positions_errors():
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 2\*cp=4"):
        load_balanced_positions(10, 2, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 is outside \[0, cp=2\)"):
        load_balanced_positions(16, 2, 2)
