"""One way to build a test's model: `seeded_model(preset, seed, **overrides)`, a Transformer whose weights are a
function of the seed alone.

Where the weights come from (`init`, models/model.py `init_weights`):
  "seed"       the layout-independent stream of models/seeded_init.py, what training uses (the default)
  "generator"  a torch.Generator seeded with `seed`, drawn in `named_modules()` order
  "default"    torch's default RNG, seeded with `seed` before the model is built
Each test keeps the source its figures were measured with. torch's default RNG is seeded with `seed` in
every case, so what a test draws from it next is seeded too.
"""

import dataclasses

import torch

from models import ModelConfig, Transformer, preset

INITS = ("seed", "generator", "default")


def seeded_model(name: str | ModelConfig = "debug", seed: int = 0, *, init: str = "seed", **overrides) -> Transformer:
    """The preset `name` (or a ModelConfig) with `overrides`, initialized from `seed` by `init` (above)."""
    assert init in INITS, init
    torch.manual_seed(seed)
    config = preset(name, **overrides) if isinstance(name, str) else dataclasses.replace(name, **overrides)
    model = Transformer(config)
    if init == "seed":
        model.init_weights(seed=seed)
    elif init == "generator":
        model.init_weights(torch.Generator().manual_seed(seed))
    else:
        model.init_weights()
    return model
