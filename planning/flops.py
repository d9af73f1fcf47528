"""Forward FLOPs per token of each transformer block, by part: what activation checkpointing reruns
(parallel/activation_checkpoint.py), for planning/dual_mesh.py and planning/step.py.

The convention of runtime.metrics.flops_per_token (6 per active matmul parameter, causal attention
3 S (qk + v) per layer and head), split forward 1/3 : backward 2/3: a forward is 2 per active
parameter and S (qk + v) per head for the SDPA. For attention the 1/3 is a convention too (a flash
backward recomputes the scores, ~2.5x the forward), kept so that forward + backward = the model FLOPs.
Parameters are counted on the model built on the meta device (the same count as models.count_params):
  norms      attention_norm + ffn_norm
  attention  the projections (and MLA's latent norms): `block.attention`'s parameters
  sdpa       scores and weighted sum, S/2 keys per query on average
  router     the gate (MoE blocks)
  routed     K of the E routed experts (MoE blocks: `GroupedExperts`)
  shared     the shared experts (MoE blocks)
  ffn        the dense FFN (dense blocks)
Outside the blocks: the output head (vocab x dim) and the final norm; the embedding is a lookup.
"""

import functools

import torch

# the compute rate (kernel class) of each part: planning/parameters.py fits one efficiency per class
RATE = {"norms": "matmul_bf16", "attention": "matmul_bf16", "sdpa": "attention_bf16", "router": "matmul_bf16",
        "routed": "grouped_mm_bf16", "shared": "matmul_bf16", "ffn": "matmul_bf16"}  # compute rate of each part
# what each mode reruns in backward (parallel/activation_checkpoint.checkpoint_regions): full, every block;
# selective, `block.attention` (projections + SDPA) and every GroupedExperts (the routed experts)
RECOMPUTED = {"none": (), "full": tuple(RATE), "selective": ("attention", "sdpa", "routed")}


@functools.lru_cache(maxsize=None)  # building K2 on the meta device takes ~1 s; every row reuses it
def block_parts(config, seq_len: int) -> tuple[dict, ...]:
    """Per block (model.layers order): {part: forward FLOPs per token}."""
    from models import Transformer
    from models.moe import MoE

    with torch.device("meta"):
        model = Transformer(config)
    qk, v = ((config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim) if config.attn == "mla"
             else (config.head_dim, config.head_dim))
    out = []
    for block in model.layers:
        parts = {"norms": 2 * (_params(block.attention_norm) + _params(block.ffn_norm)),
                 "attention": 2 * _params(block.attention), "sdpa": config.n_heads * seq_len * (qk + v)}
        ff = block.feed_forward
        if isinstance(ff, MoE):
            parts |= {"router": 2 * _params(ff.router),
                      "routed": 2 * _params(ff.experts) * config.n_activated_experts // ff.experts.n_experts,
                      "shared": 2 * _params(ff.shared_experts) if ff.shared_experts is not None else 0}
        else:
            parts["ffn"] = 2 * _params(ff)
        out.append(parts)
    return tuple(out)


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def recompute_flops(config, seq_len: int, mode: str) -> dict:
    """{compute rate (RATE's values): FLOPs per token that activation checkpointing `mode` reruns in
    backward}: the forward of the parts RECOMPUTED[mode] names, in every block."""
    out = {}
    for parts in block_parts(config, seq_len):
        for part, flops in parts.items():
            if part in RECOMPUTED[mode]:
                out[RATE[part]] = out.get(RATE[part], 0.0) + flops
    return out


def seconds(parts: dict, names, rates: dict) -> float:
    """Seconds of the `names` parts of one block's forward per token at `rates` (FLOP/s per RATE value)."""
    return sum(parts.get(name, 0) / rates[RATE[name]] for name in names)


def flops_split(config, seq_len: int) -> dict:
    """Training FLOPs per token: {"attention", "experts", "dense"} (sum = runtime.metrics.flops_per_token)."""
    from runtime.metrics import flops_per_token

    total = flops_per_token(config, seq_len)
    if config.attn == "mla":
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        qk = v = config.head_dim
    attention = 3.0 * config.n_layers * config.n_heads * seq_len * (qk + v)
    n_moe = config.n_layers - config.n_dense_layers
    experts = 6.0 * n_moe * config.n_activated_experts * 3 * config.dim * config.moe_inter_dim
    return {"attention": attention, "experts": experts, "dense": total - attention - experts}
