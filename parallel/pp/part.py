"""The unchanged model cut into pipeline stages that keep the whole model's parameter names.

A `ModelPart` holds some of a Transformer's modules under the names they have in the Transformer: the
token embedding (`tok_embeddings`, or None), blocks as `layers.<i>` with i the block's index in the whole
model (`Blocks`: iterates its blocks like the model's ModuleList), the final norm and output head (`norm`,
`output`, or None). So `named_parameters()`, the optimizer's state and DCP checkpoints key on the
single-process FQNs, and a checkpoint moves between any pp (and pp = 1) unchanged.

`split_stages(model, layout, pp_rank)` gives this rank's stages (one ModelPart per stage it runs, each a
forward of consecutive modules: tokens or hidden states in, hidden states or logits out) and `rank_part`,
one ModelPart over all of them: what the optimizer, the checkpoint, QK-clip and the router statistics
read. `rank_part`'s own forward is never called (its blocks need not be consecutive: stages 0 and 3 of a
V schedule). The modules are shared, not copied: parallelizing each stage (parallel/parallelize.py)
shards them for `rank_part` too.

Shape letters: B batch, S sequence, D model dim, V vocabulary.
"""

import dataclasses

import torch
from torch import nn

from models.model import Transformer, init_modules
from models.moe import Router
from parallel.pp.plan import n_stages, rank_stages, stage_layers


@dataclasses.dataclass(frozen=True)
class StageInputs:
    """What a stage reads besides its activations, the same for every micro-batch of a step (one value,
    not a tensor, so torch's schedule gives it to every micro-batch unchanged instead of cutting it)."""

    positions_S: torch.Tensor  # the RoPE positions of this rank's tokens (its cp chunks)


class Blocks(nn.Module):
    """Transformer blocks under their whole-model indices: children "i" (so FQNs read `layers.i.`); iterates
    over the blocks in increasing index, as the model's ModuleList does."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for index in sorted(blocks):
            self.add_module(str(index), blocks[index])

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def indices(self) -> list[int]:
        return [int(name) for name in self._modules]


class ModelPart(nn.Module):
    """Some of `model`'s modules under their whole-model names (module docstring)."""

    def __init__(self, model: Transformer, blocks: list[int], embedding: bool, head: bool):
        super().__init__()
        self.config = model.config
        self.tok_embeddings = model.tok_embeddings if embedding else None
        self.layers = Blocks({i: model.layers[i] for i in blocks})
        self.norm = model.norm if head else None
        self.output = model.output if head else None

    def forward(self, x: torch.Tensor, inputs: StageInputs) -> torch.Tensor:
        """A stage's forward: tokens_BS (with the embedding) or h_BSD in; h_BSD, or logits_BSV (with the head), out."""
        h_BSD = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h_BSD = layer(h_BSD, inputs.positions_S)
        return self.output(self.norm(h_BSD)) if self.output is not None else h_BSD

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, *, seed: int | None = None):
        """`Transformer.init_weights` on these modules: with `seed`, exactly the whole model's values."""
        init_modules(self, self.config, self.output, generator, seed)

    def routers(self) -> list[Router]:
        """The MoE routers of this part, in layer order."""
        return [m for m in self.modules() if isinstance(m, Router)]


def split_stages(model: Transformer, layout, pp_rank: int) -> tuple[ModelPart, list[ModelPart]]:
    """(rank_part, stages): this pipeline rank's stages of `model` (parallel/pp/plan.py), in stage order."""
    c = layout.pp_config
    stages = n_stages(c)
    layers = stage_layers(model.config.n_layers, stages, c.pp_layers)
    mine = rank_stages(pp_rank, c)
    parts = [ModelPart(model, list(layers[s]), s == 0, s == stages - 1) for s in mine]
    held = [i for s in mine for i in layers[s]]
    return ModelPart(model, held, 0 in mine, stages - 1 in mine), parts
