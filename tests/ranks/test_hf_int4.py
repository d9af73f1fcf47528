"""Kimi K2.5 / K2-Thinking checkpoints: compressed-tensors INT4 routed experts and the multimodal layout.

Outside references: `compressed-tensors` packs the INT4 words we read (and unpacks the ones we write),
`transformers` DeepseekV3ForCausalLM computes the logits from the exact dequantization; every
multi-rank load is compared with the one-process load."""

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from hf_reference import hf_config, hf_logits, random_hf_model  # noqa: E402
from int4_reference import int4_copy  # noqa: E402
from models.hf import int4  # noqa: E402
from models.hf.check import check_checkpoint  # noqa: E402
from models.hf.checkpoint import load_pretrained, load_state  # noqa: E402
from models.hf.config import read_hf_config  # noqa: E402
from models.hf.files import CheckpointFiles  # noqa: E402
from multirank import run_ranks  # noqa: E402
from hf_cases import REL_TOL, _rel_err, _tokens  # noqa: E402

# moe_intermediate_size 48: down_proj's input dim is 1.5 groups of 32, so a partial last group is read too
SHAPE = dict(moe_intermediate_size=48, n_routed_experts=8)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> directory: the transformers source, K2.5 layouts, a K2 layout, and the dequantized plain copy."""
    base = tmp_path_factory.mktemp("int4")
    out = {k: str(base / k) for k in ("src", "k25", "plain", "k25_root", "k2", "e4_src", "e4")}
    random_hf_model(hf_config(**SHAPE)).save_pretrained(out["src"])
    int4_copy(out["src"], out["k25"], out["plain"])
    int4_copy(out["src"], out["k25_root"], quant_at_root=True, scale_dtype=torch.float16)
    int4_copy(out["src"], out["k2"], k25=False)
    e4 = hf_config(**dict(SHAPE, n_routed_experts=4, n_group=2, topk_group=1))
    random_hf_model(e4, seed=1).save_pretrained(out["e4_src"])
    int4_copy(out["e4_src"], out["e4"], seed=1)
    return out


# ---- packing oracle and logits ---------------------------------------------------------------------

def test_unpack_and_pack_agree_with_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(0)
    for cols in (64, 48, 37):  # whole words, a partial group, a partial word
        q = torch.randint(-8, 8, (5, cols), generator=g, dtype=torch.int8)
        assert torch.equal(int4.unpack(pack_to_int32(q, 4))[:, :cols], q)
        assert torch.equal(unpack_from_int32(int4.pack(q), 4, torch.Size([5, cols])), q)


def test_int4_experts_load_as_exactly_q_times_scale(dirs):
    """Every parameter of the K2.5 directory equals the plain checkpoint holding q * scale in fp32."""
    got, ref = load_pretrained(dirs["k25"]).state_dict(), load_pretrained(dirs["plain"]).state_dict()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("name", ["k25_root", "k2"])
def test_root_quantization_config_and_k2_layout_load(dirs, name):
    """quantization_config at the root of a K2.5 config (fp16 scales), and a K2-layout directory with INT4
    experts: each loads as its own dequantization, and the non-expert weights as the source's."""
    config, fmt = read_hf_config(dirs[name])
    assert fmt.prefix == ("language_model." if name == "k25_root" else "") and fmt.int4 is not None
    model = load_pretrained(dirs[name]).state_dict()
    src = load_pretrained(dirs["src"]).state_dict()
    files = CheckpointFiles.scan(dirs[name], fmt.prefix)
    w2 = files.read_box("model.layers.1.mlp.experts.3.down_proj.weight", ((0, 32), (0, 48)), None)
    assert torch.equal(model["layers.1.feed_forward.experts.w2"][3], w2)
    for key in ("layers.1.attention.wkv_b.weight", "output.weight", "layers.2.feed_forward.shared_experts.w2.weight"):
        assert torch.equal(model[key], src[key]), key


def test_logits_equal_transformers_on_the_dequantized_weights(dirs):
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(dirs["plain"]).eval()
    with torch.no_grad():
        assert _rel_err(load_pretrained(dirs["k25"])(_tokens()), hf_logits(hf, _tokens())) < REL_TOL


def test_int4_box_reads_equal_slices_of_the_whole(dirs):
    """Any box (rows, unaligned columns, the partial last group) reads what cutting the whole tensor gives."""
    files = CheckpointFiles.scan(dirs["k25"], "language_model.")
    key = "model.layers.2.mlp.experts.5.down_proj.weight"  # [32, 48]
    whole = files.read_box(key, ((0, 32), (0, 48)), None)
    for box in (((0, 13), (0, 48)), ((13, 31), (5, 40)), ((3, 9), (33, 48)), ((7, 7), (0, 48)), ((0, 32), (31, 33))):
        assert torch.equal(files.read_box(key, box, None), whole[box[0][0]:box[0][1], box[1][0]:box[1][1]]), box


# ---- multi-rank -------------------------------------------------------------------------------------

from hf_cases import ARGS, HEADLINE, MATRIX_DIM, ep4_sharded_model  # noqa: E402


def _loaded(rank, world_size, cases, run_dir):
    """Per case: the full parameters on rank 0 after --model.init_from (no step)."""
    from parallel.meshes import build_meshes
    from runtime import train as T
    from runtime.config_parser import load_config

    out = {}
    for name, (path, parallel) in cases.items():
        config = load_config(ARGS + parallel + [f"--model.init_from={path}", f"--run.dir={run_dir}"])
        layout = config.layout(world_size)
        model = T.build_model(config, build_meshes(layout, "cpu"), layout, torch.device("cpu"))
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[name] = full if rank == 0 else None
    return out


def test_eight_ranks_load_the_single_process_parameters(dirs, tmp_path):
    cases = {"headline_cp2_ep8": (dirs["k25"], HEADLINE), "experts_on_matrix_dim": (dirs["e4"], MATRIX_DIM)}
    got = run_ranks(_loaded, 8, cases, str(tmp_path / "run"), timeout=300)[0]
    for name, (path, _) in cases.items():
        reference = load_pretrained(path).state_dict()
        for key, tensor in got[name].items():
            assert torch.equal(tensor, reference[key]), (name, key)


def _bytes_read(rank, world_size, path, run_dir):
    """(INT4 expert bytes, all tensor bytes) this rank reads for --model.init_from on dp_shard=4, ep=4."""
    model = ep4_sharded_model(path, run_dir, world_size)
    tally, read = [0], CheckpointFiles.read

    def counting(self, key, box):  # this forked rank's own copy of the class
        out = read(self, key, box)
        tally[0] += out.numel() * out.element_size() if key.endswith(("weight_packed", "weight_scale")) else 0
        return out

    CheckpointFiles.read = counting
    total = load_state(model, path)
    return tally[0], total


def test_each_of_four_ranks_reads_a_quarter_of_the_int4_experts(dirs, tmp_path):
    """ep=4 over 8 experts: each rank reads exactly its 2 experts' packed words and scales."""
    path = dirs["k25"]
    files = CheckpointFiles.scan(path, "language_model.")
    expert_bytes = 0
    for key in files.entries:
        if files.dtype_code(key) == "I4":
            for part in ("weight_packed", "weight_scale"):
                code, shape = files.int4_part(key, part)
                expert_bytes += torch.Size(shape).numel() * (4 if code == "I32" else 2)
    per_rank = run_ranks(_bytes_read, 4, path, str(tmp_path / "run"))
    one = load_state(load_pretrained(path), path)  # one process reads every tensor once
    print(f"INT4 expert bytes {expert_bytes}; one process reads {one} B; 4 ranks read (experts, all) {per_rank}")
    assert [experts for experts, _ in per_rank] == [expert_bytes // 4] * 4
    assert sum(total for _, total in per_rank) >= one and max(total for _, total in per_rank) < one / 2


# ---- bad input --------------------------------------------------------------------------------------

def _edit(src: str, dst: str, config_edit=None, tensor_edit=None) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config_edit:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump(config_edit(config), f)
    if tensor_edit:
        name = "model-00001-of-00002.safetensors"
        state = tensor_edit(load_file(os.path.join(dst, name)))
        save_file(state, os.path.join(dst, name), metadata={"format": "pt"})
    return dst


def _weights(config, **change):
    group = config["text_config"]["quantization_config"]["config_groups"]["group_0"]
    group["weights"].update(change)
    return config


def _targets(config, targets):
    config["text_config"]["quantization_config"]["config_groups"]["group_0"]["targets"] = targets
    return config


def _quant(config, **change):
    config["text_config"]["quantization_config"].update(change)
    return config


EXPERT = "language_model.model.layers.1.mlp.experts.2.up_proj."


def _reshape(part, shape, dtype=None):
    def edit(state):
        t = state[EXPERT + part]
        state[EXPERT + part] = torch.zeros(shape, dtype=dtype or t.dtype)
        return state
    return edit


BAD = {
    "method": (lambda c: _quant(c, quant_method="awq"), None,
               "quantization_config quant_method='awq' fmt=None is not supported"),
    "format": (lambda c: _quant(c, format="int-quantized"), None,
               "quant_method='compressed-tensors' format='int-quantized' is not supported (only 'pack-quantized')"),
    "bits": (lambda c: _weights(c, num_bits=8), None,
             "weights.num_bits=8 is not supported (supported: num_bits=4, type='int', symmetric=true, "
             "strategy='group', group_size=32)"),
    "group_size": (lambda c: _weights(c, group_size=128), None, "weights.group_size=128 is not supported"),
    "asymmetric": (lambda c: _weights(c, symmetric=False), None, "weights.symmetric=False is not supported"),
    "packed_shape": (None, _reshape("weight_packed", (48, 5)),
                     f"{EXPERT}weight_packed has shape [48, 5], weight_shape [48, 32] implies [48, 4]"),
    "scale_shape": (None, None, f"{EXPERT}weight_scale has shape [48, 2], weight_shape [48, 32] implies [48, 1]"),
    "weight_shape": (None, _reshape("weight_shape", (3,), torch.int64), f"{EXPERT}weight_shape is ['I64[3]']"),
    "no_text_config": (lambda c: {k: v for k, v in c.items() if k != "text_config"}, None,
                       "model_type='kimi_k25' (Kimi K2.5) has no text_config"),
    "ignore_covers_experts": (lambda c: _quant(c, ignore=c["text_config"]["quantization_config"]["ignore"]
                                               + ["re:.*experts.*"]), None,
                              "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed is INT4, but "
                              "quantization_config (targets ['Linear'], ignore ["),
    "linear_target_covers_attention": (lambda c: _quant(c, ignore=["re:.*lm_head"]), None,
                                       "F32, but quantization_config (targets ['Linear'], ignore ['re:.*lm_head']) "
                                       "quantizes language_model.model.layers.0.self_attn."),
    "targets_miss_the_experts": (lambda c: _targets(c, ["re:.*self_attn.*"]), None,
                                 "(targets ['re:.*self_attn.*'], ignore ['re:.*self_attn.*', "),
}


def _error(path: str) -> str:
    with pytest.raises(ValueError) as info:
        config, fmt = read_hf_config(path)
        check_checkpoint(path, config, fmt)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_int4_checkpoint_is_one_line(dirs, tmp_path, case):
    config_edit, tensor_edit, expected = BAD[case]
    if case == "scale_shape":  # the scales are in the second shard
        path = str(tmp_path / "bad")
        shutil.copytree(dirs["k25"], path)
        from safetensors.torch import load_file, save_file

        name = os.path.join(path, "model-00002-of-00002.safetensors")
        state = load_file(name)
        state[EXPERT + "weight_scale"] = torch.zeros(48, 2, dtype=torch.bfloat16)
        save_file(state, name, metadata={"format": "pt"})
    else:
        path = _edit(dirs["k25"], str(tmp_path / "bad"), config_edit, tensor_edit)
    assert expected in _error(path)


def test_plain_expert_where_the_config_quantizes_is_refused(dirs, tmp_path):
    """A K2-layout bf16 checkpoint whose config claims INT4 experts: named, not silently read."""
    path = str(tmp_path / "claims")
    shutil.copytree(dirs["src"], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    from int4_reference import QUANT

    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=QUANT), f)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight is F32, but quantization_config" in _error(path)


# ---- the published shape and the 256-GPU config ----------------------------------------------------

def test_k25_config_maps_to_the_kimi_k2_preset_and_the_256gpu_config_loads(tmp_path):
    """Kimi K2's published decoder fields inside a K2.5 wrapper (text_config + quantization_config) read as
    the kimi_k2_1t preset's shape, and configs/kimi_k25_256gpu.toml builds on them (Muon, QK-clip tau 100)."""
    import dataclasses

    from int4_reference import k25_config
    from models import preset
    from runtime.config_parser import load_config
    from hf_cases import _KIMI_K2

    (tmp_path / "config.json").write_text(json.dumps(k25_config({k: v for k, v in _KIMI_K2.items()
                                                                 if k != "quantization_config"})))
    config, fmt = read_hf_config(str(tmp_path))
    assert fmt.prefix == "language_model." and fmt.int4.targets == ("Linear",) and fmt.fp8_block is None
    shape = {"vocab_size", "dim", "n_layers", "n_dense_layers", "n_heads", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "inter_dim", "moe_inter_dim", "n_routed_experts",
             "n_shared_experts", "n_activated_experts", "route_scale"}
    ours, k2 = dataclasses.asdict(config), dataclasses.asdict(preset("kimi_k2_1t"))
    assert {k: ours[k] for k in shape} == {k: k2[k] for k in shape}
    job = load_config(["--config", "configs/kimi_k25_256gpu.toml", f"--model.init_from={tmp_path}"])
    assert job.model == config and job.optim.name == "muon" and job.optim.qk_clip_tau == 100.0
