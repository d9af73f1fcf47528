"""Our parameter names <-> the Hugging Face DeepSeek-V3 checkpoint keys, and the rotary row order.

  tok_embeddings.weight                  model.embed_tokens.weight
  layers.L.attention_norm / ffn_norm     model.layers.L.input_layernorm / post_attention_layernorm
  layers.L.attention.{wq, wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo}
                                         model.layers.L.self_attn.{q_proj, q_a_proj, q_a_layernorm, q_b_proj,
                                         kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
  layers.L.feed_forward.{w1, w2, w3}     model.layers.L.mlp.{gate_proj, down_proj, up_proj}   (dense layers)
  ...feed_forward.router.gate.weight     model.layers.L.mlp.gate.weight
  ...feed_forward.router.expert_bias     model.layers.L.mlp.gate.e_score_correction_bias
  ...feed_forward.experts.w13            model.layers.L.mlp.experts.E.gate_proj.weight, then ...up_proj.weight:
                                         our w13[E, :F] and w13[E, F:], one key pair per expert E
  ...feed_forward.experts.w2             model.layers.L.mlp.experts.E.down_proj.weight, one key per expert E,
                                         stacked on our dim 0
  ...feed_forward.shared_experts.*       model.layers.L.mlp.shared_experts.*
  norm.weight, output.weight             model.norm.weight, lm_head.weight

Rotary layout: DeepSeek checkpoints (config `rope_interleave`, the default) rotate interleaved pairs
(x0, x1), (x2, x3), ... of each head's rotary rows; our RoPE rotates halves (x_i, x_{i+R/2}). The
two agree exactly once the rotary output rows of the query and shared-key projections are
permuted (evens first, then odds): q.k is unchanged because q and k are permuted alike, and the
result equals transformers' interleaved form element for element. So the loader permutes those rows
and the exporter undoes it; the model itself has one RoPE.
"""

from dataclasses import dataclass

import torch

from models.config import ModelConfig

_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
NOT_LOADED = ("tokens_per_expert",)  # our buffers with no checkpoint counterpart (zeroed on load)


@dataclass(frozen=True)
class Source:
    """Where one of our tensors comes from. `key` has an `{e}` placeholder when `stacked` (one key per
    expert, stacked on our dim 0). `more_rows`: further `{e}` keys whose rows follow `key`'s on our
    dim 1, each with as many rows (w13 = gate_proj rows, then up_proj rows). `rope_rows` = (period,
    offset, width): in every block of `period` rows, rows [offset, offset + width) are rotary rows
    stored as interleaved pairs."""

    key: str
    stacked: bool = False
    rope_rows: tuple[int, int, int] | None = None
    more_rows: tuple[str, ...] = ()

    @property
    def row_keys(self) -> tuple[str, ...]:
        return (self.key, *self.more_rows)

    def keys(self, n_experts: int) -> list[str]:
        """Checkpoint keys in file order: per expert, each of its row keys."""
        if not self.stacked:
            return [self.key]
        return [key.format(e=e) for e in range(n_experts) for key in self.row_keys]

    def key_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one checkpoint key of our tensor of `shape`."""
        if not self.stacked:
            return shape
        return (shape[1] // len(self.row_keys), *shape[2:])


def hf_sources(model: torch.nn.Module, rope_interleave: bool) -> dict[str, Source]:
    """Our FQN -> Source for every parameter and loaded buffer of `model` (a Transformer, any placement)."""
    c: ModelConfig = model.config
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    out = {}
    for name in names:
        if name.rsplit(".", 1)[-1] not in NOT_LOADED:
            out[name] = _source(name, c, rope_interleave)
    return out


def _source(name: str, c: ModelConfig, rope_interleave: bool) -> Source:
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return Source(top[name])
    _, layer, module, rest = name.split(".", 3)
    prefix = f"model.layers.{layer}"
    if module == "attention_norm":
        return Source(f"{prefix}.input_layernorm.weight")
    if module == "ffn_norm":
        return Source(f"{prefix}.post_attention_layernorm.weight")
    if module == "attention":
        sub = rest.split(".")[0]
        return Source(f"{prefix}.self_attn.{_ATTENTION[sub]}.weight", rope_rows=_rope_rows(sub, c, rope_interleave))
    return _ffn_source(f"{prefix}.mlp", rest)


def _ffn_source(prefix: str, rest: str) -> Source:
    parts = rest.split(".")
    if parts[0] in _MLP:  # dense FeedForward
        return Source(f"{prefix}.{_MLP[parts[0]]}.weight")
    if parts[0] == "shared_experts":
        return Source(f"{prefix}.shared_experts.{_MLP[parts[1]]}.weight")
    if parts[0] == "experts" and parts[1] == "w13":
        return Source(prefix + ".experts.{e}.gate_proj.weight", stacked=True,
                      more_rows=(prefix + ".experts.{e}.up_proj.weight",))
    if parts[0] == "experts":
        return Source(prefix + ".experts.{e}." + f"{_MLP[parts[1]]}.weight", stacked=True)
    if rest == "router.gate.weight":
        return Source(f"{prefix}.gate.weight")
    if rest == "router.expert_bias":
        return Source(f"{prefix}.gate.e_score_correction_bias")
    raise KeyError(f"no Hugging Face key for feed-forward tensor {rest!r}")


def _rope_rows(sub: str, c: ModelConfig, rope_interleave: bool) -> tuple[int, int, int] | None:
    if not rope_interleave:
        return None
    if sub in ("wq", "wq_b"):
        return c.qk_head_dim, c.qk_nope_head_dim, c.qk_rope_head_dim
    if sub == "wkv_a":
        return c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim
    return None


def checkpoint_rows(rope_rows: tuple[int, int, int], rows: torch.Tensor) -> torch.Tensor:
    """Checkpoint row index of each of our row indices (int64 tensor -> same shape)."""
    period, offset, width = rope_rows
    block, j = rows // period, rows % period
    i = j - offset
    is_rope = (i >= 0) & (i < width)
    half = width // 2
    interleaved = torch.where(i < half, 2 * i, 2 * (i - half) + 1)
    return torch.where(is_rope, block * period + offset + interleaved, rows)


def our_rows(rope_rows: tuple[int, int, int], n_rows: int) -> torch.Tensor:
    """Inverse of `checkpoint_rows` over all n_rows: our row index of each checkpoint row."""
    forward = checkpoint_rows(rope_rows, torch.arange(n_rows))
    return torch.empty_like(forward).scatter_(0, forward, torch.arange(n_rows))
