"""The direct EP dispatch, and the all-to-all of rows every route uses (in the compute dtype or in FP8).

After `parallel/ep/dispatcher.apply_expert_parallel`, each GroupedExperts weight (w13 [E, 2F, D], w2
[E, D, F]) is a DTensor Shard(0) over the ep mesh: ep rank p owns experts [p*L, (p+1)*L), L = E/ep. The
MoE layer's dispatcher (parallel/ep/dispatcher.py) runs, with the functions of this file:
  1. `exchange_counts`: exchange token counts per expert (all-to-all of ints) and queue ONE
     device-to-host copy of both split-size vectors (pinned memory, non-blocking), then return; FSDP's
     all-gather of the experts is issued meanwhile (the experts' pre-forward hook);
  1b. `direct_run`, inside the experts' call, waits for that copy: the layer's only host sync, inherent
     to EP because NCCL's all-to-all takes its split sizes (and the receive buffer's size) as host integers,
  2. dispatches the expert-sorted token copies to the owning ranks (all-to-all, uneven splits),
  3. regroups the received rows by local expert and runs the model's grouped matmul,
  4. combines: the inverse all-to-all returns each output row to the rank that sent the token.
Both all-to-alls are autograd functions whose backward is the opposite all-to-all, so the expert
weights get exactly the gradient of the tokens they saw. A rank or expert with no tokens computes
an empty grouped matmul, which still yields a (zero) gradient for every local expert weight, so
all ranks reduce the same gradients. Every EP exchange goes through `kept` (parallel/ep/keep.py:
a recompute may read it back instead of sending again).

FP8 rows (`parallel.ep_dispatch_dtype` / `ep_combine_grad_dtype = "float8_e4m3"`): each row x_D crosses
as D float8_e4m3fn values q = x / s with one fp32 scale per token, s = max|x| / 448 (the format's
largest finite value), packed with the scale into one uint8 row of D + 4 bytes (`encode`; half the bytes
of bf16 rows), and dequantized on arrival (`decode`, q s in the compute dtype). The dispatch crosses so
in forward and its gradient goes back unquantized (straight through); the combine's gradient (the expert
outputs' gradient, in backward) crosses so and the forward combine stays in the compute dtype:
DeepSeek-V3 (arXiv:2412.19437, "Low-Precision Storage and Communication") quantizes "the activation
gradient before MoE down-projections" for that backward dispatch and keeps both combines in BF16, as
here. Not exact: e4m3 keeps 3 mantissa bits (a relative rounding of up to 2^-4 per value);
tests/ranks/test_ep_dispatch.py bounds each knob's effect by the bf16-vs-fp32 difference.

Shape letters: T token copies this rank sent (sorted by expert), R rows received, D model dim,
F expert hidden dim, E experts, L local experts (E/ep), P ep ranks, B = D + 4 bytes of a packed FP8 row.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from models.experts import swiglu_experts
from parallel.ep.keep import kept

@dataclass
class ExchangedCounts:
    """What `exchange_counts` started: the counts this rank sends and receives ([P, L], device), and
    their row sums (split sizes) on their way to the host."""
    send_counts_PL: torch.Tensor
    recv_counts_PL: torch.Tensor
    splits_2P: torch.Tensor  # host tensor: [send splits, recv splits]; valid once `ready` completed
    ready: object  # torch.cuda.Event recorded after the copy, or None (copy already complete)

    sizes: tuple | None = None  # the Python ints, once read (a recomputed forward reuses them)

    def split_sizes(self) -> tuple[list[int], list[int]]:
        """(send_splits, recv_splits) as Python ints: waits for the copy (the host sync), once."""
        if self.sizes is None:
            if self.ready is not None:
                self.ready.synchronize()
            send, recv = self.splits_2P.tolist()  # a host tensor: no further device work
            self.sizes = (send, recv)
        return self.sizes


def exchange_counts(counts_E: torch.Tensor, n_ranks: int, group, mirror: bool = False) -> ExchangedCounts:
    """All-to-all of the per-expert counts (communication: E ints), then a non-blocking copy of the split
    sizes to pinned host memory. `mirror`: under the fake backend (the dry run), whose collectives move
    no data, each peer is taken to send this rank what it sends them (symmetric traffic), so the split
    sizes are real numbers, not uninitialized memory."""
    send_counts_PL = counts_E.view(n_ranks, counts_E.shape[0] // n_ranks)
    recv_counts_PL = torch.empty_like(send_counts_PL)
    dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=group)  # communication: counts
    if mirror:
        recv_counts_PL.copy_(send_counts_PL)
    splits_2P = torch.stack([send_counts_PL.sum(1), recv_counts_PL.sum(1)])
    ready = None
    if splits_2P.device.type == "cuda":
        host_2P = torch.empty(splits_2P.shape, dtype=splits_2P.dtype, pin_memory=True)
        host_2P.copy_(splits_2P, non_blocking=True)  # queued on the stream; the host does not wait here
        ready = torch.cuda.Event()
        ready.record()
        splits_2P = host_2P
    return ExchangedCounts(send_counts_PL, recv_counts_PL, splits_2P, ready)


def direct_run(d, x_TD: torch.Tensor, counts: ExchangedCounts, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The experts' call under the direct dispatch of dispatcher `d`: this rank's token copies sorted
    by expert in, their expert outputs out (out_TD, same order)."""
    send_splits, recv_splits = counts.split_sizes()  # host sync: split sizes must be Python ints
    x_RD = dispatch_rows(d, x_TD, recv_splits, send_splits)  # communication: dispatch
    y_RD = local_experts(x_RD, counts.recv_counts_PL, w13, w2)
    return all_to_all(d, y_RD, send_splits, recv_splits, d.config.combine_grad_fp8)  # communication: combine


def local_experts(x_RD: torch.Tensor, recv_counts_PL: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Received rows (ordered source rank, local expert) regrouped by local expert for the grouped matmul,
    SwiGLU, and returned in their received order."""
    n_ranks, n_local = recv_counts_PL.shape
    expert_of_row_R = torch.arange(n_local, device=x_RD.device).repeat(n_ranks).repeat_interleave(
        recv_counts_PL.flatten(), output_size=x_RD.shape[0]  # output_size: no second host sync
    )
    order_R = torch.argsort(expert_of_row_R, stable=True)
    y_sorted_RD = swiglu_experts(x_RD[order_R], w13, w2, recv_counts_PL.sum(0))
    return y_sorted_RD[torch.argsort(order_R)]


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """The local experts of an (unsharded by FSDP) expert weight; gradients flow back as Shard(0)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def dispatch_rows(d, x_ND: torch.Tensor, out_splits, in_splits) -> torch.Tensor:
    """The dispatch all-to-all of activation rows over `d.group`, in FP8 when `d.config.dispatch_fp8`
    (`encode`), else in x's dtype. A GPU dispatch backend would replace this call."""
    if d.config.dispatch_fp8:
        return _Fp8AllToAll.apply(x_ND, out_splits, in_splits, d.group, d.tape)
    return all_to_all(d, x_ND, out_splits, in_splits)


def all_to_all(d, x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int],
               grad_fp8: bool = False) -> torch.Tensor:
    """All-to-all of rows over dispatcher `d`'s group (through its tape, parallel/ep/keep.py) with uneven
    splits: in_splits[p] rows go to rank p, out_splits[p] come from it. `grad_fp8`: the backward sends
    the gradient as FP8 rows (a combine under ep_combine_grad_dtype)."""
    return _AllToAll.apply(x_ND, out_splits, in_splits, d.group, d.tape, grad_fp8)


def receive_rows(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """The plain all-to-all of rows into a new receive buffer (no autograd)."""
    out_MD = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
    dist.all_to_all_single(out_MD, x_ND.contiguous(), out_splits, in_splits, group=group)
    return out_MD


class _AllToAll(torch.autograd.Function):
    """Autograd all-to-all; the backward sends each row's gradient back the way the row came (as FP8
    rows, encoded before and decoded after, when `grad_fp8`)."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, tape, grad_fp8=False):
        ctx.splits, ctx.group, ctx.grad_fp8 = (out_splits, in_splits), group, grad_fp8
        return kept(tape, "rows", lambda: receive_rows(x_ND, out_splits, in_splits, group))  # parallel/ep/keep.py

    @staticmethod
    def backward(ctx, grad_MD):
        out_splits, in_splits = ctx.splits
        if not ctx.grad_fp8:
            return receive_rows(grad_MD, in_splits, out_splits, ctx.group), None, None, None, None, None
        packed_NB = receive_rows(encode(grad_MD), in_splits, out_splits, ctx.group)  # FP8 gradient rows
        return decode(packed_NB, grad_MD.dtype), None, None, None, None, None


class _Fp8AllToAll(_AllToAll):
    """The dispatch with FP8 rows; the backward is _AllToAll's (the gradient crosses in x's dtype)."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, tape):
        ctx.splits, ctx.group, ctx.grad_fp8 = (out_splits, in_splits), group, False
        out_MB = kept(tape, "fp8_rows", lambda: receive_rows(encode(x_ND), out_splits, in_splits, group))  # FP8 rows
        return decode(out_MB, x_ND.dtype)


# -- FP8 rows (module docstring)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4


def check_fp8_device(device_type: str, key: str = "ep_dispatch_dtype") -> None:
    """ValueError (one line, naming parallel.`key`) where the device cannot convert to float8_e4m3fn."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"parallel.{key}='float8_e4m3': torch {torch.__version__} has no float8_e4m3fn")
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ValueError(f"parallel.{key}='float8_e4m3' needs a GPU with float8 support (compute "
                         f"capability >= 8.9: Ada, Hopper or newer); this one is {major}.{minor}")


def encode(x_ND: torch.Tensor) -> torch.Tensor:
    """Rows -> packed uint8 [N, D + 4]: D e4m3 values, then the row's fp32 scale."""
    scale_N1 = x_ND.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    q_ND = (x_ND.detach().float() / scale_N1).to(torch.float8_e4m3fn)
    return torch.cat([q_ND.view(torch.uint8), scale_N1.view(torch.uint8)], dim=1)


def decode(packed_NB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows -> rows in `dtype` (q s computed in fp32, then rounded to dtype)."""
    q_ND = packed_NB[:, :-SCALE_BYTES].contiguous().view(torch.float8_e4m3fn)
    scale_N1 = packed_NB[:, -SCALE_BYTES:].contiguous().view(torch.float32)
    return (q_ND.float() * scale_N1).to(dtype)
