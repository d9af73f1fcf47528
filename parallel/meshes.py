"""The two device meshes: dense and expert layouts as views of one world mesh.

Rank -> coordinate mapping (innermost axis fastest, so cp and the inner expert axis stay inside a node):

    dense  (dp_replicate, dp_shard, cp):     rank = (r * dp_shard + s) * cp + c
    expert (edp_replicate, edp_shard, ep):   rank = (r * edp_shard + s) * ep + e    parallel.expert_inner = "ep"
                                             rank = (r * ep + e) * edp_shard + s    parallel.expert_inner = "edp_shard"

The expert mesh keeps its axis order (edp_replicate, edp_shard, ep) either way, so placements, FSDP
and the optimizer see the same mesh shape; only which ranks sit at each coordinate changes. With
expert_inner = "edp_shard", 64 ranks, edp_shard=8 x ep=8: edp_shard groups [0..7] [8..15] ... (one
node each, expert all-gathers and reduce-scatters on NVLink), ep groups [0 8 16 ... 56] (across nodes).

Example, 8 ranks, dense dp_shard=4 x cp=2, expert ep=8 (the headline layout):
    cp groups  [0 1] [2 3] [4 5] [6 7]   (one sequence per pair of ranks)
    ep group   [0 1 2 3 4 5 6 7]          (each ep all-to-all spans both cp halves of a sequence)

The data-parallel index of a rank (which slice of the global batch it reads) is
`r * dp_shard + s` on the dense mesh; the cp ranks of one sequence share it.

Process groups: one per axis of each mesh, plus the flattened dense FSDP shard axis
("dp_shard_cp", dp_shard and cp together). Building meshes is collective: every rank must call
`build_meshes` with the same layout.

Pipeline parallelism (pp > 1, parallel/pp/plan.py): the world is first viewed as (pp, stage), pp
outermost, and the dense and expert meshes above are views of this rank's `stage` axis (its S = world/pp
consecutive ranks), so the formulas above hold inside a stage with rank = p*S + (the formula). Two more
groups: `stage` (the S ranks of one stage: the step's stage-wide sums) and `pp` (the pp ranks that share
a coordinate inside their stages: activations point to point, the step's sums across stages). Example,
8 ranks, pp=2, dp_shard=2 x cp=2 | ep=4: stages [0 1 2 3] [4 5 6 7], pp groups [0 4] [1 5] [2 6] [3 7],
cp groups [0 1] [2 3] [4 5] [6 7], ep groups [0 1 2 3] [4 5 6 7].
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel import _torch_private
from parallel.layout import DENSE_AXES, EXPERT_AXES, Layout
from parallel.pp import plan as pp_plan


def numbering(layout: Layout, axes: tuple[str, ...]) -> tuple[str, ...]:
    """`axes` (DENSE_AXES or EXPERT_AXES) in rank-numbering order, outermost first."""
    return layout.expert_numbering if axes == EXPERT_AXES else axes


def strides(layout: Layout, axes: tuple[str, ...]) -> dict[str, int]:
    """{axis: rank distance between neighbouring coordinates on it}."""
    order = numbering(layout, axes)
    return {a: math.prod(getattr(layout, b) for b in order[i + 1:]) for i, a in enumerate(order)}


def coordinates(layout: Layout, axes: tuple[str, ...], rank: int) -> tuple[int, ...]:
    """Coordinates of `rank` on the mesh of `axes` (DENSE_AXES or EXPERT_AXES), in `axes` order."""
    step = strides(layout, axes)
    return tuple(rank // step[a] % getattr(layout, a) for a in axes)


def group_ranks(layout: Layout, axes: tuple[str, ...], group_axes: tuple[str, ...], rank: int) -> list[int]:
    """Ranks that share every coordinate with `rank` except those on `group_axes` (sorted), in its stage."""
    step, first = strides(layout, axes), rank - rank % layout.stage_size
    ranges = [range(getattr(layout, a)) if a in group_axes else [c]
              for a, c in zip(axes, coordinates(layout, axes, rank))]
    return sorted(first + sum(c * step[a] for a, c in zip(axes, combo)) for combo in itertools.product(*ranges))


def rank_mesh(layout: Layout, axes: tuple[str, ...]) -> np.ndarray:
    """Int array of shape [degree of each of `axes`]: the rank at each coordinate (a DeviceMesh's `.mesh`)
    of pipeline stage 0 (stage p adds p * layout.stage_size)."""
    order = numbering(layout, axes)
    ranks = np.arange(layout.stage_size).reshape([getattr(layout, a) for a in order])
    return ranks.transpose([order.index(a) for a in axes])


def describe(layout: Layout, model_config=None) -> str:
    """Readable multi-line description of both layouts (printed by the runtime at start-up)."""
    lines = [
        f"world size {layout.world_size}" + ("" if layout.pp == 1 else f" = pp {layout.pp} x {layout.stage_size}"),
        *pp_plan.describe_stages(layout.pp_config, layout.world_size,
                                 model_config.n_layers if model_config is not None else 0),
        f"dense  mesh dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard} x cp={layout.cp}"
        f"  (rank = (r*{layout.dp_shard} + s)*{layout.cp} + c)",
        f"expert mesh edp_replicate={layout.edp_replicate} x edp_shard={layout.edp_shard} x ep={layout.ep}"
        f"  ({_expert_formula(layout)}, expert_inner={layout.expert_inner})",
        "rank 0's groups:" if layout.pp == 1 else "rank 0's groups (stage p: add p x the stage size):",
    ]
    for name, axes, group_axes in (
        ("dense FSDP shard (dp_shard x cp)", DENSE_AXES, ("dp_shard", "cp")),
        ("dense replicate", DENSE_AXES, ("dp_replicate",)),
        ("cp", DENSE_AXES, ("cp",)),
        ("expert FSDP shard (edp_shard)", EXPERT_AXES, ("edp_shard",)),
        ("expert replicate", EXPERT_AXES, ("edp_replicate",)),
        ("ep", EXPERT_AXES, ("ep",)),
    ):
        lines.append(f"  {name:34s} {_short(group_ranks(layout, axes, group_axes, 0))}")
    if model_config is not None and model_config.n_routed_experts > 0:
        n = model_config.n_routed_experts
        dim = layout.expert_shard_dim(n)
        why = ("whole experts per rank" if dim == 0
               else f"{layout.local_experts(n)} local experts do not split evenly over edp_shard={layout.edp_shard}")
        lines.append(
            f"routed experts: {n} / ep={layout.ep} = {layout.local_experts(n)} per ep rank, "
            f"FSDP-sharded on tensor dim {dim} over edp_shard={layout.edp_shard} ({why})"
        )
    return "\n".join(lines)


def _expert_formula(layout: Layout) -> str:
    if layout.expert_inner == "ep":
        return f"rank = (r*{layout.edp_shard} + s)*{layout.ep} + e"
    return f"rank = (r*{layout.ep} + e)*{layout.edp_shard} + s"


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


@dataclass(frozen=True)
class Meshes:
    """Views of one world mesh; see the module docstring for the rank mapping."""

    world: DeviceMesh  # ("world",)
    dense: DeviceMesh  # ("dp_replicate", "dp_shard", "cp")
    expert: DeviceMesh  # ("edp_replicate", "edp_shard", "ep")
    dense_fsdp: DeviceMesh  # ("dp_replicate", "dp_shard_cp"): HSDP mesh of the dense weights
    expert_fsdp: DeviceMesh  # ("edp_replicate", "edp_shard"): HSDP mesh of the routed-expert weights
    ep: DeviceMesh  # ("ep",): expert-parallel all-to-all
    cp: DeviceMesh  # ("cp",): context-parallel K/V all-gather
    stage: DeviceMesh  # ("stage",): this rank's pipeline stage (the world itself when pp == 1)
    pp: DeviceMesh | None = None  # ("pp",): the ranks of this rank's coordinate in every stage; None when pp == 1

    def pp_rank(self) -> int:
        """This rank's pipeline rank (0 when pp == 1)."""
        return 0 if self.pp is None else self.pp.get_local_rank()

    def dp_rank(self) -> int:
        """Which of the `layout.dp` slices of the global batch this rank reads."""
        r, s, _ = self.dense.get_coordinate()
        return r * self.dense.size(1) + s

    def cp_rank(self) -> int:
        return self.dense.get_local_rank("cp")


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    """Collective: build the world mesh and its dense and expert views (default group = all ranks)."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks but {dist.get_world_size()} are running")
    world = init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("world",))
    pp, stage = None, world
    if layout.pp > 1:
        staged = _torch_private.unflatten(world, (layout.pp, layout.stage_size), ("pp", "stage"))
        pp, stage = staged["pp"], staged["stage"]
    dense = _torch_private.unflatten(stage, tuple(getattr(layout, a) for a in DENSE_AXES), DENSE_AXES)
    # dp_shard and cp shard the dense weights together (cp ranks hold the same weights).
    shard_cp = _torch_private.flatten(dense["dp_shard", "cp"], "dp_shard_cp")
    # The expert axes are unflattened in numbering order and restacked in EXPERT_AXES order.
    order = layout.expert_numbering
    numbered = _torch_private.unflatten(stage, tuple(getattr(layout, a) for a in order), order)
    expert = _torch_private.concatenate([numbered[a] for a in EXPERT_AXES])
    return Meshes(
        world=world,
        dense=dense,
        expert=expert,
        dense_fsdp=_torch_private.concatenate([dense["dp_replicate"], shard_cp]),
        expert_fsdp=_torch_private.concatenate([numbered["edp_replicate"], numbered["edp_shard"]]),
        ep=numbered["ep"],
        cp=dense["cp"],
        stage=stage,
        pp=pp,
    )

