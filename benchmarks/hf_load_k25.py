"""Load time, bytes read and peak RSS per rank for a K2.5-shaped checkpoint in bf16, FP8 and K2.5's INT4 layout.

    python benchmarks/hf_load_k25.py --make DIR                          # DIR/bf16, DIR/fp8, DIR/int4 (~1.8, 1.0, 0.7 GB)
    torchrun --nproc_per_node N benchmarks/hf_load_k25.py --dir DIR/int4 [--out results.jsonl]

The shape is Kimi K2's at full width where the reads happen (hidden 7168, 64 MLA heads with K2's ranks,
routed experts of 2048 x 7168) with few of everything else: 2 layers (1 dense, 1 MoE), 8 routed experts,
a 16k vocabulary, so one CPU machine holds it. The three directories hold the same weights:
    bf16  every tensor bf16 (the exporter's layout)
    fp8   DeepSeek-V3 / Kimi K2: linear weights but embedding, head and router float8_e4m3fn with a
          float32 scale per 128 x 128 block
    int4  Kimi K2.5: the multimodal wrapper config, `language_model.` keys, routed experts compressed-tensors
          INT4 (group 32, bf16 scales; models/hf/int4.py), a 40 MB bf16 vision tower
Measurement: benchmarks/hf_load.py `measure` (the runtime's default layout for N ranks, `load_state` timed,
ru_maxrss, which counts the touched pages of the memory-mapped files as well as the model shards).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from benchmarks.hf_load import load_and_report  # noqa: E402
from models import Transformer, preset  # noqa: E402
from models.hf import int4  # noqa: E402
from models.hf.check import is_linear  # noqa: E402
from models.hf.checkpoint import save_pretrained  # noqa: E402
from models.hf.files import INDEX, TensorRecord, write_shards  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402

SHAPE = dict(vocab_size=16384, dim=7168, n_layers=2, n_dense_layers=1, n_heads=64, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, inter_dim=2048, moe_inter_dim=2048,
             n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, max_seq_len=4096, latent_norm_eps=1e-6)
FP8_BLOCK = 128
VISION = {f"vision_tower.encoder.blocks.{i}.mlp.fc0.weight": (4304, 1152) for i in range(4)}
VISION["mm_projector.proj.0.weight"] = (4608, 4608)
K25_QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [
    "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
    "re:.*vision_tower.*", "re:.*mm_projector.*"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}


def make(directory: str) -> None:
    model = Transformer(preset("debug", **SHAPE))
    model.init_weights(torch.Generator().manual_seed(0))
    save_pretrained(model, os.path.join(directory, "bf16"), dtype=torch.bfloat16, shard_bytes=2**28)
    del model
    convert(os.path.join(directory, "bf16"), os.path.join(directory, "fp8"), "fp8")
    convert(os.path.join(directory, "bf16"), os.path.join(directory, "int4"), "int4")


def convert(src: str, dst: str, fmt: str) -> None:
    """The bf16 directory `src` as `fmt` ("fp8" or "int4"), tensor by tensor."""
    with open(os.path.join(src, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    records = []
    for key, name in weight_map.items():
        def read(key=key, name=name):
            with safe_open(os.path.join(src, name), framework="pt") as f:
                return f.get_tensor(key).float()
        with safe_open(os.path.join(src, name), framework="pt") as f:
            shape = tuple(f.get_slice(key).get_shape())
        records += _fp8_records(key, shape, read) if fmt == "fp8" else _int4_records(key, shape, read)
    if fmt == "int4":
        g = torch.Generator().manual_seed(1)
        records += [TensorRecord(k, s, torch.bfloat16, lambda s=s: torch.randn(s, generator=g).to(torch.bfloat16))
                    for k, s in VISION.items()]
    write_shards(records, dst, 2**28)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    else:
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "vision_config": {"vt_hidden_size": 1152}, "text_config": dict(config, model_type="kimi_k2",
                                                                                 quantization_config=K25_QUANT)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _fp8_records(key, shape, read) -> list[TensorRecord]:
    if not (len(shape) == 2 and is_linear(key) and key != "lm_head.weight"):
        return [TensorRecord(key, shape, torch.bfloat16, lambda: read().to(torch.bfloat16))]
    rows, cols = -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)
    cache = {}

    def part(i):
        if not cache:
            w = read()
            padded = torch.nn.functional.pad(w, (0, cols * FP8_BLOCK - w.shape[1], 0, rows * FP8_BLOCK - w.shape[0]))
            blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
            scale = blocks.abs().amax((1, 3)).clamp_min(1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).view_as(padded)[: w.shape[0], : w.shape[1]]
            cache["t"] = (q.to(torch.float8_e4m3fn), scale)
        return cache["t"][0] if i == 0 else cache.pop("t")[1]

    return [TensorRecord(key, shape, torch.float8_e4m3fn, lambda: part(0)),
            TensorRecord(key + "_scale_inv", (rows, cols), torch.float32, lambda: part(1))]


def _int4_records(key, shape, read) -> list[TensorRecord]:
    full = "language_model." + key
    if ".mlp.experts." not in key:
        return [TensorRecord(full, shape, torch.bfloat16, lambda: read().to(torch.bfloat16))]
    cache, base = {}, full[: -len("weight")]

    def part(i):
        if not cache:
            cache["t"] = int4.quantize(read(), torch.bfloat16)
        return cache["t"][0] if i == 0 else cache.pop("t")[1]

    rows, cols = shape
    return [TensorRecord(base + "weight_packed", (rows, cols // int4.PER_WORD), torch.int32, lambda: part(0)),
            TensorRecord(base + "weight_scale", (rows, cols // int4.GROUP), torch.bfloat16, lambda: part(1)),
            TensorRecord(base + "weight_shape", (2,), torch.int64, lambda: torch.tensor([rows, cols]))]


@user_errors
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", help="write DIR/bf16, DIR/fp8 and DIR/int4 and exit")
    parser.add_argument("--dir", help="the checkpoint to load")
    parser.add_argument("--out", default="", help="append the result (JSON line) to this file")
    args = parser.parse_args(argv)
    check_outputs([("--out", args.out)], [("--dir", args.dir or "")])  # --out appends: never onto a shard
    if args.make:
        make(args.make)
        return 0
    load_and_report(args.dir, args.out, checkpoint=os.path.basename(os.path.normpath(args.dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
