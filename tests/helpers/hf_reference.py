"""Tiny random `transformers` DeepseekV3ForCausalLM checkpoints: the outside reference for models/hf/checkpoint.py."""

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            v_head_dim=8, qk_nope_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, num_nextn_predict_layers=0)

CASES = {
    "q_lora": {},
    "no_q_lora": dict(q_lora_rank=None),
    "groups": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    # Kimi K2's rope_scaling (beta_fast = beta_slow = 1, factor 32, mscale = mscale_all_dim = 1), shorter original context
    "kimi_k2_style": dict(n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=2.827, rms_norm_eps=1e-5,
                          rope_theta=50000.0, rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                                                            "mscale": 1.0, "mscale_all_dim": 1.0,
                                                            "original_max_position_embeddings": 64}),
    "yarn": dict(max_position_embeddings=512, rope_theta=50000.0,
                 rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}),
}


def hf_config(**overrides):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**TINY, **overrides})


@torch.no_grad()
def random_hf_model(config, seed: int = 0):
    """Every weight random, norms around 1, router bias random too (a zero tensor would hide mistakes)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.15 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


def hf_logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens_BS).logits
