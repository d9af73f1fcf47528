"""DeepSeek-V3 / Kimi-K2 style MoE decoder: config, presets, modules.

The names below load from their modules on first use (PEP 562 `__getattr__`), so reading the config
(`models.config`, `models.presets`) never imports torch: launch/precheck.py checks a job's config
before torch loads.
"""

import importlib

_HOMES = {
    "CausalAttention": "models.attention", "GQA": "models.attention", "MLA": "models.attention",
    "ModelConfig": "models.config", "GroupedExperts": "models.experts", "FeedForward": "models.layers",
    "RMSNorm": "models.layers", "Transformer": "models.model", "TransformerBlock": "models.model",
    "MoE": "models.moe", "Router": "models.moe", "PRESETS": "models.presets", "count_params": "models.presets",
    "preset": "models.presets",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
