"""The distributed Muon designs we compare against, on the same sharded parameters as ours.

Each baseline uses the reference Muon's own pure pieces (`momentum_update`, `orthogonalize_blocks`,
`apply_update`, `lr_scale`), so it computes the reference update by construction; what differs is
only who gathers what and who orthogonalizes what. The benchmark still checks every result against
the single-process reference.

  GatherAll       Moonlight / ZeRO-1 ("Muon is Scalable", arXiv 2502.16982, Algorithm 1): every rank
                  all-gathers every full matrix (the momentum direction) and orthogonalizes all of
                  them, then keeps its own shard. No work is split, W x the NS FLOPs in total.
  OwnerAllGather  Keller Jordan / modded-nanogpt: parameters, largest first, are dealt round-robin to
                  owners in chunks of W; per chunk one all-to-all brings each owner the shards of
                  its parameter, the owner orthogonalizes it (per block), and one all-gather sends
                  every owner's full result to every rank (asynchronous: the next chunk's NS runs
                  while it is in flight, as in modded-nanogpt). Whole parameters, so the load is only
                  as balanced as the parameter sizes allow.
  Single          one process (rank 0) runs the reference Muon on full tensors; other ranks idle.

Parameters are DTensors whose shards are boxes of the global tensor (`models.boxes`); the
baselines need no replication (every rank holds a different shard), which the benchmark's layouts
guarantee.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from models.boxes import all_boxes
from optim.config import OptimConfig
from optim.muon_reference import ReferenceMuon, apply_update, momentum_update, orthogonalize_blocks
from optim.newton_schulz import lr_scale


def box_of_rank(p: DTensor) -> list[tuple[slice, ...]]:
    """For every global rank, the slices of the full tensor it holds (ValueError if replicated)."""
    mesh = p.device_mesh
    if any(isinstance(pl, Replicate) and n > 1 for pl, n in zip(p.placements, mesh.shape)):
        raise ValueError(f"placements {p.placements} on mesh {tuple(mesh.shape)}: the baselines need every rank "
                         f"to hold a different shard (no replication)")
    boxes = all_boxes(tuple(p.shape), tuple(mesh.shape), tuple(p.placements))  # [*mesh, ndim, 2]
    out = [None] * dist.get_world_size()
    for rank, box in zip(mesh.mesh.flatten().tolist(), boxes.reshape(-1, len(p.shape), 2)):
        out[rank] = tuple(slice(int(a), int(b)) for a, b in box)
    return out


class _MuonBase:
    def __init__(self, named_params: dict, splits: dict, config: OptimConfig):
        self.params, self.splits, self.config = named_params, splits, config
        self.buf = {fqn: torch.zeros_like(p.to_local()) for fqn, p in named_params.items()}

    def _direction(self, fqn: str) -> torch.Tensor:
        """Momentum update on the local shard; the local shard of the direction to orthogonalize."""
        c = self.config
        return momentum_update(self.buf[fqn], self.params[fqn].grad.to_local(), c.momentum, c.nesterov)

    def _orthogonalize(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """Full direction -> full orthogonalized update, per block of the parameter's split."""
        split, c = self.splits[fqn], self.config
        (o_NRC,) = orthogonalize_blocks([split.to_blocks(full)], steps=c.ns_steps, coefficients=c.coefficients,
                                        ns_dtype=c.ns_torch_dtype(), method=c.ns_method)
        return split.from_blocks(o_NRC, full.shape)

    def _apply(self, fqn: str, update_local: torch.Tensor) -> None:
        p, c = self.params[fqn], self.config
        scale = lr_scale(*self.splits[fqn].block_shape(tuple(p.shape)), c.lr_adjust)
        apply_update(p.to_local(), update_local, lr=c.lr, weight_decay=c.weight_decay, scale=scale)


class GatherAll(_MuonBase):
    def __init__(self, named_params, splits, config):
        super().__init__(named_params, splits, config)
        self.box = {fqn: box_of_rank(p)[dist.get_rank()] for fqn, p in named_params.items()}

    @torch.no_grad()
    def step(self):
        for fqn, p in self.params.items():
            u = DTensor.from_local(self._direction(fqn), p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride(), run_check=False)
            full = u.full_tensor()  # communication: all-gather of the whole matrix on every rank
            self._apply(fqn, self._orthogonalize(fqn, full)[self.box[fqn]])


class OwnerAllGather(_MuonBase):
    def __init__(self, named_params, splits, config):
        super().__init__(named_params, splits, config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.boxes = {fqn: box_of_rank(p) for fqn, p in named_params.items()}
        order = sorted(named_params, key=lambda f: -named_params[f].numel())  # largest first
        self.chunks = [order[i : i + self.world] for i in range(0, len(order), self.world)]

    @torch.no_grad()
    def step(self):
        pending = None  # (chunk, all-gather work, output buffers) in flight
        for chunk in self.chunks:
            full_mine = self._gather_to_owner(chunk)
            out = self._orthogonalize(chunk[self.rank], full_mine) if full_mine is not None else None
            if pending is not None:
                self._finish(*pending)
            pending = self._all_gather_results(chunk, out)
        if pending is not None:
            self._finish(*pending)

    def _gather_to_owner(self, chunk):
        """One all-to-all: rank j receives every rank's shard of chunk[j] and assembles it."""
        send = [self._direction(fqn).reshape(-1) for fqn in chunk]
        send += [send[0].new_empty(0)] * (self.world - len(chunk))
        mine = chunk[self.rank] if self.rank < len(chunk) else None
        boxes = self.boxes[mine] if mine else [()] * self.world
        recv_sizes = [_numel(self.params[mine].shape, b) if mine else 0 for b in boxes]
        recv = send[0].new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, torch.cat(send), recv_sizes, [t.numel() for t in send])  # communication
        if mine is None:
            return None
        full = recv.new_empty(self.params[mine].shape)
        for piece, box in zip(recv.split(recv_sizes), boxes):
            full[box] = piece.view(full[box].shape)
        return full

    def _all_gather_results(self, chunk, out):
        """Every owner's full result to every rank (padded to the chunk's largest parameter)."""
        size = max(self.params[f].numel() for f in chunk)
        mine = out.reshape(-1) if out is not None else self.buf[chunk[0]].new_empty(0)
        padded = torch.cat([mine, mine.new_zeros(size - mine.numel())])
        gathered = padded.new_empty(self.world * size)
        work = dist.all_gather_single(gathered, padded, async_op=True)  # communication
        return chunk, work, gathered.view(self.world, size)

    def _finish(self, chunk, work, gathered):
        work.wait()
        for owner, fqn in enumerate(chunk):
            p = self.params[fqn]
            full = gathered[owner, : p.numel()].view(p.shape)
            self._apply(fqn, full[self.boxes[fqn][self.rank]])


def _numel(shape, box) -> int:
    return int(np.prod([s.stop - s.start for s in box])) if box else 0


class Single:
    """Rank 0 steps full copies with the reference Muon (built once, untimed); other ranks idle."""

    def __init__(self, named_params: dict, splits: dict, config: OptimConfig):
        fulls = {fqn: (p.full_tensor(), p.grad.full_tensor()) for fqn, p in named_params.items()}  # setup
        self.rank = dist.get_rank()
        self.params = {}
        for fqn, (value, grad) in fulls.items():
            self.params[fqn] = torch.nn.Parameter(value)
            self.params[fqn].grad = grad
        self.opt = ReferenceMuon(list(self.params.items()), splits, config) if self.rank == 0 else None

    def step(self):
        if self.opt is not None:
            self.opt.step()
