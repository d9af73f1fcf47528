"""ModelConfig: the shape and numerics of a DeepSeek-V3 / Kimi-K2 style decoder.

One frozen, keyword-only dataclass. `__post_init__` checks every field (type and range) and raises
ValueError naming the field and its value, so a bad TOML fails before any rank builds a module.
Fields that only one attention kind reads (GQA: n_kv_heads, head_dim; MLA: q_lora_rank,
kv_lora_rank, qk_*_head_dim, v_head_dim) are checked only for that kind. Derived values are
methods/properties; the config is never mutated.
"""

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.rope import Rope


ATTN_KINDS = ("mla", "gqa")
SCORE_FUNCS = ("sigmoid", "softmax")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_dense_layers: int  # the first n_dense_layers blocks use a dense FeedForward, the rest MoE
    attn: str = "mla"  # "mla" (multi-head latent attention) | "gqa" (grouped-query attention)
    n_heads: int
    # GQA only
    n_kv_heads: int = 0
    head_dim: int = 0
    # MLA only (DeepSeek-V2/V3 notation)
    q_lora_rank: int = 0  # 0 = queries straight from x with `wq`, no low-rank wq_a/wq_b
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # feed-forward
    inter_dim: int  # hidden size of the dense FeedForward
    moe_inter_dim: int  # hidden size of one routed expert (a shared expert is the same size)
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int  # top-k
    score_func: str = "sigmoid"
    route_scale: float = 1.0
    norm_topk_prob: bool = True  # sigmoid router: divide the top-k weights by their sum (softmax weights are used as they are)
    n_expert_groups: int = 1  # group-limited routing: experts form this many equal groups (DeepSeek-V3 n_group)
    n_limited_groups: int = 1  # top-k experts come from the best n_limited_groups groups (topk_group; group score: sum of its top-2 biased scores)
    aux_loss_alpha: float = 0.0  # sequence-wise balance loss weight (DeepSeek-V3 eq. 17-20); 0 = off
    bias_update_speed: float = 1e-3  # aux-loss-free balancing step (DeepSeek-V3 sec. 2.1.2)
    rope_theta: float = 10000.0
    rope_factor: float = 1.0  # YaRN context-extension factor (models/rope.py); 1 = plain RoPE
    rope_original_seq_len: int = 4096  # YaRN: context length the model was pretrained at
    rope_beta_fast: float = 32.0  # YaRN: dims rotating more than this over the original context keep their frequency
    rope_beta_slow: float = 1.0  # YaRN: dims rotating less than this are fully interpolated
    rope_mscale: float = 0.0  # YaRN attention-scale correction numerator (0 = unset)
    rope_mscale_all_dim: float = 0.0  # YaRN attention-scale correction of the softmax scale (0 = unset)
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    latent_norm_eps: float = 0.0  # mla: epsilon of the q/kv latent RMSNorms (0 = norm_eps; DeepSeek-V3 checkpoints use 1e-6)
    init_std: float = 0.02

    def __post_init__(self):
        _check_types(self)
        self._check_common()
        if self.attn == "mla":
            self._check_mla()
        else:
            self._check_gqa()
        if self.n_moe_layers > 0:
            self._check_moe()

    # ---- derived values -------------------------------------------------------------------

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope + rope (MLA) or head_dim (GQA)."""
        if self.attn == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        """Per-head width that RoPE rotates."""
        return self.qk_rope_head_dim if self.attn == "mla" else self.head_dim

    def rope(self) -> "Rope":
        """The rotary tables' parameters (plain RoPE when rope_factor == 1, else YaRN)."""
        from models.rope import Rope  # here only: the config is read before torch loads (launch/precheck.py)

        return Rope(dim=self.rope_dim, theta=self.rope_theta, factor=self.rope_factor,
                    original_seq_len=self.rope_original_seq_len, beta_fast=self.rope_beta_fast,
                    beta_slow=self.rope_beta_slow, mscale=self.rope_mscale, mscale_all_dim=self.rope_mscale_all_dim)

    @property
    def mla_latent_norm_eps(self) -> float:
        return self.latent_norm_eps or self.norm_eps

    # ---- validation -----------------------------------------------------------------------

    def _check_common(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            _require(self, name, getattr(self, name) >= 1, ">= 1")
        _require(self, "attn", self.attn in ATTN_KINDS, f"one of {ATTN_KINDS}")
        _require(self, "score_func", self.score_func in SCORE_FUNCS, f"one of {SCORE_FUNCS}")
        _require(
            self,
            "n_dense_layers",
            0 <= self.n_dense_layers <= self.n_layers,
            f"in [0, n_layers={self.n_layers}]",
        )
        if self.n_dense_layers > 0:
            _require(self, "inter_dim", self.inter_dim >= 1, ">= 1 (there are dense layers)")
        for name in ("rope_theta", "norm_eps", "init_std", "route_scale"):
            _require(self, name, getattr(self, name) > 0, "> 0")
        for name in ("aux_loss_alpha", "bias_update_speed", "latent_norm_eps", "rope_mscale", "rope_mscale_all_dim"):
            _require(self, name, getattr(self, name) >= 0, ">= 0")
        _require(self, "rope_factor", self.rope_factor >= 1, ">= 1 (1 = plain RoPE)")
        if self.rope_factor != 1:
            _require(self, "rope_original_seq_len", self.rope_original_seq_len >= 1, ">= 1 with YaRN")
            for name in ("rope_beta_fast", "rope_beta_slow"):  # Kimi K2 sets both to 1
                _require(self, name, getattr(self, name) > 0, "> 0 with YaRN")

    def _check_mla(self):
        _require(self, "q_lora_rank", self.q_lora_rank >= 0, ">= 0 (0 = no query low-rank)")
        for name in ("kv_lora_rank", "v_head_dim"):
            _require(self, name, getattr(self, name) >= 1, ">= 1 for attn='mla'")
        _require(self, "qk_nope_head_dim", self.qk_nope_head_dim >= 0, ">= 0 for attn='mla'")
        _require(
            self,
            "qk_rope_head_dim",
            self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
            "even and >= 2 for attn='mla' (RoPE rotates pairs)",
        )

    def _check_gqa(self):
        _require(self, "n_kv_heads", self.n_kv_heads >= 1, ">= 1 for attn='gqa'")
        _require(
            self,
            "n_heads",
            self.n_heads % self.n_kv_heads == 0,
            f"a multiple of n_kv_heads={self.n_kv_heads} for attn='gqa'",
        )
        _require(
            self,
            "head_dim",
            self.head_dim >= 2 and self.head_dim % 2 == 0,
            "even and >= 2 for attn='gqa' (RoPE rotates pairs)",
        )

    def _check_moe(self):
        where = f"(there are {self.n_moe_layers} MoE layers)"
        _require(self, "n_routed_experts", self.n_routed_experts >= 1, f">= 1 {where}")
        _require(self, "moe_inter_dim", self.moe_inter_dim >= 1, f">= 1 {where}")
        _require(self, "n_shared_experts", self.n_shared_experts >= 0, ">= 0")
        _require(
            self,
            "n_activated_experts",
            1 <= self.n_activated_experts <= self.n_routed_experts,
            f"in [1, n_routed_experts={self.n_routed_experts}]",
        )
        self._check_groups()

    def _check_groups(self):
        groups, limited = self.n_expert_groups, self.n_limited_groups
        _require(self, "n_expert_groups", groups >= 1 and self.n_routed_experts % groups == 0,
                 f">= 1 and divide n_routed_experts={self.n_routed_experts}")
        _require(self, "n_limited_groups", 1 <= limited <= groups, f"in [1, n_expert_groups={groups}]")
        per_group = self.n_routed_experts // groups
        if groups > 1:
            _require(self, "n_expert_groups", per_group >= 2,
                     f"at most n_routed_experts/2={self.n_routed_experts // 2} (a group scores its top-2 experts)")
        _require(self, "n_limited_groups", limited * per_group >= self.n_activated_experts,
                 f"large enough that n_limited_groups * {per_group} experts per group >= "
                 f"n_activated_experts={self.n_activated_experts}")


def _require(config: ModelConfig, name: str, ok: bool, expected: str):
    if not ok:
        raise ValueError(f"ModelConfig.{name}={getattr(config, name)!r} must be {expected}")


def _check_types(config: ModelConfig):
    """int fields take int (not bool), float fields take int or float, str fields take str."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type in ("bool", bool):
            ok = isinstance(value, bool)
        elif field.type in ("int", int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif field.type in ("float", float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ValueError(
                f"ModelConfig.{field.name}={value!r} has type {type(value).__name__}, "
                f"expected {getattr(field.type, '__name__', field.type)}"
            )
