"""Every private torch API the parallel package uses, in one place, with the torch version each was
checked on (all: 2.13.0).

DeviceMesh (parallel/meshes.py): no public way (yet) to view one mesh as several differently shaped
meshes that share its ranks; torchtitan 0.3.0 uses the same calls (`unflatten`, `flatten`, `concatenate`).

FSDP2 internals (parallel/ep_pairing.py, parallel/recompute_ahead.py): the two EP schedules that move a
forward or a recompute into a backward change FSDP2's per-unit training state, which has no public API:
  - a recompute ahead must enter the unit's pre-backward before the recompute's forward hooks run, so
    FSDP treats that forward as a recompute (no reshard after it). The public `unshard(async_op=True)`
    gathers the weights but leaves the state IDLE: the recompute's forward would then reshard after
    itself and the gradient's arrival would gather the unit again (`run_pre_backward`);
  - a paired forward of a unit that already finished its backward must see it IDLE, not PRE_BACKWARD
    (`reset_finished_unit`); FSDP2 only resets states in its end-of-backward callback.
`check_fsdp_unit_states` probes, at parallelize time, that the states and methods these rely on are
there as checked; if not, the knob is refused in one line naming the torch version.

Autograd / modes (parallel/ep_pairing.py): the paired forward runs in a second thread, which must run
under the caller's torch function and dispatch modes (`current_modes`) and finish inside the backward
before FSDP's end-of-backward callback (`queue_backward_callback`).

Others: `fake_process_group`, `registered_backends` (parallel/fake_backend.py: the fake backend, which torch
registers only in torch.testing._internal), `foreach_norm` / `foreach_mul_` (parallel/gradients.py: one
kernel per list of tensors, as torch.nn.utils.clip_grad_norm_ does), `assert_async`
(parallel/context_parallel.py: a device-side assert without a host sync).
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

CHECKED_TORCH_VERSION = "2.13.0"
FSDP_STATES = ("FORWARD", "PRE_BACKWARD", "POST_BACKWARD", "IDLE")


def unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """View the 1-D `mesh` as a mesh of `sizes` (innermost fastest); creates one group per axis."""
    return mesh._unflatten(0, sizes, names)


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One axis named `name` over all ranks of a (sub)mesh; creates one group."""
    return mesh._flatten(name)


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """Stack axes of views of the same root mesh into one mesh; creates no group."""
    return DeviceMesh._concatenate(meshes)


def run_pre_backward(unit) -> None:
    """What the arrival of `unit`'s output gradient runs first: state PRE_BACKWARD, unshard, backward
    prefetch (FSDPState._pre_backward)."""
    unit._get_fsdp_state()._pre_backward(None)


def reset_finished_unit(unit) -> None:
    """If `unit` finished its backward (state PRE_BACKWARD, every parameter group POST_BACKWARD), make it
    and its groups IDLE, as FSDP2's end-of-backward callback would."""
    state = unit._get_fsdp_state()
    groups = state._fsdp_param_groups
    if state._training_state.name == "PRE_BACKWARD" and all(g._training_state.name == "POST_BACKWARD"
                                                            for g in groups):
        idle = type(state._training_state).IDLE
        state._training_state = idle
        for group in groups:
            group._training_state = idle


def check_fsdp_unit_states(key: str, unit=None) -> None:
    """ValueError (one line naming parallel.`key` and the torch version) unless FSDP2 has what
    `run_pre_backward` and `reset_finished_unit` rely on: a training state enum with FSDP_STATES, a
    `_pre_backward(grad)` on its state class, and on `unit` (a fully_shard module, when given) a state
    whose `_training_state` and parameter groups' `_training_state` are such enum values."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        missing = [s for s in FSDP_STATES if s not in TrainingState.__members__]
        missing += [] if callable(getattr(FSDPState, "_pre_backward", None)) else ["FSDPState._pre_backward"]
        if unit is not None:
            state = unit._get_fsdp_state()
            states = [state._training_state] + [g._training_state for g in state._fsdp_param_groups]
            missing += [f"{type(s).__name__} state" for s in states if not isinstance(s, TrainingState)]
    except (ImportError, AttributeError) as e:
        missing = [str(e)]
    if missing:
        raise ValueError(f"parallel.{key}: FSDP2 internals it relies on differ in torch {torch.__version__} "
                         f"(checked on {CHECKED_TORCH_VERSION}; missing: {', '.join(missing)}); turn it off")


def current_modes() -> list:
    """The torch function modes, then the dispatch modes, active on this thread (outermost first)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()]


def queue_backward_callback(callback) -> None:
    """Run `callback()` at the end of the running backward (before callbacks queued later)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(callback)


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
