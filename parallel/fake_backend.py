"""torch's `fake` process-group backend: one process plays one rank of any world size; collectives
move no data (outputs keep whatever their buffers held). Used by launch/dry_run.py.

torch lists `dist.Backend.FAKE` but registers it only in torch.testing._internal.distributed.fake_pg
(private, needs test-only packages); these few lines do the same. Checked on torch 2.13:
`dist.Backend.register_backend(..., extended_api=True)` and `FakeProcessGroup._create_internal(rank,
size, options)`, `dist.Backend._plugins` (what is registered).
"""

import torch.distributed as dist


def _create(common_opts, backend_opts):
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def register_fake_backend() -> None:
    """Make `dist.init_process_group("fake", ...)` available (idempotent)."""
    if "FAKE" in dist.Backend._plugins:  # registered already (this module or torch's fake_pg)
        return
    dist.Backend.register_backend(dist.Backend.FAKE, _create, extended_api=True, devices=["cpu", "cuda"])
