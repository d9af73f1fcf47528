"""The risky paths of benchmarks/gpu_check.py: what a world of one GPU can check that nothing else has run
on CUDA. Each section raises `PathMismatch` naming what differed (gpu_check records it as the section's
error and goes on), and returns the figures it compared.

  cp_attention      context parallelism's local attention (`balanced_chunk_attention`: the flash pair of
                    models/block_attention.py merged by log-sum-exp) for cp = 2 and 4, every cp rank,
                    forward and backward in bf16, MLA (q/k 192, v 128) and GQA (128) shapes, against an
                    fp32 SDPA of the whole sequence. Yardstick: one plain bf16 SDPA call of the whole
                    sequence against the same fp32 reference; the chunked pieces may be at most
                    CP_TOLERANCE x that (tests/ranks/test_attention.py measured <= 1.7x on the CPU kernels).
  grouped_mm_empty  grouped matmuls (models/experts.py, `torch._grouped_mm`) with some expert groups empty
                    and with all of them empty (x of 0 rows): the output has the right shape, empty
                    experts' weight gradients are exactly 0, and the other experts' output and gradients
                    match a per-expert loop of plain matmuls within the bf16-vs-fp32 yardstick.
  train_variants    the runtime's training step (as gpu_check's train_step, fewer layers) with full
                    activation checkpointing and with QK-clip on (tau low enough that heads clip): finite
                    losses, the clip's maxima recorded, one host sync per step.

Relative errors are Frobenius norms: ||got - ref|| / ||ref||.
"""

import torch
import torch.nn.functional as F

CP_TOLERANCE = 2.5  # x the single bf16 SDPA call's error (tests/ranks/test_attention.py: measured <= 1.7x)
GROUPED_TOLERANCE = 2.0  # x the bf16 loop's error: two bf16 roundings of one result


class PathMismatch(AssertionError):
    """A risky path's result differs from its reference by more than the stated tolerance."""


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _sdpa_forward_backward(q, k, v, grad_out, scale):
    """(out, dq, dk, dv) of one causal SDPA call over the whole sequence."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _cp_forward_backward(q, k, v, grad_out, scale, cp):
    """(out, dq, dk, dv) of the whole sequence assembled from every cp rank's `balanced_chunk_attention`:
    each rank's queries over all keys; the key/value gradients summed over ranks (as the cp all-gather's
    backward reduce-scatters them)."""
    from parallel.context_parallel import balanced_chunk_attention, load_balanced_positions

    S = q.shape[2]
    out, dq = torch.empty_like(q[..., :v.shape[-1]]), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for rank in range(cp):
        pos = load_balanced_positions(S, cp, rank).to(q.device)
        q_r, k_r, v_r = (t.detach().clone().requires_grad_() for t in (q[:, :, pos], k, v))
        o = balanced_chunk_attention(q_r, k_r, v_r, rank, cp, scale)
        o.backward(grad_out[:, :, pos].to(o.dtype))
        out[:, :, pos], dq[:, :, pos] = o.detach(), q_r.grad
        dk += k_r.grad.float()
        dv += v_r.grad.float()
    return [out, dq, dk, dv]


def section_cp_attention(ctx) -> dict:
    from models.block_attention import flash_with_lse_available

    B, S = (1, 4096) if not ctx.small else (1, 48)
    shapes = {"mla": (16, 192, 128), "gqa": (16, 128, 128)} if not ctx.small else \
        {"mla": (2, 24, 16), "gqa": (2, 16, 16)}
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    out = {"seq": S, "tolerance_x_yardstick": CP_TOLERANCE}
    failures = []
    for name, (H, QK, V) in shapes.items():
        q, k = (torch.randn(B, H, S, QK, device=ctx.device, generator=gen) for _ in range(2))
        v = torch.randn(B, H, S, V, device=ctx.device, generator=gen)
        grad_out = torch.randn(B, H, S, V, device=ctx.device, generator=gen)
        scale = QK**-0.5
        ref = _sdpa_forward_backward(q, k, v, grad_out, scale)
        bf16 = [t.bfloat16() for t in (q, k, v)]
        yard = [rel_error(a, b) for a, b in zip(_sdpa_forward_backward(*bf16, grad_out, scale), ref)]
        row = {"flash_pair": flash_with_lse_available(bf16[0]),
               "yardstick": dict(zip(("out", "dq", "dk", "dv"), yard))}
        for cp in (2, 4):
            got = [rel_error(a, b) for a, b in zip(_cp_forward_backward(*bf16, grad_out, scale, cp), ref)]
            row[f"cp{cp}"] = dict(zip(("out", "dq", "dk", "dv"), got))
            failures += [f"{name} cp={cp} {t}: error {e:.3g} > {CP_TOLERANCE} x single call's {y:.3g}"
                         for t, e, y in zip(("out", "dq", "dk", "dv"), got, yard) if not e <= CP_TOLERANCE * y + 1e-6]
        out[name] = row
    if failures:
        raise PathMismatch("; ".join(failures))
    return out


def _loop_reference(x_TD, w_EOD, counts):
    """Plain per-expert matmuls (the outside reference: no grouped kernel)."""
    chunks = x_TD.split(counts)
    return torch.cat([c @ w_EOD[e].T for e, c in enumerate(chunks)]) if chunks else x_TD.new_zeros(0, w_EOD.shape[1])


def _grouped_case(ctx, counts: list[int], E: int, D: int, O: int) -> dict:
    from models.experts import grouped_linear

    gen = torch.Generator(device=ctx.device).manual_seed(len(counts) + sum(counts))
    x32 = torch.randn(sum(counts), D, device=ctx.device, generator=gen)
    w32 = torch.randn(E, O, D, device=ctx.device, generator=gen) * D**-0.5
    g32 = torch.randn(sum(counts), O, device=ctx.device, generator=gen)
    counts_E = torch.tensor(counts, dtype=torch.int64, device=ctx.device)

    def run(fn, x, w, g):
        x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = fn(x, w)
        y.backward(g.to(y.dtype))
        return y.detach(), x.grad, w.grad

    got = run(lambda x, w: grouped_linear(x, w, counts_E), x32.bfloat16(), w32.bfloat16(), g32)
    ref = run(lambda x, w: _loop_reference(x, w, counts), x32, w32, g32)
    loop = run(lambda x, w: _loop_reference(x, w, counts), x32.bfloat16(), w32.bfloat16(), g32)
    empty = [e for e, c in enumerate(counts) if c == 0]
    problems = []
    if got[0].shape != (sum(counts), O):
        problems.append(f"output shape {tuple(got[0].shape)} != {(sum(counts), O)}")
    if got[2] is None or (empty and got[2][empty].abs().max().item() != 0):
        problems.append(f"empty experts {empty}: weight gradient not exactly 0")
    errors = {}
    if sum(counts):
        for name, a, b, y in zip(("out", "dx", "dw"), got, ref, loop):
            e, yard = rel_error(a, b), rel_error(y, b)
            errors[name] = {"error": e, "loop_bf16": yard}
            if not e <= GROUPED_TOLERANCE * yard + 1e-6:
                problems.append(f"{name}: error {e:.3g} > {GROUPED_TOLERANCE} x bf16 loop's {yard:.3g}")
    return {"counts": counts, "errors": errors, "problems": problems}


def section_grouped_mm_empty(ctx) -> dict:
    E, D, O = (8, 7168, 4096) if not ctx.small else (4, 32, 16)
    rows = 256 if not ctx.small else 8
    cases = {"some_empty": [rows, 0, 3 * rows, 0] + [rows] * (E - 4), "all_empty": [0] * E}
    out = {name: _grouped_case(ctx, counts, E, D, O) for name, counts in cases.items()}
    if problems := [f"{name}: {p}" for name, r in out.items() for p in r["problems"]]:
        raise PathMismatch("; ".join(problems))
    return out


def section_train_variants(ctx) -> dict:
    """Two short runs of the runtime's step: full activation checkpointing, and QK-clip with a tau low
    enough to clip (the recording, the MAX all-reduce and the in-place row scaling all run)."""
    import math

    import torch.distributed as dist

    from benchmarks.gpu_check_train import train_argv, train_steps

    if not dist.is_initialized():
        dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)

    capacity = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda" else 8 << 30
    base = train_argv(ctx.small, ctx.device, capacity)
    if not ctx.small:  # two layers: the paths, not the rate (train_step measures that)
        base = [a for a in base if not a.startswith("--model.n_layers")] + ["--model.n_layers=2"]
    variants = {"activation_checkpoint_full": ["--training.activation_checkpoint=full"],
                "qk_clip": ["--optim.qk_clip_tau=0.01"]}
    out, problems = {}, []
    for name, extra in variants.items():
        result = train_steps(ctx, base + extra, steps=1)
        result.pop("_config")
        out[name] = result
        if not all(math.isfinite(x) for x in result["losses"]):
            problems.append(f"{name}: non-finite losses {result['losses']}")
        if name == "qk_clip" and not all(result["clipped_heads"]):
            problems.append(f"qk_clip: heads clipped per step {result['clipped_heads']}, expected > 0 at tau 0.01")
        if result["host_syncs"]["total"] != 1:
            problems.append(f"{name}: {result['host_syncs']['total']} host syncs in a step, expected 1")
    if problems:
        raise PathMismatch("; ".join(problems))
    return out


SECTIONS = {"cp_attention": section_cp_attention, "grouped_mm_empty": section_grouped_mm_empty,
            "train_variants": section_train_variants}
