"""The decoder: token embedding -> n_layers pre-norm blocks -> RMSNorm -> untied output head.

Blocks [0, n_dense_layers) use a dense FeedForward, the rest an MoE. Building and initializing are
separate so a large model can be built without memory and materialized where it will live:

    with torch.device("meta"):
        model = Transformer(config)          # no storage
    ...apply parallelism (fully_shard etc.)...
    model.to_empty(device="cuda")            # storage, uninitialized (buffers too)
    model.init_weights(seed=0)               # every parameter and buffer set, same for any sharding

Shape letters: B batch, S sequence, D model dim, V vocabulary.
"""

import torch
from torch import nn

from models import seeded_init
from models.attention import build_attention
from models.config import ModelConfig
from models.experts import GroupedExperts
from models.kv_cache import KVCache
from models.layers import FeedForward, RMSNorm
from models.moe import MoE, Router
from models.output_head import LossPart, OutputHead
from models.region import Region


class TransformerBlock(Region):
    """x + attention(attention_norm(x)), then + feed_forward(ffn_norm(x))."""

    def __init__(self, c: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = build_attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = MoE(c) if c.is_moe_layer(layer_id) else FeedForward(c.dim, c.inter_dim)

    def body(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        attention_in_BSD = self.attention_norm(x_BSD)
        if documents is not None and cache is not None:  # a cached prefix, per-row masks and RoPE (post-training)
            x_BSD = x_BSD + self.attention(attention_in_BSD, positions_S, cache=cache, documents=documents)
        elif documents is not None:
            x_BSD = x_BSD + self.attention(attention_in_BSD, positions_S, documents=documents)
        elif cache is None:
            x_BSD = x_BSD + self.attention(attention_in_BSD, positions_S)
        else:
            x_BSD = x_BSD + self.attention(attention_in_BSD, positions_S, cache=cache)
        return x_BSD + self.feed_forward(self.ffn_norm(x_BSD))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = OutputHead(config.dim, config.vocab_size)

    def forward(self, tokens_BS: torch.Tensor, positions_S: torch.Tensor | None = None,
                cache: KVCache | None = None, documents=None, head: bool = True) -> torch.Tensor:
        """tokens_BS (int64) -> logits_BSV.

        positions_S: global RoPE positions of the S tokens (default arange(S)); context parallelism
        passes the global positions of its local chunks. They must be strictly increasing: the
        attention uses that to pick the fused causal kernel (checked here without a host sync: an
        asynchronous device assert on a GPU, a ValueError on the CPU).
        cache: decoding (runtime/generate.py): the tokens attend to the cached ones too, and are appended.
        documents: packed documents (data.document_mask; models/document_attention.Documents): attention
        stays within each document and RoPE positions restart at each. With a cache too (post-training's
        teacher, runtime/posttrain/objective.py): `doc_BL` covers cached + new tokens, so each row sees its own
        cached keys, and `rope_BS` gives each row's RoPE positions.
        head=False: the last block's hidden states [B, S, D] instead of logits (a pass that only fills a cache).
        """
        S = tokens_BS.shape[1]
        if positions_S is None:
            positions_S = torch.arange(S, device=tokens_BS.device)
        else:
            _check_positions(positions_S, S)
        h_BSD = self.tok_embeddings(tokens_BS)
        for i, layer in enumerate(self.layers):
            if documents is not None:
                h_BSD = (layer(h_BSD, positions_S, documents=documents) if cache is None
                         else layer(h_BSD, positions_S, cache=cache.layers[i], documents=documents))
            else:
                h_BSD = layer(h_BSD, positions_S) if cache is None else layer(h_BSD, positions_S, cache=cache.layers[i])
        return self.output(self.norm(h_BSD)) if head else h_BSD

    def head_losses(self, h_BSD: torch.Tensor, parts: list[LossPart], chunk: int) -> torch.Tensor:
        """The final norm, then losses over the head's logits in token chunks (models/output_head.py): the
        parts' sums [K]. h_BSD: `forward(..., head=False)`; each part's `index_n` indexes its B*S positions."""
        return self.output(self.norm(h_BSD).flatten(0, 1), parts, chunk)

    def logits_at(self, h_BSD: torch.Tensor, flat_n: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of the B*S positions `flat_n` only (the norm is per position)."""
        return self.output(self.norm(h_BSD.flatten(0, 1)[flat_n]))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, *, seed: int | None = None):
        """Deterministic initialization of every parameter and buffer, in place (works after `to_empty`).

        Matrices (linear weights, embeddings, stacked experts): normal(0, init_std). Norm weights:
        1. Output head: normal(0, dim**-0.5), so initial logits have unit scale for any width.
        Router buffers (expert_bias, tokens_per_expert): 0.
        Random source, by precedence:
          seed       layout-independent (models/seeded_init.py): the same global weights for a full
                     model or any DTensor sharding of it, on any device. Use this for training.
          generator  drawn in `named_modules()` order (generator on the parameters' device), so the
                     same generator state gives the same unsharded model; cheap, for tests.
          neither    the default RNG (DTensor parameters use DTensor's own RNG).
        """
        init_modules(self, self.config, self.output, generator, seed)

    def routers(self) -> list[Router]:
        """The MoE routers, in layer order (for `update_expert_bias` and load metrics)."""
        return [m for m in self.modules() if isinstance(m, Router)]


@torch.no_grad()
def init_modules(model: nn.Module, config: ModelConfig, output: nn.Module | None, generator=None, seed=None) -> None:
    """`Transformer.init_weights` on `model` (a Transformer, or a part of one under its whole-model names:
    parallel/pp/part.py), `output` its output head if it holds it. Every draw is keyed by the whole-model
    name under `seed`, so a part gets exactly the values the whole model would."""
    draw = _normal_drawer(generator, seed)
    std = config.init_std
    for prefix, module in model.named_modules():
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            out_std = config.dim**-0.5 if module is output else std
            draw(module.weight, out_std, f"{prefix}.weight")
        elif isinstance(module, GroupedExperts):
            for name, param, rows in module.init_streams():
                draw(param, std, f"{prefix}.{name}", rows)
        elif isinstance(module, Router):
            module.expert_bias.zero_()
            module.tokens_per_expert.zero_()


def _normal_drawer(generator: torch.Generator | None, seed: int | None):
    """fn(param, std, fqn, rows=None) filling param (or its rows [lo, hi) of dim 1) with normal(0, std)
    from the chosen random source."""
    if seed is not None:
        return lambda param, std, fqn, rows=None: seeded_init.normal_(param, std, seed, fqn, rows=rows)

    def draw(param, std, fqn, rows=None):
        part = param if rows is None else param.narrow(1, rows[0], rows[1] - rows[0])
        nn.init.normal_(part, 0.0, std, generator=generator)

    return draw


def _check_positions(positions_S: torch.Tensor, S: int):
    if positions_S.shape != (S,) or positions_S.is_floating_point():
        raise ValueError(
            f"positions_S must be an integer tensor of shape ({S},), got {tuple(positions_S.shape)} "
            f"{positions_S.dtype}"
        )
    if S == 1:
        return
    message = "positions_S must be strictly increasing"
    try:  # queued on the stream on CUDA (the host never waits); raises at once on the CPU
        torch._assert_async((positions_S[1:] > positions_S[:-1]).all(), message)
    except RuntimeError as e:
        raise ValueError(f"{message}, got {positions_S.tolist()[:16]}...") from e
