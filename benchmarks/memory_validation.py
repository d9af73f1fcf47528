"""The memory estimate (launch/estimate_memory.py, device cpu) against measured peaks of real CPU steps.

    python benchmarks/memory_validation.py [--json PATH] [--quick]

For each case (preset x world size x activation checkpointing) ranks are forked (gloo), each builds
the job exactly as the runtime does (runtime/train.py: meta model, parallelize, seeded init, sharded
Muon) and runs one training step (forward/backward, clipping, optimizer step) under torch's
MemTracker (benchmarks/lib/memory_peak.py): the peak of all live tensors on rank 0 (parameters,
gradients, optimizer state, FSDP buffers, activations, temporaries). Prints estimate, measured and
their ratio per case.
"""

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python benchmarks/memory_validation.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (FSDP2 imports it lazily; import once before forking)

from benchmarks.lib.memory_peak import track_peak  # noqa: E402
from launch.estimate_memory import Job, estimate  # noqa: E402
from multirank import run_ranks  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from runtime import train as T  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402

COMMON = ["--data.source=synthetic", "--training.warmup_steps=1", "--checkpoint.interval=0"]
PRESETS = {
    "debug": ["--data.seq_len=128", "--data.batch_size=16"],
    "wide": ["--model.dim=256", "--model.n_layers=4", "--model.inter_dim=512", "--model.moe_inter_dim=256",
             "--model.n_routed_experts=16", "--model.n_activated_experts=4", "--model.n_heads=8",
             "--model.q_lora_rank=128", "--model.kv_lora_rank=128", "--model.qk_nope_head_dim=32",
             "--model.qk_rope_head_dim=16", "--model.v_head_dim=32", "--model.vocab_size=2048",
             "--data.seq_len=256", "--data.batch_size=8"],
}


def _argv(preset: str, checkpointing: str, run_dir: str, param_dtype: str = "float32") -> list[str]:
    return COMMON + PRESETS[preset] + [f"--training.activation_checkpoint={checkpointing}", f"--run.dir={run_dir}",
                                       f"--training.param_dtype={param_dtype}"]


def _measure(rank, world_size, argv):
    config = load_config(argv)
    layout = config.layout(world_size)
    meshes = build_meshes(layout, "cpu")
    device = torch.device("cpu")
    model = T.build_model(config, meshes, layout, device)
    optimizer = T.build_optimizer(model, config)
    loader = T.build_loader(config, meshes, layout)
    with track_peak(model, optimizers=(optimizer,)) as peak:
        T.forward_backward(model, loader.next_step(), config.data.tokens_per_step(), device)
        T.clip_grad_norm_(model.parameters(), config.training.grad_clip)
        optimizer.step()
    return peak()["Total"]


@user_errors
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="debug preset on 1 and 2 ranks only")
    ap.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    check_outputs([("--json", args.json)])
    rows = []
    for preset in ("debug",) if args.quick else tuple(PRESETS):
        for world in (1, 2) if args.quick else (1, 2, 4):
            for checkpointing in ("none", "full"):
                argv_case = _argv(preset, checkpointing, "/tmp/memory_validation", args.param_dtype)
                config = load_config(argv_case)
                est = estimate(Job(config, config.layout(world), 0, "cpu"))["total_gib"] * 2**30
                measured = run_ranks(_measure, world, argv_case, timeout=600)[0]
                rows.append({"preset": preset, "world": world, "activation_checkpoint": checkpointing,
                             "param_dtype": args.param_dtype,
                             "estimate_mib": est / 2**20, "measured_mib": measured / 2**20, "ratio": est / measured})
                print(f"{preset:6s} {args.param_dtype} world {world} {checkpointing:5s} estimate {est / 2**20:8.2f} MiB  "
                      f"measured {measured / 2**20:8.2f} MiB  ratio {est / measured:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
