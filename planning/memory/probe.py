"""What autograd keeps per block, measured: one dense and one MoE block are built on the CPU at the real widths
and run forward at two short sequence lengths and two expert counts under torch's MemTracker; the kept bytes
are fitted as a*S + b*S^2 + e*S*E per sequence of S tokens over E routed experts, for the memory estimates
(planning/memory/pretrain.py, teacher.py) to evaluate at a job's shapes. On a GPU the S^2 term (attention
probabilities, where the CPU runs the math SDPA kernel: GQA with a mask) is dropped: the fused kernels keep
only a log-sum-exp per row.

Private torch API: `torch.distributed._tools.mem_tracker.MemTracker` (checked on torch 2.13.0).
"""

import dataclasses
import functools

import torch
from torch import nn

PROBE_SEQ = (32, 64)  # the two sequence lengths of each probe


def build_block(model_config, layer_id: int, n_experts: int, dtype: torch.dtype) -> nn.Module:
    """Block `layer_id` at the real widths with `n_experts` routed experts, on the CPU, weights in
    `dtype` (routers fp32, as under the mixed-precision policy). Values only need to be finite. The probe's
    few experts form one routing group (group-limited routing, DeepSeek-V3's 8 groups, needs >= 2 experts
    per group; its [T, groups] scores are not what the fit measures)."""
    from models import TransformerBlock
    from models.moe import Router

    c = dataclasses.replace(model_config, n_routed_experts=n_experts, n_expert_groups=1, n_limited_groups=1)
    with torch.device("meta"):
        block = TransformerBlock(c, layer_id)
    block.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():  # random where cheap (the router spreads tokens), constant where large
            p.uniform_(-0.02, 0.02, generator=g) if p.numel() < 2**24 else p.fill_(0.01)
        for b in block.buffers():
            b.zero_()
    for m in block.modules():
        if isinstance(m, Router):
            m.float()
    return block


def kept_bytes(block: nn.Module, mode: str, seq: int, dtype: torch.dtype) -> int:
    """Bytes that stay alive after the block's forward on [1, seq] tokens (its output excluded)."""
    from torch.distributed._tools.mem_tracker import MemTracker  # private, checked on torch 2.13.0

    from parallel.activation_checkpoint import apply_activation_checkpoint, checkpoint_regions

    holder = nn.Module()
    holder.layers = nn.ModuleList([block])
    apply_activation_checkpoint(holder, mode)
    x = torch.randn(1, seq, block.attention_norm.weight.shape[0], requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        x_in = x.to(dtype) * 1.0  # a non-leaf input, freed unless the block keeps it
        out = block(x_in, torch.arange(seq))
        del x_in
        after = tracker.get_tracker_snapshot("current")
    if mode != "none":
        for module in checkpoint_regions(block, mode):
            module.region = module.region.inner  # the region's runner before checkpointing, for the next probe
    return snapshot_total(after) - snapshot_total(before) - out.numel() * out.element_size()


def snapshot_total(snapshot) -> int:
    """Bytes of a MemTracker snapshot, every device and category."""
    return sum(v["Total"] for v in snapshot.values())


@functools.lru_cache(maxsize=None)  # the same probes for every layout of one model (the whole-step rows)
def block_fits(model_config, layer_id: int, dtype, modes, moe: bool) -> dict:
    """{mode: (a, b, e)}: kept bytes per sequence of length S = a*S + b*S^2 (+ e*S*E for an MoE block)."""
    e1 = model_config.n_activated_experts if moe else model_config.n_routed_experts
    s1, s2 = PROBE_SEQ
    block = build_block(model_config, layer_id, e1, dtype)
    kept = {mode: (kept_bytes(block, mode, s1, dtype), kept_bytes(block, mode, s2, dtype)) for mode in modes}
    wider = build_block(model_config, layer_id, 2 * e1, dtype) if moe else None
    fits = {}
    for mode, (k1, k2) in kept.items():
        e = (kept_bytes(wider, mode, s1, dtype) - k1) / (s1 * e1) if moe else 0.0
        k1e, k2e = k1 - e * s1 * e1, k2 - e * s2 * e1  # k(S) = a S + b S^2 (+ e S E1)
        b = (k2e / s2 - k1e / s1) / (s2 - s1)
        fits[mode] = (k1e / s1 - b * s1, b, e)
    return fits
