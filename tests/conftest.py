"""Import everything forked ranks need once, in the parent, so each fork starts warm; put the repository root
and tests/helpers/ on the path."""

import os
import sys

import torch
import torch._dynamo  # noqa: F401  (FSDP2 imports it lazily; importing in every child costs seconds)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401

# One intra-op thread: this suite runs on 2 cores, often with forked ranks; more threads oversubscribe
# them and made small tests ~50x slower.
torch.set_num_threads(1)

# the repository root (the packages) and tests/helpers/ (the shared fixtures: multirank, parity_cases, ...)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
