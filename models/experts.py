"""GroupedExperts: the routed experts of one MoE layer as stacked 3-D weights.

This module is the only user of the private `torch._grouped_mm` (checked on torch 2.13.0, CPU build:
fp32/bf16/fp16 inputs, any group sizes including 0, autograd for both operands; it requires the
row strides of both operands to be multiples of 16 bytes, and its backward fails on a stride-0
incoming gradient, e.g. from `.sum()`, hence the `_contiguous_grad` hook). Where those conditions do not
hold, a per-expert loop over split chunks computes the same thing.

Under torch.compile (parallel/compile.py) the compiler runs `_grouped_mm`'s meta function, which
accepts bf16 only (torch 2.13); other dtypes reach the same kernel through the opaque custom op
`twinmesh::grouped_mm`, whose backward is a second custom op running the same two grouped matmuls
as eager autograd (fp32 is the CPU test dtype, bf16 the production one).

w1 and w3 are stored as ONE parameter w13 [E, 2F, D] (w1[e] = w13[e, :F], w3[e] = w13[e, F:]), so
both run as one grouped matmul with one weight read per expert. Stacked halves rather than
interleaved rows: w1[e] and w3[e] stay contiguous row ranges, so Muon's per-expert blocks
(`PER_EXPERT_GATED`), FSDP's row shards and the Hugging Face gate_proj/up_proj keys all map to boxes.

Shape letters: T tokens (sorted by expert), D model dim, F expert hidden dim, H = 2F, E experts,
I/O in/out width of one grouped matmul.
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.region import Region
from models.splits import PER_EXPERT, PER_EXPERT_GATED, MatrixSplit

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupedExperts(Region):
    """E SwiGLU experts: out_t = w2[e] (silu(w1[e] x_t) * w3[e] x_t) for token t routed to expert e.

    Parameters: w13 [E, 2F, D] (w1[e] rows then w3[e] rows), w2 [E, D, F] (each expert's matrix is
    [out, in], like nn.Linear). Under expert parallelism the MoE layer passes its dispatcher
    (parallel/ep/dispatcher.py), which all-to-alls the sorted tokens to the ranks owning each expert
    inside this call (so FSDP gathers the weights once per call); the parameter names and shapes stay.
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def body(self, x_TD: torch.Tensor, counts_E, dispatcher=None) -> torch.Tensor:
        """x_TD: token copies sorted by expert; counts_E (int64, len E): tokens of each expert in
        order (sum = T), or what `dispatcher.exchange` made of them. Returns out_TD in the same order.
        Experts with no tokens still get a (zero) gradient, so every rank steps the same optimizer
        state. `dispatcher` (None: every expert here) runs the call: `dispatcher.run(self, x, counts)`."""
        if dispatcher is not None:
            return dispatcher.run(self, x_TD, counts_E)
        assert counts_E.shape == (self.w13.shape[0],), (counts_E.shape, self.w13.shape)
        return swiglu_experts(x_TD, self.w13, self.w2, counts_E)

    def init_streams(self) -> list[tuple[str, nn.Parameter, tuple[int, int] | None]]:
        """(stream name, parameter, its rows [lo, hi) on dim 1 or None for all) of each random stream
        the init draws, in order: w1, w2, w3 as before the fusion, so seeded weights are unchanged."""
        hidden = self.w2.shape[-1]
        return [("w1", self.w13, (0, hidden)), ("w2", self.w2, None), ("w3", self.w13, (hidden, 2 * hidden))]

    def muon_splits(self) -> dict[str, MatrixSplit]:
        return {"w13": PER_EXPERT_GATED, "w2": PER_EXPERT}


def swiglu_experts(x_TD, w13_EHD, w2_EDF, counts_E) -> torch.Tensor:
    """Each expert's SwiGLU on its group of rows: w2 (silu(w1 x) * w3 x), two grouped matmuls
    (H = 2F: one matmul gives [w1 x, w3 x] side by side)."""
    gate_TF, up_TF = grouped_linear(x_TD, w13_EHD, counts_E).chunk(2, dim=-1)
    hidden_TF = F.silu(gate_TF) * up_TF
    return grouped_linear(hidden_TF, w2_EDF, counts_E)


def grouped_linear(x_TI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Rows of x_TI grouped by expert (group sizes counts_E) times each group's w[e]^T -> [T, O].

    No casts: x and w come in the compute dtype (FSDP's mixed-precision policy all-gathers the
    weights in it, the MoE dispatches activations in it)."""
    if _grouped_mm_ok(x_TI, w_EOI):
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        if torch.compiler.is_compiling() and x_TI.dtype != torch.bfloat16:
            return grouped_mm_op(x_TI, w_EOI, offsets_E)
        out_TO = torch._grouped_mm(x_TI, w_EOI.transpose(-2, -1), offs=offsets_E)
        if out_TO.requires_grad:
            out_TO.register_hook(_contiguous_grad)
        return out_TO
    return looped_linear(x_TI, w_EOI, counts_E)


@torch.library.custom_op("twinmesh::grouped_mm", mutates_args=())
def grouped_mm_op(x_TI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x, w^T, offs)` as one op the compiler does not look into (module docstring)."""
    return torch._grouped_mm(x_TI, w_EOI.transpose(-2, -1), offs=offsets_E)


@grouped_mm_op.register_fake
def _(x_TI, w_EOI, offsets_E):
    return x_TI.new_empty(x_TI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("twinmesh::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad_TO: torch.Tensor, x_TI: torch.Tensor, w_EOI: torch.Tensor,
                        offsets_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [T, I], dw [E, O, I]): the two grouped matmuls eager autograd runs for `_grouped_mm`
    (dx = grad w[e] per group, dw[e] = grad_e^T x_e; bit-equal, tests/ranks/test_compile.py)."""
    grad_TO = _contiguous_grad(grad_TO)
    return (torch._grouped_mm(grad_TO, w_EOI, offs=offsets_E),
            torch._grouped_mm(grad_TO.t(), x_TI, offs=offsets_E))


@grouped_mm_backward.register_fake
def _(grad_TO, x_TI, w_EOI, offsets_E):
    return torch.empty_like(x_TI), torch.empty_like(w_EOI)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_TO):
    x_TI, w_EOI, offsets_E = ctx.saved_tensors
    dx, dw = grouped_mm_backward(grad_TO, x_TI, w_EOI, offsets_E)
    return dx, dw, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def looped_linear(x_TI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Reference/fallback for `grouped_linear`: one matmul per expert (a host sync for the sizes).
    An empty chunk gives a [0, O] product whose backward writes zeros into w[e]'s gradient."""
    chunks = x_TI.split(counts_E.tolist())
    return torch.cat([chunk_CI @ w_EOI[e].T for e, chunk_CI in enumerate(chunks)])


def _grouped_mm_ok(x_TI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    if x_TI.device.type not in ("cpu", "cuda") or x_TI.dtype not in GROUPED_MM_DTYPES:
        return False
    if w_EOI.dtype != x_TI.dtype or not (x_TI.is_contiguous() and w_EOI.is_contiguous()):
        return False
    # Row strides of x and w[e] (I elements) and of the output (O elements) must be 16-byte multiples.
    return all(n * x_TI.element_size() % 16 == 0 for n in (x_TI.shape[-1], w_EOI.shape[1]))


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    """Gradient hook: _grouped_mm's backward needs a contiguous incoming gradient (see module docstring).
    An empty grad counts as contiguous whatever its strides; give it real ones. A hook, not an
    identity autograd function, so the layer returns no view (FSDP2 warns about views)."""
    return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
