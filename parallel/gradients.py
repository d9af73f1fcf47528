"""Loss scaling and gradient-norm clipping that make every layout equal the single-process step.

Convention (why the sum is right):
  * each rank's loss is  sum of cross-entropy over ITS tokens / (token count of the GLOBAL batch);
  * FSDP reduces gradients with SUM (parallel/fsdp.py) on both meshes.
The single-process loss is the mean over all global tokens, i.e. the sum over ranks of the
per-rank losses, so its gradient is the sum of the per-rank gradients, for every weight:
  * dense weights: each dp and cp rank back-propagates its own tokens; summing over
    dp_replicate x dp_shard x cp is the full gradient. (Averaging would divide by cp too.)
  * expert weights: the ep all-to-all backward already sums, on the expert's owner, the gradients
    of the tokens every ep peer sent it; summing over edp_replicate x edp_shard adds the other
    token groups. (Averaging would divide by edp_replicate x edp_shard, which is not the number
    of ranks whose tokens reached the expert when ep > 1.)
The sum of the per-rank losses (`global_loss`) is the single-process loss, for logging.
Gradient accumulation: divide by the global token count of the whole optimizer step.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from parallel import _torch_private

IGNORE_INDEX = -100


# One chunk's fp32 logits, log-softmax and gradient stay within a few times this many bytes.
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_fn(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, global_tokens: int,
            chunk_tokens: int | None = None) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy: sum over local tokens / global_tokens.

    global_tokens: labels != IGNORE_INDEX over all ranks (and micro-batches) of the step; without
    padding that is global_batch * seq_len. The cross-entropy runs in fp32 over chunks of
    `chunk_tokens` tokens (default: LOSS_CHUNK_BYTES of fp32 logits), so the fp32 logits of the whole
    micro-batch (and their log-softmax) never exist at once; see `chunked_cross_entropy_sum`."""
    logits_TV, labels_T = logits_BSV.flatten(0, 1), labels_BS.flatten()
    if chunk_tokens is None:
        chunk_tokens = max(1, LOSS_CHUNK_BYTES // (4 * logits_TV.shape[-1]))
    return chunked_cross_entropy_sum(logits_TV, labels_T, chunk_tokens) / global_tokens


def chunked_cross_entropy_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """sum_t CE(logits_TV[t].float(), labels_T[t]) (IGNORE_INDEX skipped), chunk by chunk.

    Gradients equal F.cross_entropy's on the whole tensor bit for bit (every op but the final sum
    is row-wise); the loss equals it up to the summation order over chunks (bitwise with one chunk).
    The backward recomputes each chunk's log-softmax and writes its gradient, in the logits' dtype,
    into one preallocated buffer: peak extra memory is one chunk's fp32 temporaries."""
    return _ChunkedCrossEntropySum.apply(logits_TV, labels_T, chunk_tokens)


def _chunk_ce_sum(logits_CV: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_CV.float(), labels_C, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, labels_T, chunk_tokens):
        ctx.save_for_backward(logits_TV, labels_T)
        ctx.chunk_tokens = chunk_tokens
        chunks = zip(logits_TV.split(chunk_tokens), labels_T.split(chunk_tokens))
        return sum(_chunk_ce_sum(logits_CV, labels_C) for logits_CV, labels_C in chunks)

    @staticmethod
    def backward(ctx, grad_sum):
        logits_TV, labels_T = ctx.saved_tensors
        grad_TV = torch.empty_like(logits_TV)
        for start in range(0, logits_TV.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            with torch.enable_grad():
                logits_CV = logits_TV[rows].detach().requires_grad_()
                (grad_TV[rows],) = torch.autograd.grad(_chunk_ce_sum(logits_CV, labels_T[rows]), logits_CV, grad_sum)
        return grad_TV, None, None


def global_loss(local_loss: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of the per-rank losses over all ranks (`group`: default = world): the single-process loss."""
    total = local_loss.detach().clone()
    dist.all_reduce(total, group=group)  # communication: one scalar
    return total


@torch.no_grad()
def grad_norm(parameters, group=None, stage_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients of `parameters`, DTensors on any meshes that span `stage_group`
    (default: `group`, default: world). Each rank adds the squares of its local shards; a shard replicated
    over mesh axes of total size n is held by n ranks, so it is counted 1/n times (a plain tensor: by every
    rank of `stage_group`). One `_foreach_norm` per (device, dtype, replica count) group of local shards
    (fp32 per-shard norms, as torch.nn.utils.clip_grad_norm_ computes them), their squares summed in fp64,
    then one all-reduce of one scalar over `group` (communication). No host sync.
    Pipeline parallelism: `stage_group` is this rank's stage, `group` the world; stages hold disjoint
    parameters, so the one world-wide sum is the sum over each stage's ranks, then over the stages.
    The foreach kernels are private torch (parallel/_torch_private.py); torch.nn.utils.clip_grad_norm_
    uses them too."""
    holders = group if stage_group is None else stage_group
    sq = None  # created on the gradients' device: a CPU scalar copied over would be a blocking copy
    for (device, _, replicas), shards in _local_grads(parameters, holders).items():
        part = torch.stack(_torch_private.foreach_norm(shards)).double().square().sum() / replicas
        sq = part if sq is None else sq + part.to(sq.device)
    if sq is None:
        sq = torch.zeros((), dtype=torch.float64)
    dist.all_reduce(sq, group=group)  # communication: one scalar
    return sq.sqrt().float()


def _local_grads(parameters, group) -> dict:
    """{(device, dtype, replicas): [local gradient shards]} of the parameters that have a gradient."""
    out = {}
    for p in parameters:
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        out.setdefault((local.device, local.dtype, _replicas(p.grad, group)), []).append(local)
    return out


def _replicas(grad: torch.Tensor, group) -> int:
    """How many ranks of `group` hold each element of this gradient shard."""
    world = dist.get_world_size(group)
    if not isinstance(grad, DTensor):
        return world  # a plain tensor is the same on every rank
    mesh = grad.device_mesh
    assert not any(pl.is_partial() for pl in grad.placements), grad.placements  # FSDP reduced them
    assert mesh.size() == world, f"gradient mesh {mesh} does not span the {world} ranks"
    return math.prod(mesh.size(i) for i, pl in enumerate(grad.placements) if isinstance(pl, Replicate))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, group=None, stage_group=None) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm (same rule as
    torch.nn.utils.clip_grad_norm_: factor min(1, max_norm / (norm + 1e-6))). Returns the norm
    before clipping (`grad_norm`: `stage_group` under pipeline parallelism). One `_foreach_mul_` per
    (device, dtype) group of local shards, in place: no communication, no host sync."""
    parameters = [p for p in parameters if p.grad is not None]
    total_norm = grad_norm(parameters, group, stage_group)
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device = {}
    for (device, dtype, _), shards in _local_grads(parameters, group if stage_group is None else stage_group).items():
        by_device.setdefault((device, dtype), []).extend(shards)
    for (device, _), shards in by_device.items():
        _torch_private.foreach_mul_(shards, scale.to(device))
    return total_norm
