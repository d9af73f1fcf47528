"""Independent plain-loop references shared by several test files: Muon on one parameter with each block
sliced and orthogonalized by hand (tests/unit/test_muon_reference.py, test_experts.py), and the documented
seeded-init stream written plainly (tests/ranks/test_seeded_init.py, test_experts.py)."""

import functools

import torch

from models.seeded_init import ROW_BLOCK_ELEMS, _seed
from optim.newton_schulz import lr_scale, orthogonalize


def naive_muon_step(p, grad, buf, kind, parts, config, lr):
    """Muon on one parameter, each block sliced by hand and orthogonalized alone. Returns (p, buf)."""
    ortho = functools.partial(orthogonalize, method=config.ns_method)
    buf = config.momentum * buf + grad
    u = grad + config.momentum * buf if config.nesterov else buf
    update = torch.zeros_like(p)
    if kind == "rows":
        r = p.shape[0] // parts
        for i in range(parts):
            update[i * r:(i + 1) * r, :] = ortho(u[i * r:(i + 1) * r, :]) * lr_scale(r, p.shape[1], "rms")
    elif kind == "cols":
        c = p.shape[1] // parts
        for i in range(parts):
            update[:, i * c:(i + 1) * c] = ortho(u[:, i * c:(i + 1) * c]) * lr_scale(p.shape[0], c, "rms")
    elif kind == "experts":
        for e in range(p.shape[0]):
            update[e] = ortho(u[e]) * lr_scale(p.shape[1], p.shape[2], "rms")
    else:
        update = ortho(u) * lr_scale(p.shape[0], p.shape[1], "rms")
    return p * (1 - lr * config.weight_decay) - lr * update, buf


def stream_reference(full_shape, std, seed, name) -> torch.Tensor:
    """The documented stream, written plainly: rows in blocks of R, block b's n values the first n of
    ceil(n / 16) * 16 normals from generator (seed, name, b)."""
    row_len = full_shape[-1]
    rows = torch.Size(full_shape[:-1]).numel()
    per_block = max(1, ROW_BLOCK_ELEMS // row_len)
    blocks = []
    for b in range(0, rows, per_block):
        g = torch.Generator().manual_seed(_seed(seed, name, b // per_block))
        n = min(per_block, rows - b) * row_len
        blocks.append(torch.empty(-(-n // 16) * 16).normal_(0.0, std, generator=g)[:n])
    return torch.cat(blocks).view(full_shape)
