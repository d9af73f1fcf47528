"""A key/value cache for incremental decoding (runtime/generate.py).

Per layer it keeps what the architecture needs to rebuild keys and values for every earlier position:
  MLA  the compressed latent c_kv [B, S, C] and the shared rotary key k_rope [B, S, 1, R] (after RoPE):
       (C + R) values per token instead of H * (qk + v); keys and values are re-expanded through
       wkv_b at each step (the non-absorbed form, as in training);
  GQA  keys (after RoPE) and values per kv head, [B, S, G, E] each, before the repeat to H heads.
plus the positions of the cached tokens. Appending concatenates along S (fine for the short rollouts
this is used for; a preallocated buffer would avoid the copies on GPU).
"""

import torch


class LayerCache:
    def __init__(self):
        self.tensors: tuple[torch.Tensor, ...] | None = None
        self.positions_S: torch.Tensor | None = None

    def extend(self, *new: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append the new tokens' tensors (dim 1 is S) and positions; returns (*all tensors, all positions)."""
        if self.tensors is None:
            self.tensors, self.positions_S = new, positions_S
        else:
            self.tensors = tuple(torch.cat([old, n], dim=1) for old, n in zip(self.tensors, new))
            self.positions_S = torch.cat([self.positions_S, positions_S])
        return (*self.tensors, self.positions_S)


class KVCache:
    """One LayerCache per transformer block; pass as `model(tokens, positions, cache=cache)`."""

    def __init__(self, n_layers: int):
        self.layers = [LayerCache() for _ in range(n_layers)]

    def next_position(self) -> int:
        positions = self.layers[0].positions_S
        return 0 if positions is None else int(positions[-1]) + 1
