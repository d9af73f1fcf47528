"""Hugging Face DeepSeek-V3 checkpoints: our model's logits equal `transformers`' (the outside reference),
FP8 block dequantization is exact, bad directories fail in one line, exports load back into `transformers`."""

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import CASES, hf_config, hf_logits, random_hf_model  # noqa: E402
from models.hf import check_checkpoint, load_pretrained, load_state, save_pretrained  # noqa: E402
from models.hf_config import read_hf_config  # noqa: E402
from models.hf_files import CheckpointFiles  # noqa: E402
from models.model import Transformer  # noqa: E402

# fp32 throughout; the two implementations order their sums differently, which moves logits by ~3e-7
# of their largest magnitude (measured on these cases). 1e-4 leaves room for that and for nothing else:
# a wrong rotary layout, group limit or YaRN factor moves them by 0.3-1.3 (test_comparison_is_sensitive).
REL_TOL = 1e-4


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _tokens(vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (transformers model, saved directory)."""
    out = {}
    for name, overrides in CASES.items():
        hf = random_hf_model(hf_config(**overrides))
        path = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(path)
        out[name] = (hf, path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(checkpoints, case):
    hf, path = checkpoints[case]
    model = load_pretrained(path)
    with torch.no_grad():
        logits = model(_tokens(), torch.arange(24))
    assert _rel_err(logits, hf_logits(hf, _tokens())) < REL_TOL


@pytest.mark.parametrize("case, change, fmt_change", [
    ("q_lora", {}, {"rope_interleave": False}),
    ("groups", {"n_limited_groups": 4}, {}),
    ("yarn", {"rope_mscale_all_dim": 1.0}, {}),
    ("kimi_k2_style", {"norm_topk_prob": False}, {}),
])
def test_comparison_is_sensitive(checkpoints, case, change, fmt_change):
    """Each feature matters on these tiny models: getting it wrong breaks the tolerance by far."""
    hf, path = checkpoints[case]
    config, fmt = read_hf_config(path)
    model = Transformer(dataclasses.replace(config, **change))
    load_state(model, path, dataclasses.replace(fmt, **fmt_change))
    with torch.no_grad():
        assert _rel_err(model(_tokens()), hf_logits(hf, _tokens())) > 100 * REL_TOL


def test_config_mapping(checkpoints):
    config, fmt = read_hf_config(checkpoints["groups"][1])
    assert (config.n_expert_groups, config.n_limited_groups, config.n_activated_experts) == (4, 2, 3)
    assert (config.route_scale, config.n_dense_layers, config.q_lora_rank) == (2.5, 1, 24)
    assert fmt.rope_interleave and fmt.fp8_block is None and fmt.n_mtp_layers == 0
    yarn, _ = read_hf_config(checkpoints["yarn"][1])
    assert (yarn.rope_factor, yarn.rope_original_seq_len, yarn.rope_mscale_all_dim, yarn.rope_theta) == (8.0, 64, 0.7, 5e4)
    assert read_hf_config(checkpoints["no_q_lora"][1])[0].q_lora_rank == 0


# ---- FP8 ----------------------------------------------------------------------------------------

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


def test_fp8_weights_load_as_their_exact_dequantization(checkpoints, tmp_path):
    fp8_dir, plain_dir = str(tmp_path / "fp8"), str(tmp_path / "plain")
    _fp8_copy(checkpoints["groups"][1], fp8_dir, plain_dir)
    fp8, plain = load_pretrained(fp8_dir), load_pretrained(plain_dir)
    for (name, a), (_, b) in zip(fp8.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def test_fp8_box_reads_equal_slices_of_the_whole(checkpoints, tmp_path):
    """A shard's box (any rows/cols, partial blocks) reads the same values as cutting the whole tensor."""
    fp8_dir = str(tmp_path / "fp8")
    _fp8_copy(checkpoints["q_lora"][1], fp8_dir, str(tmp_path / "plain"))
    files = CheckpointFiles.scan(fp8_dir)
    key = "model.layers.1.self_attn.q_b_proj.weight"  # [48, 24]: blocks of 16 x 16, the last column block partial
    whole = files.read_box(key, ((0, 48), (0, 24)), BLOCK)
    for box in (((0, 13), (0, 24)), ((13, 37), (5, 22)), ((40, 48), (16, 24)), ((7, 7), (0, 24))):
        got = files.read_box(key, box, BLOCK)
        assert torch.equal(got, whole[box[0][0]:box[0][1], box[1][0]:box[1][1]]), box


# ---- bad input ------------------------------------------------------------------------------------

def _copy_with(src: str, dst: str, *, config_edit=None, tensor_edit=None):
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config_edit(config) if config_edit else config, f)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file(tensor_edit(state) if tensor_edit else state, os.path.join(dst, "model.safetensors"))
    return dst


def _error(path: str) -> str:
    with pytest.raises(ValueError) as info:
        config, fmt = read_hf_config(path)
        check_checkpoint(path, config, fmt)
    message = str(info.value)
    assert "\n" not in message
    return message


def _reshaped(state):
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    return state


BAD = {
    "missing key": (None, lambda s: {k: v for k, v in s.items() if "layers.2.mlp.experts.5.up" not in k},
                    "1 tensor(s) missing, e.g. ['model.layers.2.mlp.experts.5.up_proj.weight']"),
    "unexpected key": (None, lambda s: dict(s, **{"model.extra.weight": torch.zeros(2)}),
                       "1 unexpected tensor(s), e.g. ['model.extra.weight']"),
    "shape": (None, _reshaped, "model.layers.0.mlp.up_proj.weight has shape [47, 32], the config implies [48, 32]"),
    "quantization": (lambda c: dict(c, quantization_config={"quant_method": "compressed-tensors"}), None,
                     "quant_method='compressed-tensors'"),
    "architecture field": (lambda c: dict(c, attention_bias=True), None, "attention_bias=True is not supported"),
    "unknown field": (lambda c: dict(c, sliding_window=128), None, "field sliding_window=128 is not supported"),
    "rope type": (lambda c: dict(c, rope_parameters={"rope_type": "linear", "factor": 2.0}), None,
                  "rope scaling type 'linear' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_line(checkpoints, tmp_path, case):
    config_edit, tensor_edit, expected = BAD[case]
    path = _copy_with(checkpoints["q_lora"][1], str(tmp_path / "bad"), config_edit=config_edit, tensor_edit=tensor_edit)
    assert expected in _error(path)


def test_missing_directory_and_shard_file(checkpoints, tmp_path):
    assert "no such directory" in _error(str(tmp_path / "nowhere"))
    path = str(tmp_path / "sharded")
    save_pretrained(load_pretrained(checkpoints["q_lora"][1]), path, shard_bytes=40_000)
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(shards) > 2
    os.remove(os.path.join(path, shards[1]))
    assert f"shard file {shards[1]} (listed in model.safetensors.index.json" in _error(path)


def test_mtp_layers_are_skipped_with_a_note(checkpoints, tmp_path):
    def add_mtp(state):
        return dict(state, **{"model.layers.3.eh_proj.weight": torch.zeros(4, 4)})

    path = _copy_with(checkpoints["q_lora"][1], str(tmp_path / "mtp"), tensor_edit=add_mtp,
                      config_edit=lambda c: dict(c, num_nextn_predict_layers=1))
    config, fmt = read_hf_config(path)
    assert fmt.n_mtp_layers == 1
    assert check_checkpoint(path, config, fmt) == [f"{path}: skipping 1 multi-token-prediction tensors (layers >= 3)"]


# ---- export -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["no_q_lora", "yarn"])
def test_save_pretrained_loads_back_into_transformers(checkpoints, tmp_path, case):
    from transformers import DeepseekV3ForCausalLM

    model = load_pretrained(checkpoints[case][1])
    path = str(tmp_path / "out")
    save_pretrained(model, path, shard_bytes=40_000)  # several shards and an index
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) > 1
    hf = DeepseekV3ForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert _rel_err(model(_tokens()), hf_logits(hf, _tokens())) < REL_TOL
    reloaded = load_pretrained(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


# ---- published configs ---------------------------------------------------------------------------

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


@pytest.mark.parametrize("raw, preset_name", [(_DEEPSEEK_V3, "deepseek_v3_671b"), (_KIMI_K2, "kimi_k2_1t")])
def test_published_configs_map_to_the_presets_shapes(raw, preset_name):
    """Every shape field equals the hand-written preset; only what the presets leave out differs."""
    from models import preset
    from models.hf_config import checkpoint_format, model_config

    config, fmt = model_config(raw, "config.json"), checkpoint_format(raw, "config.json")
    leave_out = {"n_expert_groups", "n_limited_groups", "rope_factor", "rope_original_seq_len", "rope_beta_fast",
                 "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim", "max_seq_len", "init_std", "aux_loss_alpha",
                 "latent_norm_eps"}
    ours, theirs = dataclasses.asdict(config), dataclasses.asdict(preset(preset_name))
    assert {k: v for k, v in ours.items() if k not in leave_out} == {k: v for k, v in theirs.items() if k not in leave_out}
    assert fmt.fp8_block == (128, 128) and fmt.rope_interleave
    assert (config.n_expert_groups, config.n_limited_groups) == (raw["n_group"], raw["topk_group"])
    assert config.rope_factor == raw["rope_scaling"]["factor"] and config.max_seq_len == raw["max_position_embeddings"]


def test_generic_transformers_fields_at_their_defaults_are_accepted(tmp_path):
    """A config written through transformers' PretrainedConfig.to_dict() carries every model's generic
    fields (output_hidden_states, return_dict, id2label, ...): at their defaults they are no shape."""
    from models import preset
    from models.hf_config import hf_config_dict
    from transformers import PretrainedConfig

    generic = json.loads(json.dumps(PretrainedConfig().to_dict()))  # as a config.json holds them
    plain = hf_config_dict(preset("debug"))
    (tmp_path / "config.json").write_text(json.dumps(plain))
    expected = read_hf_config(str(tmp_path))[0]
    (tmp_path / "config.json").write_text(json.dumps({**generic, **plain}))
    assert read_hf_config(str(tmp_path))[0] == expected
    (tmp_path / "config.json").write_text(json.dumps({**generic, **plain, "output_hidden_states": True}))
    with pytest.raises(ValueError, match="field output_hidden_states=True is not supported"):
        read_hf_config(str(tmp_path))
