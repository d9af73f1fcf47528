"""Hugging Face DeepSeek-V3 checkpoints: our model's logits equal `transformers`' (the outside reference),
FP8 block dequantization is exact, bad directories fail in one line, exports load back into `transformers`."""

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from hf_cases import _DEEPSEEK_V3, _KIMI_K2, BLOCK, REL_TOL, _fp8_copy, _rel_err, _tokens  # noqa: E402
from hf_reference import CASES, hf_config, hf_logits, random_hf_model  # noqa: E402
from models.hf.check import check_checkpoint  # noqa: E402
from models.hf.checkpoint import load_pretrained, load_state, save_pretrained  # noqa: E402
from models.hf.config import read_hf_config  # noqa: E402
from models.hf.files import CheckpointFiles  # noqa: E402
from models.model import Transformer  # noqa: E402

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

@pytest.mark.parametrize("raw, preset_name", [(_DEEPSEEK_V3, "deepseek_v3_671b"), (_KIMI_K2, "kimi_k2_1t")])
def test_published_configs_map_to_the_presets_shapes(raw, preset_name):
    """Every shape field equals the hand-written preset; only what the presets leave out differs."""
    from models import preset
    from models.hf.config import checkpoint_format, model_config

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
    from models.hf.config import hf_config_dict
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
