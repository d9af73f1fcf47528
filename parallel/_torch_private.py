"""Every private torch API the parallel package uses, in one place, with the torch version each was
checked on (all: 2.13.0). No FSDP2 internal state is read or written anywhere in the package.

DeviceMesh (parallel/meshes.py): no public way (yet) to view one mesh as several differently shaped
meshes that share its ranks; torchtitan 0.3.0 uses the same calls (`unflatten`, `flatten`, `concatenate`).

Others: `fake_process_group`, `registered_backends` (parallel/fake_backend.py: the fake backend, which torch
registers only in torch.testing._internal), `foreach_norm` / `foreach_mul_` (parallel/gradients.py: one
kernel per list of tensors, as torch.nn.utils.clip_grad_norm_ does), `assert_async`
(parallel/context_parallel.py: a device-side assert without a host sync), `drop_backward_receive`
(parallel/pp/schedule.py: a forward-only pass of torch's pipeline runtime forgets the gradient receives it
posted, as a backward action would have).
"""

import torch
from torch.distributed.device_mesh import DeviceMesh


def unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """View the 1-D `mesh` as a mesh of `sizes` (innermost fastest); creates one group per axis."""
    return mesh._unflatten(0, sizes, names)


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One axis named `name` over all ranks of a (sub)mesh; creates one group."""
    return mesh._flatten(name)


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """Stack axes of views of the same root mesh into one mesh; creates no group."""
    return DeviceMesh._concatenate(meshes)


def fake_process_group(common_opts, backend_opts):
    """The fake backend's process group of one rank (torch.testing._internal.distributed.fake_pg's)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def registered_backends() -> list[str]:
    """Names of the process-group backends registered by plugins (dist.Backend._plugins)."""
    import torch.distributed as dist

    return list(dist.Backend._plugins)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch._foreach_norm(tensors)


def foreach_mul_(tensors: list[torch.Tensor], scalar) -> None:
    torch._foreach_mul_(tensors, scalar)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """A device-side assert: raises on the CPU, an asynchronous device error on a GPU (no host sync)."""
    torch._assert_async(condition, message)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (`torch._dynamo.utils.counters`, private; a
    recompile adds one). Checked on torch 2.13.0."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def drop_backward_receive(schedule, stage_index: int, mb_index: int) -> None:
    """Forget the (empty) gradient receive torch's pipeline runtime posted for this stage and micro-batch
    (`_PipelineScheduleRuntime.bwd_recv_ops`, an internal dict; checked on torch 2.13.0). Its backward actions
    pop it; a forward-only pass that skips them must, or the next pass fails with "Recv twice"."""
    schedule.bwd_recv_ops.pop((stage_index, mb_index), None)
