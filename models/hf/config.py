"""A Hugging Face DeepSeek-V3-architecture `config.json` (DeepSeek-V3, Kimi K2, Moonlight) <-> ModelConfig.

Every field of the file is either mapped to a ModelConfig field, checked to hold the one value the
model implements, or known to be irrelevant to the weights' meaning (token ids, dtype, cache flags).
Anything else raises a one-line ValueError naming the field and its value: never a silent approximation.
Extra facts of the checkpoint that are not model shape (rotary layout, MTP layers, FP8 blocks, INT4
scheme, key prefix) come back as a `CheckpointFormat`.

Kimi K2.5 (`model_type "kimi_k25"`, `KimiK25ForConditionalGeneration`) wraps the decoder: its fields are
in `text_config`, its `quantization_config` inside `text_config` (or copied to the root by some tools),
and its weights under `language_model.` next to `vision_tower.*` and `mm_projector.*`, which we skip.
"""

import json
import os
from dataclasses import dataclass

from models.hf import int4_scheme
from models.config import ModelConfig
from models.hf.int4_scheme import Int4Scheme

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
MULTIMODAL_TYPE, MULTIMODAL_ARCHITECTURE = "kimi_k25", "KimiK25ForConditionalGeneration"
TEXT_PREFIX = "language_model."  # K2.5: language_model.model.layers.N..., language_model.lm_head.weight
MULTIMODAL_PREFIXES = ("vision_tower.", "mm_projector.")  # K2.5 tensors that are not the text model

# config.json field -> ModelConfig field (same value, possibly int -> float).
_MAPPED = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "intermediate_size": "inter_dim",
    "moe_intermediate_size": "moe_inter_dim", "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts", "num_experts_per_tok": "n_activated_experts",
    "routed_scaling_factor": "route_scale", "norm_topk_prob": "norm_topk_prob", "n_group": "n_expert_groups",
    "topk_group": "n_limited_groups", "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len",
    "initializer_range": "init_std",
}
# Fields that must hold exactly this value (what the model implements); absent = the default.
_REQUIRED = {
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_layer_freq": 1, "attention_dropout": 0.0, "ep_size": 1,
    "pretraining_tp": 1,
}
# Fields read by dedicated code below (attention/rope/MTP/quantization), not by the tables above.
_READ_ELSEWHERE = {"q_lora_rank", "first_k_dense_replace", "num_key_value_heads", "rope_theta", "rope_scaling",
                   "rope_parameters", "rope_interleave", "num_nextn_predict_layers", "num_mtp_layers",
                   "quantization_config"}
# Fields that do not change what the weights compute (training-loss settings are the runtime's to choose).
_IGNORED = {"architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
            "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits", "aux_loss_alpha", "seq_aux",
            "router_aux_loss_coef", "head_dim", "qk_head_dim", "_name_or_path", "name_or_path", "tokenizer_class"}
# transformers' PretrainedConfig fields of every model (to_dict() writes them into a text_config), at their
# defaults (transformers 5.25; the 4.x ones too): no model shape, accepted at these values only.
_GENERIC_DEFAULTS = {"output_hidden_states": False, "output_attentions": False, "return_dict": True,
                     "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "is_decoder": False,
                     "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
                     "problem_type": None, "torchscript": False, "use_bfloat16": False, "tf_legacy_loss": False,
                     "pruned_heads": {}, "add_cross_attention": False, "tie_encoder_decoder": False,
                     "cross_attention_hidden_size": None, "finetuning_task": None, "prefix": None,
                     "sep_token_id": None, "decoder_start_token_id": None, "task_specific_params": None}
_OPTIONAL = {"initializer_range"}  # the others have no default we could assume (transformers defaults n_group to 8)
_YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "rope_theta", "truncate"}


@dataclass(frozen=True)
class CheckpointFormat:
    rope_interleave: bool  # rotary dims stored as interleaved pairs (DeepSeek), not halves
    n_mtp_layers: int  # multi-token-prediction layers after the last layer (not loaded)
    fp8_block: tuple[int, int] | None  # weight_block_size of float8_e4m3fn weights, None if unquantized
    int4: "Int4Scheme | None" = None  # compressed-tensors INT4 (models/hf/int4_scheme.py), None if not
    prefix: str = ""  # key prefix of the text model's tensors ("language_model." for K2.5)
    first_mtp_layer: int = 0  # config.json's num_hidden_layers: the MTP layers' keys start at this layer index


def read_hf_config(directory: str) -> tuple[ModelConfig, CheckpointFormat]:
    """(ModelConfig, CheckpointFormat) from `directory/config.json`; ValueError (one line) on any problem."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: no such directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, nested too deeply
        raise ValueError(f"{path}: not valid JSON ({str(e)[:120]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a model config (a JSON {type(raw).__name__}, not an object)")
    text, prefix = text_config(raw, path)
    return model_config(text, path), checkpoint_format(text, path, prefix)


def text_config(raw: dict, where: str) -> tuple[dict, str]:
    """(the decoder's config fields, key prefix): `raw` itself, or K2.5's `text_config` (with the root's
    `quantization_config` when only the root has one)."""
    if raw.get("model_type") != MULTIMODAL_TYPE and MULTIMODAL_ARCHITECTURE not in (raw.get("architectures") or []):
        return raw, ""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: model_type={raw.get('model_type')!r} (Kimi K2.5) has no text_config: "
                         f"expected the decoder's fields under text_config")
    root, inner = raw.get("quantization_config"), text.get("quantization_config")
    if root and inner and root != inner:
        raise ValueError(f"{where}: quantization_config at the root and in text_config differ")
    return (dict(text, quantization_config=root) if root and not inner else text), TEXT_PREFIX


def model_config(raw: dict, where: str) -> ModelConfig:
    _check_architecture(raw, where)
    _check_fields(raw, where)
    fields = {ours: raw[theirs] for theirs, ours in _MAPPED.items() if theirs in raw}
    for name in ("route_scale", "norm_eps", "init_std"):
        if name in fields:
            fields[name] = float(fields[name])
    n_layers = raw["num_hidden_layers"]
    fields.update(attn="mla", score_func="sigmoid", latent_norm_eps=1e-6, q_lora_rank=raw.get("q_lora_rank") or 0,
                  n_dense_layers=min(raw.get("first_k_dense_replace", 0), n_layers), **_rope_fields(raw, where))
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def checkpoint_format(raw: dict, where: str, prefix: str = "") -> CheckpointFormat:
    quant = raw.get("quantization_config")
    is_int4 = bool(quant) and quant.get("quant_method") == int4_scheme.METHOD
    return CheckpointFormat(rope_interleave=bool(raw.get("rope_interleave", True)),
                            n_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
                            fp8_block=None if is_int4 else _fp8_block(quant, where),
                            int4=int4_scheme.read_scheme(quant, where) if is_int4 else None, prefix=prefix,
                            first_mtp_layer=int(raw.get("num_hidden_layers") or 0))


def _check_architecture(raw: dict, where: str):
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs and raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"{where}: architectures={archs} model_type={raw.get('model_type')!r}: "
                         f"expected {ARCHITECTURE} (model_type one of {MODEL_TYPES})")
    missing = sorted(k for k in _MAPPED if k not in raw and k not in _OPTIONAL)
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")


def _check_fields(raw: dict, where: str):
    for key, value in raw.items():
        if key in _REQUIRED and value != _REQUIRED[key]:
            raise ValueError(f"{where}: {key}={value!r} is not supported (the model implements {key}="
                             f"{_REQUIRED[key]!r})")
        if key in _GENERIC_DEFAULTS and _json_equal(value, _GENERIC_DEFAULTS[key]):
            continue
        if key not in _MAPPED and key not in _REQUIRED and key not in _READ_ELSEWHERE and key not in _IGNORED:
            raise ValueError(f"{where}: field {key}={value!r} is not supported by the model")
    heads = raw.get("num_key_value_heads")
    if heads is not None and heads != raw.get("num_attention_heads"):
        raise ValueError(f"{where}: num_key_value_heads={heads} is not supported (MLA needs it equal to "
                         f"num_attention_heads={raw.get('num_attention_heads')})")


def _json_equal(value, default) -> bool:
    """`value` as read from JSON equals `default` (dict keys compare as strings: JSON has no others)."""
    if isinstance(value, dict) and isinstance(default, dict):
        return {str(k): v for k, v in value.items()} == default
    return value == default and type(value) is type(default)


def _rope_fields(raw: dict, where: str) -> dict:
    """rope_theta and YaRN fields from `rope_scaling` + `rope_theta` (published files) or `rope_parameters`
    (files written by transformers >= 5)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"{where}: rope scaling type {kind!r} is not supported (only 'yarn')")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown or params.get("truncate", True) is not True:
        raise ValueError(f"{where}: rope scaling field(s) {unknown or ['truncate']} not supported "
                         f"(supported: {sorted(_YARN_KEYS - {'truncate'})}, truncate=true)")
    if params.get("factor") is None:
        raise ValueError(f"{where}: yarn rope scaling without 'factor'")
    return {"rope_theta": theta, "rope_factor": float(params["factor"]),
            "rope_original_seq_len": int(params.get("original_max_position_embeddings", 4096)),
            "rope_beta_fast": float(params.get("beta_fast") or 32), "rope_beta_slow": float(params.get("beta_slow") or 1),
            "rope_mscale": float(params.get("mscale") or 0), "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0)}


def _fp8_block(quant: dict | None, where: str) -> tuple[int, int] | None:
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or "weight_block_size" not in quant:
        raise ValueError(f"{where}: quantization_config quant_method={method!r} fmt={quant.get('fmt')!r} is not "
                         f"supported (only block-wise 'fp8' e4m3 with weight_block_size, or "
                         f"{int4_scheme.METHOD!r} {int4_scheme.FORMAT!r} INT4)")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def hf_config_dict(c: ModelConfig, rope_interleave: bool = True) -> dict:
    """config.json contents (published field names) for `c`; the inverse of `model_config`."""
    if c.attn != "mla" or c.score_func != "sigmoid":
        raise ValueError(f"only attn='mla' with score_func='sigmoid' exports to {ARCHITECTURE} "
                         f"(got attn={c.attn!r}, score_func={c.score_func!r})")
    if c.attn == "mla" and c.mla_latent_norm_eps != 1e-6:
        raise ValueError(f"latent_norm_eps={c.mla_latent_norm_eps} (0 = norm_eps={c.norm_eps}): {ARCHITECTURE} "
                         f"fixes the q/kv latent RMSNorm epsilon at 1e-6")
    out = {theirs: getattr(c, ours) for theirs, ours in _MAPPED.items()}
    out.update(architectures=[ARCHITECTURE], model_type="deepseek_v3", q_lora_rank=c.q_lora_rank or None,
               first_k_dense_replace=c.n_dense_layers, num_key_value_heads=c.n_heads, hidden_act="silu",
               attention_bias=False, tie_word_embeddings=False, scoring_func="sigmoid", topk_method="noaux_tc",
               rope_theta=c.rope_theta, rope_interleave=rope_interleave, num_nextn_predict_layers=0,
               torch_dtype="float32")
    if c.rope_factor != 1:
        out["rope_scaling"] = {"type": "yarn", "factor": c.rope_factor,
                               "original_max_position_embeddings": c.rope_original_seq_len,
                               "beta_fast": c.rope_beta_fast, "beta_slow": c.rope_beta_slow,
                               "mscale": c.rope_mscale, "mscale_all_dim": c.rope_mscale_all_dim}
    return out
