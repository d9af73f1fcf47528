"""The train_step section of benchmarks/gpu_check.py: one real training step of the runtime on one device (a
world of one), on moonlight_16b widths with as many layers as the weights, gradients and optimizer state
leave room for (`state_bytes`); tokens/s, MFU, peak memory, host syncs. benchmarks/gpu_check_paths.py's
train_variants section runs the same steps with other settings.
"""

import gc

import torch

from benchmarks.gpu_check_compile import random_normal_


def section_train_step(ctx) -> dict:
    """One real training step of the runtime on one device (a world of 1), largest that fits."""
    import torch.distributed as dist

    from runtime.metrics import flops_per_token, peak_flops

    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    capacity = (torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda"
                else 8 << 30)
    argv = train_argv(ctx.small, ctx.device, capacity)
    out = {"argv": argv}
    steps = 1 if ctx.small else 3
    try:
        out.update(train_steps(ctx, argv, steps))
    except torch.cuda.OutOfMemoryError as e:  # the estimate was too optimistic: half the layers, once
        out["first_attempt"] = f"out of memory: {str(e).splitlines()[0]}"
    if "first_attempt" in out:  # retried outside the handler, so the failed attempt's frames are freed
        gc.collect()
        torch.cuda.empty_cache()
        argv = train_argv(ctx.small, ctx.device, capacity, layer_fraction=0.5)
        out.update(argv=argv, **train_steps(ctx, argv, steps))
    config = out.pop("_config")
    seq = config.data.seq_len
    fpt = flops_per_token(config.model, seq)
    peak = peak_flops(torch.cuda.get_device_name(ctx.device)) if ctx.device.type == "cuda" else None
    out["tokens_per_s"] = config.data.tokens_per_step() / out["step_time_s"]
    out["model_tflops_per_s"] = fpt * out["tokens_per_s"] / 1e12
    out["mfu"] = out["model_tflops_per_s"] * 1e12 / peak if peak else None
    return out


TRAIN_STATE_FRACTION = 0.45  # of device memory for weights, grads and optimizer state; the rest: activations


def train_argv(small: bool, device: torch.device, capacity: int, layer_fraction: float = 1.0) -> list[str]:
    """Overrides for the step: moonlight_16b widths, layers chosen by `state_bytes` (debug if small)."""
    from models import preset

    common = ["--data.source=synthetic", "--checkpoint.interval=0", "--training.steps=100",
              "--training.warmup_steps=1", f"--training.device={device.type}", "--run.dir=/tmp/twinmesh_gpu_check"]
    if small:
        return common + ["--model.preset=debug", "--data.seq_len=32", "--data.batch_size=4"]
    layers = 2
    while layers < 27 and state_bytes(preset("moonlight_16b", n_layers=layers + 1)) <= TRAIN_STATE_FRACTION * capacity:
        layers += 1
    layers = max(2, int(layers * layer_fraction))
    return common + ["--model.preset=moonlight_16b", f"--model.n_layers={layers}", "--data.seq_len=4096",
                     "--data.batch_size=2", "--training.param_dtype=bfloat16"]


def state_bytes(config) -> int:
    """Estimated bytes of fp32 weights + fp32 gradients + optimizer state: Muon momentum (4 B) for
    the declared matrices, AdamW moments (8 B) for the rest; activations are not estimated."""
    from models import Transformer
    from models.splits import muon_splits

    with torch.device("meta"):
        model = Transformer(config)
    muon = muon_splits(model)
    total = 0
    for name, p in model.named_parameters():
        total += p.numel() * (4 + 4 + (4 if name in muon else 8))
    return total


def train_steps(ctx, argv, steps: int = 3) -> dict:
    from parallel.meshes import build_meshes
    from runtime import train as T
    from runtime.config_parser import load_config
    from runtime.syncs import count_syncs, mark_optimizer_host_state

    config = load_config(argv)
    layout = config.layout(1)
    meshes = build_meshes(layout, ctx.device.type)
    model = build_model_quick(config, meshes, layout, ctx.device)
    optimizer = T.build_optimizer(model, config)
    scheduler = T.build_scheduler(optimizer, config.training)
    loader = T.build_loader(config, meshes, layout)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    ctx.progress(f"train_step: {config.model.n_layers} layers, {config.data.tokens_per_step()} tokens; warm-up step")
    first = T.train_step(model, optimizer, scheduler, loader, config, ctx.device)
    mark_optimizer_host_state(optimizer)
    with count_syncs(ctx.device.type) as syncs:
        counted = T.train_step(model, optimizer, scheduler, loader, config, ctx.device)
    times = [T.train_step(model, optimizer, scheduler, loader, config, ctx.device) for _ in range(steps)]
    step_times = sorted(s["step_time_s"] for s in times)
    out = {"_config": config, "n_layers": config.model.n_layers, "tokens_per_step": config.data.tokens_per_step(),
           "first_step_s": first["step_time_s"], "step_time_s": step_times[len(step_times) // 2],
           "optimizer_time_s": sorted(s["optimizer_time_s"] for s in times)[len(times) // 2],
           "losses": [first["loss"], counted["loss"]] + [s["loss"] for s in times],
           "clipped_heads": [s.get("clipped_heads") for s in (first, counted, *times)],
           "host_syncs": syncs.as_dict(), "state_bytes_estimate_gib": state_bytes(config.model) / 2**30}
    if ctx.device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    del model, optimizer
    return out


def build_model_quick(config, meshes, layout, device):
    """runtime.train.build_model (so FSDP mixed precision, activation checkpointing and prefetch are
    the run's), but random normal weights drawn on the device instead of the seeded,
    layout-independent init (which draws on the CPU row by row: minutes for billions)."""
    from runtime import train as T

    return T.build_model(config, meshes, layout, device, init=random_normal_)
