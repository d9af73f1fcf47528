"""Single-process Muon + AdamW: the definition the sharded Muon must equal.

Muon (Moonlight form, Liu et al. 2025, arXiv 2502.16982) for every parameter with a declared
`MatrixSplit`; decoupled AdamW for the rest. Per Muon parameter p with gradient g:

    buf <- momentum * buf + g
    u   <- g + momentum * buf  (Nesterov)  or  buf
    O   <- orthogonalize(block) for every block of split.to_blocks(u)   [n, r, c]
    p   <- p * (1 - lr * wd) - lr * lr_scale(r, c) * split.from_blocks(O)

Per-head and per-expert blocks are orthogonalized (and lr-scaled) on their own; blocks of equal
(r, c, dtype) from ALL parameters are stacked into one batched Newton-Schulz call. The pieces below
(`momentum_update`, `orthogonalize_blocks` / `orthogonalize_stack`, `apply_update`, and
`optim.adamw.adamw_update`) are pure functions of tensors: the sharded Muon calls the same ones on
shards or gathered blocks, so both produce the same numbers up to the summation order of batched
matmuls: in fp32 that is last-bit noise (<= 1.4e-7 relative measured); in bf16, CPUs with AMX-bf16
round a batched matmul differently with the batch size, so sharded and reference agree only to bf16
rounding (tests/ranks/test_sharded_muon.py bounds it by the bf16-vs-fp32 difference of the same case).
"""

from collections.abc import Iterable

import torch
from torch import nn

from models.splits import MatrixSplit
from optim.adamw import adamw_update, init_adamw_state
from optim.config import OptimConfig, resolve_ns_dtype
from optim.newton_schulz import lr_scale, orthogonalize


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """buf <- momentum * buf + grad (in place); returns the direction to orthogonalize. Elementwise."""
    buf.mul_(momentum).add_(grad)
    return grad.add(buf, alpha=momentum) if nesterov else buf


def orthogonalize_stack(
    blocks_NRC: torch.Tensor, *, steps: int, coefficients: str, ns_dtype: torch.dtype, method: str = "standard",
    tf32: bool = False,
) -> torch.Tensor:
    """One batched Newton-Schulz over same-shape blocks, run in `ns_dtype`, returned in the input dtype."""
    out_NRC = orthogonalize(blocks_NRC.to(ns_dtype), steps=steps, coefficients=coefficients, method=method,
                            tf32=tf32)
    return out_NRC.to(blocks_NRC.dtype)


def group_by_shape(blocks: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """(r, c, dtype) -> indices into `blocks` (each [n_i, r, c]), groups in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault((b.shape[-2], b.shape[-1], b.dtype), []).append(i)
    return groups


def orthogonalize_blocks(
    blocks: list[torch.Tensor], *, steps: int, coefficients: str, ns_dtype: torch.dtype, method: str = "standard",
    tf32: bool = False,
) -> list[torch.Tensor]:
    """Orthogonalize each [n_i, r_i, c_i] of `blocks` with one `orthogonalize_stack` per shape group."""
    out: list[torch.Tensor | None] = [None] * len(blocks)
    for idx in group_by_shape(blocks).values():
        stack_NRC = torch.cat([blocks[i] for i in idx])
        done_NRC = orthogonalize_stack(stack_NRC, steps=steps, coefficients=coefficients, ns_dtype=ns_dtype,
                                       method=method, tf32=tf32)
        for i, piece in zip(idx, done_NRC.split([blocks[i].shape[0] for i in idx])):
            out[i] = piece
    return out


def apply_update(p: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float, scale: float) -> None:
    """p <- p * (1 - lr * wd) - lr * (scale * update), in place. Elementwise (works on shards)."""
    p.mul_(1 - lr * weight_decay)
    p.add_(update * scale, alpha=-lr)


def check_split(name: str, shape: tuple[int, ...], split: MatrixSplit) -> None:
    """ValueError unless `split` can cut a parameter of `shape` into equal blocks."""
    ndim = 3 if split.kind == "experts" else 2
    if len(shape) != ndim:
        raise ValueError(f"{name}: split {split.kind!r} needs a {ndim}-D parameter, got shape {tuple(shape)}")
    dim = {"rows": 0, "cols": 1, "experts": 1}.get(split.kind)  # experts: each expert's rows in `parts` blocks
    if dim is not None and shape[dim] % split.parts != 0:
        raise ValueError(f"{name}: {split.kind} split into {split.parts} parts, but dim {dim} of shape "
                         f"{tuple(shape)} is {shape[dim]}, not a multiple of {split.parts}")


def partition_params(
    named_params: Iterable[tuple[str, nn.Parameter]], splits: dict[str, MatrixSplit], config: OptimConfig
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon params, AdamW params), each a list of (name, param) in the given order."""
    named = list(named_params)
    unknown = sorted(set(splits) - {name for name, _ in named})
    if unknown:
        raise ValueError(f"splits name {len(unknown)} parameters that are not given: {unknown[:5]}")
    muon_names = set(splits) if config.name == "muon" else set()
    for name, p in named:
        if name in muon_names:
            check_split(name, tuple(p.shape), splits[name])
    return [(n, p) for n, p in named if n in muon_names], [(n, p) for n, p in named if n not in muon_names]


def param_groups(muon, adamw, config: OptimConfig) -> list[dict]:
    """The non-empty ones of the "muon" and "adamw" param groups (both with "lr", so LR schedulers scale
    both). An empty group is left out: distributed checkpoints key group settings by parameter name, so
    an empty group's settings would not survive a save and load."""
    muon_group = dict(params=[p for _, p in muon], kind="muon", lr=config.lr,
                      weight_decay=config.weight_decay, momentum=config.momentum, nesterov=config.nesterov,
                      ns_steps=config.ns_steps, coefficients=config.coefficients,
                      lr_adjust=config.lr_adjust, ns_dtype=config.ns_dtype,
                      ns_method=config.ns_method, ns_tf32=config.ns_tf32)
    adamw_group = dict(params=[p for _, p in adamw], kind="adamw", lr=config.lr,
                       weight_decay=config.weight_decay, betas=(config.adam_beta1, config.adam_beta2),
                       eps=config.adam_eps)
    return [g for g in (muon_group, adamw_group) if g["params"]] or [adamw_group]


def step_groups(optimizer, closure=None):
    """torch.optim step protocol over the "muon" and "adamw" groups: the optimizer's `_muon_step`
    and `_adamw_step` per group; returns the closure's loss."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        if group["kind"] == "muon":
            optimizer._muon_step(group)
        else:
            optimizer._adamw_step(group)
    return loss


class ReferenceMuon(torch.optim.Optimizer):
    """Muon for parameters named in `splits` (when config.name == "muon"), AdamW for the others.

    Param groups, both with "lr" (LR schedulers scale both): group["kind"] == "muon" and "adamw"
    (an empty one is left out). State: "momentum_buffer" for Muon parameters; "step" (tensor),
    "exp_avg", "exp_avg_sq" for AdamW parameters. Parameters whose grad is None are skipped.

    Step flow: 1. momentum, per Muon parameter; 2. Newton-Schulz, one batched call per block shape
    (across parameters); 3. apply the lr-scaled update with weight decay; 4. AdamW.
    """

    def __init__(
        self,
        named_params: nn.Module | Iterable[tuple[str, nn.Parameter]],
        splits: dict[str, MatrixSplit],
        config: OptimConfig,
    ):
        if isinstance(named_params, nn.Module):
            named_params = named_params.named_parameters()
        muon, adamw = partition_params(named_params, splits, config)
        # kept out of the param groups (which go into state dicts): parameter -> its split
        self.splits = {p: splits[name] for name, p in muon}
        super().__init__(param_groups(muon, adamw, config), defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        return step_groups(self, closure)

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        blocks = []  # phase 1: momentum, then each update direction cut into its blocks [n, r, c]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            u = momentum_update(self.state[p]["momentum_buffer"], p.grad, group["momentum"], group["nesterov"])
            blocks.append(self.splits[p].to_blocks(u))
        ns_dtype = resolve_ns_dtype(group["ns_dtype"], params[0].device if params else None)
        ortho = orthogonalize_blocks(blocks, steps=group["ns_steps"], coefficients=group["coefficients"],
                                     ns_dtype=ns_dtype, method=group.get("ns_method", "standard"),
                                     tf32=group.get("ns_tf32", False))  # phase 2
        for p, o_NRC in zip(params, ortho):  # phase 3
            split = self.splits[p]
            scale = lr_scale(*split.block_shape(p.shape), group["lr_adjust"])
            apply_update(p, split.from_blocks(o_NRC, p.shape), lr=group["lr"],
                         weight_decay=group["weight_decay"], scale=scale)

    def _adamw_step(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if not self.state[p]:
                self.state[p].update(init_adamw_state(p))
            adamw_update(p, p.grad, self.state[p], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                         weight_decay=group["weight_decay"])
