"""Tiny Kimi K2.5-layout checkpoints with INT4 routed experts, packed by `compressed-tensors` (the outside
reference for models/hf/int4.py): a multimodal wrapper config, `language_model.`-prefixed text keys, random
vision tower / projector tensors, and beside it the exact dequantization as a plain checkpoint that
`transformers` loads."""

import json
import os
import re

import torch

EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# Kimi's ignore list (every Linear but the routed experts stays bf16), with compressed-tensors' "re:" syntax
IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
          "re:.*vision_tower.*", "re:.*mm_projector.*"]
QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "kv_cache_scheme": None, "ignore": IGNORE,
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                       "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                   "group_size": 32, "dynamic": False, "actorder": None,
                                                   "observer": "minmax", "observer_kwargs": {}}}}}
VISION = {"vision_tower.patch_embed.proj.weight": (8, 3, 2, 2), "vision_tower.encoder.blocks.0.wqkv.weight": (24, 8),
          "vision_tower.encoder.final_layernorm.weight": (8,), "mm_projector.pre_norm.weight": (8,),
          "mm_projector.proj.0.weight": (16, 8), "mm_projector.proj.2.weight": (32, 16)}


def int4_copy(src: str, dst: str, plain_dst: str | None = None, *, k25: bool = True, quant_at_root: bool = False,
              scale_dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict:
    """Write `src` (a transformers DeepseekV3 directory) to `dst` with every routed expert weight replaced by
    random INT4 values q and positive scales, packed with compressed-tensors' `pack_to_int32`; `plain_dst`
    gets the same model with those experts as the fp32 tensors q * scale. Returns {key: (q, scale)}.
    Two shard files (the scales in the second) and an index, like the published checkpoints."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    state = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    prefix = "language_model." if k25 else ""
    first, second, plain, quantized = {}, {}, {}, {}
    for key, w in state.items():
        if not EXPERT.search(key):
            first[prefix + key] = plain[key] = w
            continue
        out, cols = w.shape
        q = torch.randint(-8, 8, (out, cols), generator=g, dtype=torch.int8)
        scale = (0.02 + 0.04 * torch.rand(out, -(-cols // 32), generator=g)).to(scale_dtype)
        plain[key] = q.float() * scale.float().repeat_interleave(32, 1)[:, :cols]
        base = prefix + key[: -len("weight")]
        first[base + "weight_packed"] = pack_to_int32(q, 4)
        first[base + "weight_shape"] = torch.tensor([out, cols])
        second[base + "weight_scale"] = scale
        quantized[key] = (q, scale)
    if k25:
        for key, shape in VISION.items():
            first[key] = torch.randn(shape, generator=g).to(torch.bfloat16)
    os.makedirs(dst)
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for name, tensors in files.items():
        save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: n for n, t in files.items() for k in t}}, f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(k25_config(config, quant_at_root) if k25 else dict(config, quantization_config=QUANT), f, indent=1)
    if plain_dst:
        os.makedirs(plain_dst)
        save_file(plain, os.path.join(plain_dst, "model.safetensors"))
        with open(os.path.join(plain_dst, "config.json"), "w") as f:
            json.dump(config, f)
    return quantized


def k25_config(text: dict, quant_at_root: bool = False) -> dict:
    """A KimiK25ForConditionalGeneration config.json around the decoder fields `text`."""
    text = dict(text, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    out = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}, "media_placeholder_token_id": 163605,
           "ignore_index": -100, "pad_token_id": 0, "use_unified_vision_chunk": True,
           "vision_config": {"patch_size": 14, "vt_hidden_size": 8, "vt_num_hidden_layers": 1, "mm_hidden_size": 8,
                             "text_hidden_size": text["hidden_size"], "merge_kernel_size": [2, 2]},
           "text_config": text if quant_at_root else dict(text, quantization_config=QUANT)}
    return dict(out, quantization_config=QUANT) if quant_at_root else out
