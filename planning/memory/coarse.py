"""The coarse activation formula the whole-step models rank layouts by (planning/step.py, planning/dual_mesh.py):
one formula, per token and layer, for every layout; the memory estimates (planning/memory/pretrain.py) measure
activations instead and are the ones to trust for a fit.

Per token and layer, a block keeps about (values, in the activations' dtype):
    16 D                   norms, residuals, projections' inputs and outputs around attention and the MoE
    2 H (qk + v)           the attention's queries, keys and values per head (MLA: nope + rope + v; GQA: 2 head_dim)
    K (D + 3 I)            the routed copies: K rows of D dispatched, and their 3 I of gate, up and product
With full activation checkpointing a layer keeps its input (D) until its backward reruns it; the layer being
recomputed (or run) holds the whole per-layer set once.
"""


def values_per_token_layer(config) -> int:
    """Activation values one block keeps per token without checkpointing (module docstring)."""
    c = config
    head = c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim if c.attn == "mla" else 2 * c.head_dim
    return 16 * c.dim + 2 * c.n_heads * head + c.n_activated_experts * (c.dim + 3 * c.moe_inter_dim)


def activation_bytes(config, tokens: float, layers: float, mode: str, act_bytes: int, in_flight: float = 1.0) -> float:
    """Bytes of `in_flight` micro-batches of `tokens` tokens kept over `layers` layers under activation
    checkpointing `mode` ("full" keeps each layer's input; "none" and "selective", counted like it, all), plus
    the one layer running or recomputed."""
    per_layer = values_per_token_layer(config)
    kept = config.dim if mode == "full" else per_layer
    return act_bytes * tokens * (in_flight * layers * kept + per_layer)
