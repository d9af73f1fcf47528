"""A key/value cache for incremental decoding (runtime/generate.py).

Per layer it keeps what the architecture needs to rebuild keys and values for every earlier position:
  MLA  the compressed latent c_kv [B, S, C] and the shared rotary key k_rope [B, S, 1, R] (after RoPE):
       (C + R) values per token instead of H * (qk + v); keys and values are re-expanded through
       wkv_b at each step (the non-absorbed form, as in training);
  GQA  keys (after RoPE) and values per kv head, [B, S, G, E] each, before the repeat to H heads.
plus the positions of the cached tokens. Appending concatenates along S (fine for the short rollouts
this is used for; a preallocated buffer would avoid the copies on GPU).

Post-training's teacher (runtime/posttrain/objective.py) fills a cache in one pass over a trajectory, through the
attention's own `kv_source` (`sources`: under context parallelism each layer's cache then holds the
whole sequence's gathered latents, not this rank's chunks), and reads prefixes of it back as the cached
part of new rows (`KVCache.rows`): one row per feedback item, or the items packed in one row, each
item's cached prefix just before its own tokens.
"""

import torch


class LayerCache:
    def __init__(self, source=None):
        """`source`: the attention's `kv_source` the new tokens pass through before they are cached
        (None: cached as they come)."""
        self.tensors: tuple[torch.Tensor, ...] | None = None
        self.positions_S: torch.Tensor | None = None
        self.source = source

    def extend(self, *new: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append the new tokens' tensors (dim 1 is S) and positions; returns (*all tensors, all positions)."""
        if self.source is not None:
            *new, positions_S = self.source(*new, positions_S=positions_S)
        if self.tensors is None:
            self.tensors, self.positions_S = new, positions_S
        else:
            self.tensors = tuple(torch.cat([old, n], dim=1) for old, n in zip(self.tensors, new))
            self.positions_S = torch.cat([self.positions_S, positions_S])
        return (*self.tensors, self.positions_S)


class KVCache:
    """One LayerCache per transformer block; pass as `model(tokens, positions, cache=cache)`."""

    def __init__(self, n_layers: int, sources: list | None = None):
        """`sources`: one `kv_source` per layer (see LayerCache), or None."""
        self.layers = [LayerCache(None if sources is None else sources[i]) for i in range(n_layers)]

    def rows(self, index_RT: torch.Tensor, positions_T: torch.Tensor | None = None) -> "KVCache":
        """A cache of R rows whose row r holds this cache's flat cached tokens (row * T_cached + position)
        `index_RT[r]`, at row positions `positions_T` (default 0..T-1); the new tokens of a forward take
        the positions it is given, and together they fill the row's positions 0..T+S-1 (the caller's
        attention mask decides which of them a query sees). Each layer's rows are gathered when that
        layer runs, so one layer's copy exists at a time."""
        out = KVCache(0)
        out.layers = [CachedRows(layer, index_RT, positions_T) for layer in self.layers]
        return out

    def next_position(self) -> int:
        positions = self.layers[0].positions_S
        return 0 if positions is None else int(positions[-1]) + 1


class CachedRows:
    """A layer's cache read as rows of its cached tokens (`KVCache.rows`); `extend` places the new tokens
    at their positions among them, for this forward only (nothing is kept)."""

    def __init__(self, layer: LayerCache, index_RT: torch.Tensor, positions_T: torch.Tensor | None = None):
        self.layer, self.index_RT = layer, index_RT
        if positions_T is None:
            positions_T = torch.arange(index_RT.shape[1], device=index_RT.device)
        self.positions_T = positions_T

    def extend(self, *new: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(*tensors [R, T + S, ...] in row order, positions 0..T+S-1): the cached tokens at `positions_T`,
        the new ones at `positions_S` (together every position once)."""
        R, T = self.index_RT.shape
        L = T + positions_S.shape[0]
        rows = []
        for cached, n in zip(self.layer.tensors, new):
            row = n.new_empty((R, L, *n.shape[2:]))
            row[:, self.positions_T] = cached.flatten(0, 1)[self.index_RT]
            row[:, positions_S] = n
            rows.append(row)
        return (*rows, torch.arange(L, device=positions_S.device))
