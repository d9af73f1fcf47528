"""Shared fixtures of the Hugging Face tests (tests/*/test_hf*.py): how logits are compared with transformers'
(REL_TOL, `_rel_err`, `_tokens`), an FP8 block-quantized copy of a checkpoint with its exact dequantization
(`_fp8_copy`), the layouts the sharded loads run on (command-line overrides), and the published DeepSeek-V3
and Kimi K2 config.json files."""

import json
import os

import torch

# fp32 throughout; the two implementations order their sums differently, which moves logits by ~3e-7
# of their largest magnitude (measured on these cases). 1e-4 leaves room for that and for nothing else:
# a wrong rotary layout, group limit or YaRN factor moves them by 0.3-1.3 (test_comparison_is_sensitive).
REL_TOL = 1e-4


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _tokens(vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


BLOCK = (16, 16)  # tiny stand-in for the published 128 x 128; 24- and 48-row weights leave partial blocks


def _quantize(w: torch.Tensor):
    """Block-wise e4m3 quantization as the published checkpoints store it: w ~ fp8 * scale_inv per block."""
    rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
    scale_inv = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale_inv[i, j] = block.abs().max() / 448.0
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (block / scale_inv[i, j]).to(q.dtype)
    return q, scale_inv


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The definition, element by element over blocks: weight * scale_inv of its block."""
    out = torch.empty(q.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = q[rows, cols].float() * scale_inv[i, j]
    return out


def _fp8_copy(src: str, dst: str, dequantized_dst: str):
    """An FP8 copy of `src` (every linear weight but the embedding, head and router, like DeepSeek-V3),
    and the exact dequantization of that copy as a plain fp32 checkpoint."""
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(src, "model.safetensors"))
    fp8, plain = {}, {}
    for key, w in state.items():
        quantize = w.dim() == 2 and "embed" not in key and "lm_head" not in key and not key.endswith("mlp.gate.weight")
        if quantize:
            q, s = _quantize(w)
            fp8[key], fp8[key + "_scale_inv"], plain[key] = q, s, _dequantize(q, s)
        else:
            fp8[key] = plain[key] = w
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for path, tensors, quant in ((dst, fp8, True), (dequantized_dst, plain, False)):
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "model.safetensors"))
        cfg = dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": list(BLOCK)}) if quant else config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)


ARGS = ["--data.source=synthetic", "--data.seq_len=32", "--data.batch_size=8", "--training.warmup_steps=1",
        "--checkpoint.interval=0"]
HEADLINE = ["--parallel.dp_replicate=1", "--parallel.dp_shard=4", "--parallel.cp=2",
            "--parallel.ep=8", "--parallel.edp_replicate=1", "--parallel.edp_shard=1"]
# 4 experts / ep=2 = 2 local experts < edp_shard=4: experts sharded on a matrix dim (Shard(1)).
MATRIX_DIM = ["--parallel.dp_replicate=1", "--parallel.dp_shard=8", "--parallel.cp=1",
              "--parallel.ep=2", "--parallel.edp_replicate=1", "--parallel.edp_shard=4"]
HSDP = ["--parallel.dp_replicate=2", "--parallel.dp_shard=4", "--parallel.cp=1",
        "--parallel.ep=2", "--parallel.edp_replicate=2", "--parallel.edp_shard=2"]
ONE = ["--parallel.dp_replicate=1", "--parallel.dp_shard=1", "--parallel.cp=1",
       "--parallel.ep=1", "--parallel.edp_replicate=1", "--parallel.edp_shard=1"]

_DEEPSEEK_V3 = {  # the fields of deepseek-ai/DeepSeek-V3's config.json (auto_map left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
_KIMI_K2 = dict(_DEEPSEEK_V3, model_type="kimi_k2", first_k_dense_replace=1, max_position_embeddings=131072,
                n_group=1, topk_group=1, n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64,
                num_nextn_predict_layers=0, routed_scaling_factor=2.827, rope_theta=50000.0, vocab_size=163840,
                rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 4096, "type": "yarn"})


def ep4_sharded_model(path, run_dir, world_size):
    """This rank's empty model on dp_shard=4 = ep=4 (cp 1, edp_shard 1) with --model.init_from=`path`, parallelized
    as the runtime does, on the CPU: what a rank loads its shards of a pretrained checkpoint into."""
    from parallel.meshes import build_meshes
    from runtime import train as T
    from runtime.config_parser import load_config

    config = load_config(ARGS + [f"--model.init_from={path}", f"--run.dir={run_dir}", "--parallel.dp_shard=4",
                                 "--parallel.cp=1", "--parallel.ep=4", "--parallel.edp_shard=1"])
    layout = config.layout(world_size)
    with torch.device("meta"):
        model = T.Transformer(config.model)
    T.parallelize(model, build_meshes(layout, "cpu"), layout)
    model.to_empty(device="cpu")
    return model
