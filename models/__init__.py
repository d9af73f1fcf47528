"""DeepSeek-V3 / Kimi-K2 style MoE decoder: config, presets, modules."""

from models.attention import GQA, MLA, CausalAttention
from models.config import ModelConfig
from models.experts import GroupedExperts
from models.layers import FeedForward, RMSNorm
from models.model import Transformer, TransformerBlock
from models.moe import MoE, Router
from models.presets import PRESETS, count_params, preset

__all__ = [
    "PRESETS", "CausalAttention", "FeedForward", "GQA", "GroupedExperts", "MLA", "MoE", "ModelConfig",
    "RMSNorm", "Router", "Transformer", "TransformerBlock", "count_params", "preset",
]
