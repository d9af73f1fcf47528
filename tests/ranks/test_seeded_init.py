"""Seeded init: the same global weights for 1, 4 and 8 ranks and every layout, each rank drawing
only the row blocks of its own shard; the stream is the documented one (an outside loop over blocks)."""

import pytest
import torch

from models import Transformer, preset
from models.seeded_init import normal_box
from multirank import run_ranks
from parallel.layout import ParallelConfig
from parallel.meshes import build_meshes
from parallel.parallelize import parallelize
from parity_cases import CASES, _shard_like
from plain_references import stream_reference

LAYOUTS_4 = {
    "fsdp4": ("debug", {}, ParallelConfig(dp_shard=4, ep=1)),
    "cp2_ep4": ("debug", {}, ParallelConfig(dp_shard=2, cp=2, ep=4, edp_shard=1)),
    "hsdp_ep2_ehsdp": ("debug_gqa", {}, ParallelConfig(dp_replicate=2, dp_shard=2, edp_replicate=2, ep=2)),
    "few_local_experts": ("debug", {"n_routed_experts": 4}, ParallelConfig(dp_shard=4, ep=2, edp_shard=2)),
}


def _distinct(cases) -> dict:
    """tests/ranks/test_parallel_parity.py's cases as {name: (preset, overrides, layout)}, each distinct triple once
    (the init does not see routing: empty_experts_cp2_ep8 is headline_cp2_ep8's)."""
    out = {}
    for name, (preset_name, overrides, layout, _) in cases.items():
        if (preset_name, overrides, layout) not in out.values():
            out[name] = (preset_name, overrides, layout)
    return out


LAYOUTS_8 = _distinct(CASES)


@pytest.mark.parametrize("full_shape", [(5, 300, 700), (1000, 64), (3, 20000), (70000,), (7, 9, 5), (33, 3)])
def test_boxes_follow_the_documented_stream(full_shape):
    full = stream_reference(full_shape, 0.5, 7, "w")
    box_shape = tuple(max(1, s // 3) for s in full_shape)
    offset = tuple(s // 2 for s in full_shape)
    box = normal_box(full_shape, box_shape, offset, 0.5, 7, "w")
    expected = full[tuple(slice(o, o + s) for o, s in zip(offset, box_shape))]
    assert torch.equal(box.view(expected.shape), expected)
    assert torch.equal(normal_box(full_shape, full_shape, (0,) * len(full_shape), 0.5, 7, "w").view(full_shape), full)


def _full_models(layouts) -> dict:
    out = {}
    for name, (preset_name, overrides, _) in layouts.items():
        model = Transformer(preset(preset_name, **overrides))
        model.init_weights(seed=3)
        out[name] = {k: p.detach() for k, p in model.named_parameters()}
    return out


def _sharded_init(rank, world_size, layouts, references):
    mismatches = []
    for name, (preset_name, overrides, config) in layouts.items():
        with torch.device("meta"):
            model = Transformer(preset(preset_name, **overrides))
        layout = config.resolve(world_size)
        parallelize(model, build_meshes(layout, "cpu"), layout)
        model.to_empty(device="cpu")
        model.init_weights(seed=3)
        for fqn, p in model.named_parameters():
            if not torch.equal(p.to_local(), _shard_like(references[name][fqn], p)):
                mismatches.append((name, fqn))
    return mismatches


@pytest.mark.parametrize("world, layouts", [(4, LAYOUTS_4), (8, LAYOUTS_8)])
def test_every_layout_gets_the_single_process_weights(world, layouts):
    references = _full_models(layouts)  # the 1-process seeded init
    assert run_ranks(_sharded_init, world, layouts, references, timeout=300) == [[]] * world
