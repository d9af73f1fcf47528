"""torch's `fake` process-group backend: one process plays one rank of any world size; collectives
move no data (outputs keep whatever their buffers held). Used by launch/dry_run.py.

torch lists `dist.Backend.FAKE` but registers it only in torch.testing._internal.distributed.fake_pg
(private, needs test-only packages); these few lines do the same with the public
`dist.Backend.register_backend(..., extended_api=True)` and two private calls (parallel/_torch_private.py).
"""

import torch.distributed as dist

from parallel import _torch_private


def register_fake_backend() -> None:
    """Make `dist.init_process_group("fake", ...)` available (idempotent)."""
    if "FAKE" in _torch_private.registered_backends():  # registered already (this module or torch's fake_pg)
        return
    dist.Backend.register_backend(dist.Backend.FAKE, _torch_private.fake_process_group, extended_api=True, devices=["cpu", "cuda"])
