"""Every private torch API the parallel package uses, in one place.

Checked on torch 2.13.0. DeviceMesh has no public way (yet) to view one mesh as several
differently shaped meshes that share its ranks; torchtitan 0.3.0 uses the same calls.
"""

from torch.distributed.device_mesh import DeviceMesh

CHECKED_TORCH_VERSION = "2.13.0"


def unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """View the 1-D `mesh` as a mesh of `sizes` (innermost fastest); creates one group per axis."""
    return mesh._unflatten(0, sizes, names)


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One axis named `name` over all ranks of a (sub)mesh; creates one group."""
    return mesh._flatten(name)


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """Stack axes of views of the same root mesh into one mesh; creates no group."""
    return DeviceMesh._concatenate(meshes)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (`torch._dynamo.utils.counters`, private; a
    recompile adds one). Checked on torch 2.13.0."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
