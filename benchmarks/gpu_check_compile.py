"""The compiled_block section of benchmarks/gpu_check.py: a dense and a MoE block, eager vs compiled with the
runtime's regions (parallel/compile.py), and with document masking (FlexAttention inside the compiled blocks);
and the random weights the GPU check draws on the device (`random_normal_`)."""

import torch


@torch.no_grad()
def random_normal_(model) -> None:
    """Every local shard drawn on its device: norm weights 1, matrices normal(0, init_std), buffers 0."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.dim() == 1:
            local.fill_(1.0)  # norm weights
        else:
            local.normal_(0.0, model.config.init_std)
    for b in model.buffers():
        b.zero_()


def section_compiled_block(ctx) -> dict:
    """Each block of a 2-layer model (one dense, one MoE; bf16) forward + backward, eager vs compiled with
    the runtime's regions (parallel/compile.py; inductor on CUDA, aot_eager in the CPU test): seconds per
    block, graphs compiled, recompiles over the timed calls (must be 0); a graph break raises (fullgraph).
    Then the same blocks with document masking (`{kind}_documents`: `_compiled_documents`)."""
    import copy

    from models import Transformer, preset
    from parallel._torch_private import compiled_graphs
    from parallel.compile import apply_compile, region_boundaries

    name, B, S = ("debug", 2, 32) if ctx.small else ("moonlight_16b", 2, 4096)
    backend = "inductor" if ctx.device.type == "cuda" else "aot_eager"
    with torch.device(ctx.device):
        eager = Transformer(preset(name, n_layers=2, n_dense_layers=1)).to(torch.bfloat16)
    random_normal_(eager)
    for router in eager.routers():
        router.float()
    compiled = copy.deepcopy(eager)
    torch.compiler.reset()
    apply_compile(compiled, backend, region_boundaries(compiled, torch.bfloat16, "none"))
    x = torch.randn(B, S, eager.config.dim, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(S, device=ctx.device)
    out = {"backend": backend, "preset": name, "tokens": B * S}
    for i, kind in enumerate(("dense", "moe")):
        def step(model=None, i=i):
            model.layers[i](x, positions).float().square().mean().backward()
        start = compiled_graphs()
        out[f"{kind}_eager_s"] = ctx.timer(lambda: step(eager))
        compiled_s = ctx.timer(lambda: step(compiled))  # its warm-up call compiles
        graphs = compiled_graphs() - start
        step(compiled)
        out.update({f"{kind}_compiled_s": compiled_s, f"{kind}_graphs": graphs,
                    f"{kind}_recompiles": compiled_graphs() - start - graphs,
                    f"{kind}_speedup": out[f"{kind}_eager_s"] / compiled_s})
        out[f"{kind}_documents"] = _compiled_documents(ctx, eager, compiled, i, x, positions)
    return out


def _compiled_documents(ctx, eager, compiled, i: int, x, positions) -> dict:
    """Block `i` with document masking: the compiled block runs FlexAttention with the BlockMask built
    outside it (models/document_attention.py); forward + backward on CUDA, forward only on the CPU (no_grad:
    FlexAttention has no CPU backward in torch 2.13; the eager CPU blocks take the block path). Errors against
    an fp32 copy of the eager block: `error_ratio` = |compiled - fp32| / |eager - fp32| (about 1 when the
    compiled kernel rounds like eager), of the outputs and, on CUDA, of x's gradients. Graphs: compiled on
    the first document layout; recompiles: on the second (must be 0)."""
    import copy

    from models.document_attention import document_block_mask
    from parallel._torch_private import compiled_graphs

    grad = ctx.device.type == "cuda"
    exact = copy.deepcopy(eager.layers[i]).float()
    layouts = _document_layouts(*x.shape[:2], ctx.device)
    out, start = {}, compiled_graphs()

    def run(block, x_BSD, documents):
        x_BSD = x_BSD.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = block(x_BSD, positions, documents=documents)
            if grad:
                y.float().square().mean().backward()
        return y.detach().float(), (x_BSD.grad.float() if grad else None)

    for n, documents in enumerate(layouts):
        masked = documents._replace(block_mask=document_block_mask(documents.doc_BL, positions, positions))
        got = run(compiled.layers[i], x, masked)
        if n == 0:
            out["graphs"] = compiled_graphs() - start
            ref, fp32 = run(eager.layers[i], x, documents), run(exact, x.float(), documents)
            for name, a, b, c in zip(("output", "x_grad"), got, ref, fp32):
                if a is not None:
                    out[f"{name}_error_ratio"] = ((a - c).abs().max() / (b - c).abs().max()).item()
    out["recompiles"] = compiled_graphs() - start - out["graphs"]
    masked = layouts[1]._replace(block_mask=document_block_mask(layouts[1].doc_BL, positions, positions))
    out["eager_s"] = ctx.timer(lambda: run(eager.layers[i], x, layouts[1]))
    out["compiled_s"] = ctx.timer(lambda: run(compiled.layers[i], x, masked))
    return out


def _document_layouts(B: int, S: int, device) -> list:
    """Two document layouts of B rows of S tokens (about 8 documents per row, cut elsewhere in each)."""
    from models.document_attention import Documents

    g = torch.Generator().manual_seed(0)
    index_S = torch.arange(S)
    layouts = []
    for _ in range(2):
        starts_BS = torch.rand(B, S, generator=g) < 8 / S
        starts_BS[:, 0] = True
        first_BS = torch.where(starts_BS, index_S, 0).cummax(dim=1).values
        layouts.append(Documents((starts_BS.cumsum(1) - 1).to(device), (index_S - first_BS).to(device)))
    return layouts
