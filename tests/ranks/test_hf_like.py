"""Export in the layout of the source (`save_like(model, out, SRC)`, `export_hf.py --like SRC`): a Kimi
K2.5-layout directory comes back with its nesting, config and vision/projector bytes, its routed experts
re-quantized to INT4 (checked with compressed-tensors' `unpack_from_int32`), and loads again in twinmesh
and, through its dequantization, in `transformers`."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from hf_reference import hf_config, hf_logits, random_hf_model  # noqa: E402
from int4_reference import VISION, int4_copy  # noqa: E402
from models.hf.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from models.hf.files import CheckpointFiles  # noqa: E402
from models.hf.like import save_like  # noqa: E402
from multirank import run_ranks  # noqa: E402
from hf_cases import ARGS, REL_TOL, _rel_err, _tokens  # noqa: E402

EXTRA_FILES = {"tiktoken.model": "YQ== 0\n", "tokenization_kimi.py": "# loader\n", "chat_template.jinja": "{{ x }}\n"}


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    """A K2.5-layout directory (INT4 experts, vision tower, projector, tokenizer files) and a smaller sibling."""
    base = tmp_path_factory.mktemp("like")
    random_hf_model(hf_config(moe_intermediate_size=48)).save_pretrained(str(base / "src"))
    int4_copy(str(base / "src"), str(base / "k25"))
    for name, text in EXTRA_FILES.items():
        (base / "k25" / name).write_text(text)
    random_hf_model(hf_config(moe_intermediate_size=48, n_routed_experts=4, n_group=2, topk_group=1)).save_pretrained(
        str(base / "e4_src"))
    int4_copy(str(base / "e4_src"), str(base / "e4"))
    return {"k25": str(base / "k25"), "e4": str(base / "e4")}


def _trained(path: str) -> torch.nn.Module:
    """The checkpoint's model, moved off the INT4 grid as training would (a fixed small perturbation)."""
    model = load_pretrained(path)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


def _raw(directory: str) -> dict:
    """key -> (dtype, bytes) of every stored tensor."""
    from safetensors import safe_open

    out = {}
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")):
        with safe_open(os.path.join(directory, name), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = (t.dtype, bytes(t.contiguous().view(torch.uint8).numpy()))
    return out


def _config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def _check_int4_export(model: torch.nn.Module, out: str):
    """Each exported expert's words unpack (compressed-tensors) to round(w / scale) of the model's weight w
    with the exported scale, and q * scale is within half a step of w."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    raw = _raw(out)
    state = model.state_dict()
    checked = 0
    for layer in range(1, model.config.n_layers):
        for e in range(model.config.n_routed_experts):
            F = model.config.moe_inter_dim
            w13 = state[f"layers.{layer}.feed_forward.experts.w13"][e]
            weights = {"gate_proj": w13[:F], "up_proj": w13[F:], "down_proj": state[f"layers.{layer}.feed_forward.experts.w2"][e]}
            for proj, w in weights.items():
                base = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}."
                rows, cols = w.shape
                packed = torch.frombuffer(bytearray(raw[base + "weight_packed"][1]), dtype=torch.int32).view(rows, -1)
                scale = torch.frombuffer(bytearray(raw[base + "weight_scale"][1]), dtype=torch.bfloat16).view(rows, -1)
                assert raw[base + "weight_scale"][0] == torch.bfloat16 and raw[base + "weight_shape"][0] == torch.int64
                assert torch.frombuffer(bytearray(raw[base + "weight_shape"][1]), dtype=torch.int64).tolist() == [rows, cols]
                q = unpack_from_int32(packed, 4, torch.Size([rows, cols]))
                step = scale.float().repeat_interleave(32, 1)[:, :cols]
                assert torch.equal(q.float(), torch.round(w / step).clamp(-8, 7)), base
                assert ((q.float() * step - w).abs() <= step / 2).all(), base
                checked += 1
    assert checked == 3 * (model.config.n_layers - 1) * model.config.n_routed_experts


def test_save_like_keeps_the_layout_and_requantizes_the_experts(k25, tmp_path):
    model, out = _trained(k25["k25"]), str(tmp_path / "out")
    save_like(model, out, k25["k25"], shard_bytes=60_000)
    assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1
    src, got = _raw(k25["k25"]), _raw(out)
    assert set(got) == set(src)  # the same keys: prefix, INT4 triples, vision tower, projector
    for key in VISION:
        assert got[key] == src[key], key  # byte for byte, same dtype
    assert _config(out) == _config(k25["k25"])
    for name, text in EXTRA_FILES.items():
        assert (tmp_path / "out" / name).read_text() == text
    _check_int4_export(model, out)
    reloaded = load_pretrained(out).state_dict()
    for name, tensor in model.state_dict().items():
        if ".experts.w" not in name and not name.endswith("tokens_per_expert"):
            assert torch.equal(reloaded[name], tensor), name  # fp32 export: the exact weights


def test_like_export_loads_into_transformers(k25, tmp_path):
    """The export's text model in transformers (from its exact dequantization) computes our logits."""
    from transformers import DeepseekV3ForCausalLM

    out, plain = str(tmp_path / "out"), str(tmp_path / "plain")
    save_like(_trained(k25["k25"]), out, k25["k25"])
    ours = load_pretrained(out)
    save_pretrained(ours, plain)  # the dequantized weights, as a DeepseekV3ForCausalLM directory
    hf = DeepseekV3ForCausalLM.from_pretrained(plain).eval()
    with torch.no_grad():
        assert _rel_err(ours(_tokens()), hf_logits(hf, _tokens())) < REL_TOL


def test_bf16_experts_export_is_exact_in_bf16(k25, tmp_path):
    model, out = _trained(k25["k25"]), str(tmp_path / "out")
    save_like(model, out, k25["k25"], dtype=torch.bfloat16, experts_dtype="bfloat16")
    config = _config(out)
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    assert config["vision_config"] == _config(k25["k25"])["vision_config"]
    reloaded = load_pretrained(out).state_dict()
    for name, tensor in model.state_dict().items():
        if not name.endswith(("tokens_per_expert", "expert_bias")):
            assert torch.equal(reloaded[name], tensor.to(torch.bfloat16).float()), name
    assert CheckpointFiles.scan(out, "language_model.").dtype_code("model.layers.1.mlp.experts.0.gate_proj.weight") == "BF16"


def test_like_a_plain_directory_in_bf16_says_bfloat16(k25, tmp_path):
    """SRC's config.json says float32 (transformers wrote fp32 weights); the export's bf16 weights say bf16."""
    src = os.path.join(os.path.dirname(k25["k25"]), "src")  # a plain DeepSeek-V3 directory
    named = {k: v for k, v in _config(src).items() if k in ("torch_dtype", "dtype") and v is not None}
    assert set(named.values()) == {"float32"}
    out = str(tmp_path / "out")
    save_like(load_pretrained(src), out, src, dtype=torch.bfloat16)
    assert {k: _config(out)[k] for k in named} == {k: "bfloat16" for k in named}
    assert CheckpointFiles.scan(out, "").dtype_code("model.layers.1.mlp.experts.0.gate_proj.weight") == "BF16"


def test_like_a_different_model_is_refused(k25, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"its text model differs from the exported model: n_routed_experts=4 there, "
                                         r"8 here"):
        save_like(load_pretrained(k25["k25"]), str(out), k25["e4"])
    assert not out.exists()


# ---- the user's path: init_from K2.5 -> one step on 2 ranks -> export_hf.py --like -> load ----------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_train_then_export_like_round_trip(k25, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from launch.export_hf import PREFIX, checkpoint_model_config, main as export_main
    from launch.pretrain import main
    from runtime import train as T

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "export")
    argv = ARGS + [f"--model.init_from={k25['k25']}", f"--run.dir={run_dir}", "--training.steps=1",
                   "--parallel.dp_shard=2", "--parallel.cp=1", "--parallel.ep=2", "--parallel.edp_shard=1"]
    assert run_ranks(lambda r, w: main(argv), 2, as_torchrun=True) == [0, 0]
    bad = str(tmp_path / "bad")
    assert export_main(["--run-dir", run_dir, "--out", bad, "--like", k25["e4"]]) == 2
    assert export_main(["--run-dir", run_dir, "--out", bad, "--experts-dtype", "bfloat16"]) == 2
    assert export_main(["--run-dir", run_dir, "--out", bad, "--like", k25["k25"], "--tokenizer", k25["k25"]]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "n_routed_experts=4 there, 8 here" in err[0] and "has no effect without --like" in err[1]
    assert f"--tokenizer {k25['k25']} has no effect with --like" in err[2]
    assert not os.path.exists(bad)
    assert export_main(["--run-dir", run_dir, "--out", out, "--like", k25["k25"], "--dtype", "float32"]) == 0
    step = os.path.join(run_dir, "checkpoints", "step_1")
    trained = T.Transformer(checkpoint_model_config(step))
    state = {PREFIX + k: v for k, v in trained.state_dict().items()}
    dcp.load(state, checkpoint_id=step, no_dist=True)
    trained.load_state_dict({k[len(PREFIX):]: v for k, v in state.items()})
    assert not torch.equal(trained.output.weight, load_pretrained(k25["k25"]).output.weight)  # it trained
    src, got = _raw(k25["k25"]), _raw(out)
    assert all(got[key] == src[key] for key in VISION) and _config(out) == _config(k25["k25"])
    _check_int4_export(trained, out)
    exported = load_pretrained(out).state_dict()
    for name, tensor in trained.state_dict().items():
        if ".experts.w" not in name and not name.endswith("tokens_per_expert"):
            assert torch.equal(exported[name], tensor), name
