"""Named model configurations and a parameter counter that allocates nothing.

Published shapes are from each model's Hugging Face config.json (first_k_dense_replace ->
n_dense_layers, moe_intermediate_size -> moe_inter_dim, routed_scaling_factor -> route_scale, ...).
These presets route over all experts and use plain RoPE (for training from scratch); the model also
implements DeepSeek-V3's group-limited routing (n_expert_groups / n_limited_groups) and YaRN
(rope_factor ...), which `--model.init_from` reads from a checkpoint's config.json (models/hf/config.py).
Not modelled: the multi-token-prediction module (not counted).
Published sizes (count_params lands within 2%, see tests/unit/test_models.py):
  deepseek_v3_671b  671B total, 37B active (DeepSeek-V3 report, main model without MTP)
  kimi_k2_1t        1.04T total, 32.6B active (Kimi K2 report)
  moonlight_16b     15.29B total, 2.24B active without the embedding and output head (Moonlight
                    paper; with them ~16B / ~3B, hence "16B-A3B")
"""

import dataclasses

from models.config import ModelConfig

_DEBUG = dict(
    vocab_size=256,  # the runtime's byte-level tokenizer
    dim=64,
    n_layers=3,
    n_dense_layers=1,
    attn="mla",
    n_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    inter_dim=128,
    moe_inter_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    n_activated_experts=2,
    score_func="sigmoid",
    max_seq_len=256,
)

_MLA_BIG = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

PRESETS: dict[str, ModelConfig] = {
    "debug": ModelConfig(**_DEBUG),
    "debug_gqa": ModelConfig(**{**_DEBUG, "attn": "gqa", "n_kv_heads": 2, "head_dim": 16}),
    "moonlight_16b": ModelConfig(
        vocab_size=163840, dim=2048, n_layers=27, n_dense_layers=1, attn="mla", n_heads=16,
        q_lora_rank=0, **_MLA_BIG, inter_dim=11264, moe_inter_dim=1408, n_routed_experts=64,
        n_shared_experts=2, n_activated_experts=6, score_func="sigmoid", route_scale=2.446,
        rope_theta=50000.0, max_seq_len=8192, norm_eps=1e-5, init_std=0.02,
    ),
    "deepseek_v3_671b": ModelConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_dense_layers=3, attn="mla", n_heads=128,
        q_lora_rank=1536, **_MLA_BIG, inter_dim=18432, moe_inter_dim=2048, n_routed_experts=256,
        n_shared_experts=1, n_activated_experts=8, score_func="sigmoid", route_scale=2.5,
        aux_loss_alpha=1e-4, bias_update_speed=1e-3, rope_theta=10000.0, max_seq_len=4096,
        norm_eps=1e-6, init_std=0.006,
    ),
    "kimi_k2_1t": ModelConfig(
        vocab_size=163840, dim=7168, n_layers=61, n_dense_layers=1, attn="mla", n_heads=64,
        q_lora_rank=1536, **_MLA_BIG, inter_dim=18432, moe_inter_dim=2048, n_routed_experts=384,
        n_shared_experts=1, n_activated_experts=8, score_func="sigmoid", route_scale=2.827,
        rope_theta=50000.0, max_seq_len=4096, norm_eps=1e-6, init_std=0.006,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The named config with some fields replaced (the result is validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown} for preset {name!r}; valid fields: {fields}")
    return dataclasses.replace(PRESETS[name], **overrides)


def count_params(config: ModelConfig) -> tuple[int, int]:
    """(total, active) parameter counts, from a model built on the meta device (no storage).

    active = total minus the routed experts a token does not use: (E - K) of the E experts in each
    MoE layer. Embedding and output head are included in both.
    """
    import torch  # here only: presets are read before torch loads (launch/precheck.py)

    from models.model import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for layer in model.layers:
        experts = getattr(layer.feed_forward, "experts", None)
        if experts is not None:
            per_expert = sum(p.numel() for p in experts.parameters()) // experts.n_experts
            idle += (experts.n_experts - config.n_activated_experts) * per_expert
    return total, total - idle
