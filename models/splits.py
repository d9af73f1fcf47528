"""How Muon cuts a parameter into the matrices (blocks) it orthogonalizes.

Each module that owns a Muon parameter declares, next to its code, one `MatrixSplit` per parameter
in a `muon_splits()` method (local parameter name -> split). `muon_splits(model)` collects them with
fully qualified names. Parameters without a declaration (embeddings, output head, norms, biases,
the router's expert bias) are stepped by AdamW. The optimizer never guesses from names or shapes.

Block layouts (r = rows, c = cols of one block, n = number of blocks):
  whole    [r, c]      -> one block [r, c]
  rows     [n*r, c]    -> n blocks [r, c]  (per head along output rows: q/k/v up-projections)
  cols     [r, n*c]    -> n blocks [r, c]  (per head along input cols: attention output projection)
  experts  [n, r, c]   -> n blocks [r, c]  (stacked routed experts)
  experts  [n, k*r, c] -> n*k blocks [r, c], expert-major (parts=k: each expert's matrix cut into k
                          row blocks; the fused w1/w3 of the routed experts, k=2, so Muon
                          orthogonalizes w1[e] and w3[e] apart, as it would two separate parameters)
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

KINDS = ("whole", "rows", "cols", "experts")


@dataclass(frozen=True)
class MatrixSplit:
    kind: str
    parts: int = 1  # blocks along the split dim for "rows"/"cols", along each expert's rows for "experts"

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        assert self.parts >= 1

    def num_blocks(self, shape: tuple[int, ...]) -> int:
        if self.kind == "experts":
            return shape[0] * self.parts
        return self.parts if self.kind in ("rows", "cols") else 1

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        if self.kind == "experts":
            assert len(shape) == 3 and shape[1] % self.parts == 0, (shape, self.parts)
            return shape[1] // self.parts, shape[2]
        assert len(shape) == 2, shape
        r, c = shape
        if self.kind == "rows":
            assert r % self.parts == 0, (shape, self.parts)
            return r // self.parts, c
        if self.kind == "cols":
            assert c % self.parts == 0, (shape, self.parts)
            return r, c // self.parts
        return r, c

    def block_boxes(self, shape: tuple[int, ...]) -> np.ndarray:
        """[num_blocks, ndim, 2] (start, stop) of each block in parameter coordinates, in block order."""
        n, (r, c) = self.num_blocks(shape), self.block_shape(shape)
        boxes = np.zeros((n, len(shape), 2), dtype=np.int64)
        boxes[..., 1] = shape
        i = np.arange(n)
        if self.kind == "experts":  # block i: expert i // parts, its rows [(i % parts) * r, ... + r)
            boxes[:, 0, 0], boxes[:, 0, 1] = i // self.parts, i // self.parts + 1
            boxes[:, 1, 0], boxes[:, 1, 1] = i % self.parts * r, (i % self.parts + 1) * r
            return boxes
        dim, size = {"rows": (0, r), "cols": (1, c), "whole": (0, shape[0])}[self.kind]
        boxes[:, dim, 0], boxes[:, dim, 1] = i * size, (i + 1) * size
        return boxes

    def to_blocks(self, full: torch.Tensor) -> torch.Tensor:
        """Full parameter -> [num_blocks, r, c] (a view where possible)."""
        n, (r, c) = self.num_blocks(full.shape), self.block_shape(full.shape)
        if self.kind == "cols":
            return full.view(r, n, c).transpose(0, 1)
        return full.reshape(n, r, c)

    def from_blocks(self, blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """[num_blocks, r, c] -> full parameter of `shape` (inverse of `to_blocks`)."""
        if self.kind == "cols":
            return blocks.transpose(0, 1).reshape(shape)
        return blocks.reshape(shape)


WHOLE = MatrixSplit("whole")
PER_EXPERT = MatrixSplit("experts")
PER_EXPERT_GATED = MatrixSplit("experts", 2)  # routed experts' w13 [E, 2F, D]: w1[e] and w3[e] apart


def per_head_rows(n_heads: int) -> MatrixSplit:
    return MatrixSplit("rows", n_heads)


def per_head_cols(n_heads: int) -> MatrixSplit:
    return MatrixSplit("cols", n_heads)


def muon_splits(model: nn.Module) -> dict[str, MatrixSplit]:
    """Fully qualified parameter name -> split, for every parameter some module declares."""
    out = {}
    for prefix, module in model.named_modules():
        declare = getattr(module, "muon_splits", None)
        if declare is None:
            continue
        for name, split in declare().items():
            out[f"{prefix}.{name}" if prefix else name] = split
    return out
