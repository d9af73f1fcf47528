"""The region slot: how a module's own computation runs, declared by the model, filled by parallel/.

A `Region` is a module that parallel/ may compile or recompute as one piece (the transformer block, the
norms, the attention, the router, the routed and shared experts, the dense FFN). Its class writes its
computation in `body`; its `forward` runs it through `self.region`, a slot holding a runner:

    module(*args)  ->  FSDP2's hooks (if a unit)  ->  forward  ->  self.region(module, *args)  ->  body

The model's runner is `EAGER`: `body` as written, nothing compiled, nothing recomputed. parallel/
fills the slot once per concern, as it fills `MoE.dispatcher` (models/moe.py) and the attention's
`kv_source` (models/attention.py): parallel/compile.py puts a runner that calls the module's `body`
compiled, parallel/activation_checkpoint.py wraps the slot's runner in one that recomputes it in
backward. A runner is `runner(module, *args, **kwargs) -> the body's output`; it is not a module (no
parameters, no state dict entries), so parameter names and checkpoints are the same whatever runs.
"""

from torch import nn


class Eager:
    """The model's runner: the module's `body`, as written."""

    def __call__(self, module: nn.Module, *args, **kwargs):
        return module.body(*args, **kwargs)


EAGER = Eager()  # one shared runner: stateless, and compiled code that calls it sees the same object everywhere


class Region(nn.Module):
    """A module whose computation (`body`, written by the subclass) runs through the `region` slot."""

    def __init__(self):
        super().__init__()
        self.region = EAGER  # the runner (module docstring); parallel/ replaces it, the model never does

    def forward(self, *args, **kwargs):
        return self.region(self, *args, **kwargs)

    def body(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} writes its computation in `body`")
