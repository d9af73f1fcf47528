"""Document masking (data.document_mask): packed documents attend only within themselves, RoPE restarts
per document, the label crossing a boundary is not trained.

Oracle: every document forwarded ALONE (positions 0..n-1, plain causal attention, the model's default
path). Tolerance 1e-5 relative to the largest logit (fp32): the masked path runs the same fused CPU
kernel on a key range that differs from the alone call only by masked keys, so only the summation
order differs (measured below 1e-6); a leak across a boundary or a RoPE offset changes logits by > 1e-2.
The models are the debug presets (MLA and GQA) with dense FFNs in every layer: with the MoE layers, a
2.6e-7 difference in one hidden state flipped a near-tied top-2 of 8 experts for one token of MLA's
third row (logits 4.8e-2 apart; all other documents within 4e-7), a routing discontinuity that no
attention error bound can cover, so the oracle isolates attention.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from models import preset
from models.document_attention import Documents, document_attention
from multirank import run_ranks
from parallel.context_parallel import apply_context_parallel, load_balanced_positions
from parallel.gradients import IGNORE_INDEX, loss_fn
from seeded_models import seeded_model
from torch.distributed.device_mesh import init_device_mesh

L = 48
LENGTHS = [[5, 17, 1, 25], [48], [13, 11, 24]]  # cp=4 chunks of 6: documents straddle most boundaries


def _model(name):
    return seeded_model(name, init="default", n_dense_layers=preset(name).n_layers)


def _packed(lengths_B, seed=1, vocab=256):
    tokens_BL = torch.randint(0, vocab, (len(lengths_B), L), generator=torch.Generator().manual_seed(seed))
    doc_BL = torch.from_numpy(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths_B]))
    rope_BL = torch.from_numpy(np.stack([np.concatenate([np.arange(n) for n in ls]) for ls in lengths_B]))
    return tokens_BL, doc_BL, rope_BL


def _spans(lengths):
    ends = np.cumsum(lengths)
    return [slice(int(e - n), int(e)) for e, n in zip(ends, lengths)]


def _alone_logits(model, tokens_BL):
    with torch.no_grad():
        return [[model(tokens_BL[b:b + 1, span])[0] for span in _spans(ls)] for b, ls in enumerate(LENGTHS)]


def _assert_documents_match(logits_BLV, alone, positions=None):
    """logits_BLV: the packed rows' logits at `positions` (default all) against each document alone."""
    positions = torch.arange(L) if positions is None else positions
    worst = 0.0
    for b, ls in enumerate(LENGTHS):
        for span, ref in zip(_spans(ls), alone[b]):
            where = [i for i, p in enumerate(positions.tolist()) if span.start <= p < span.stop]
            got = logits_BLV[b, where]
            want = ref[positions[where] - span.start]
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    assert worst < 1e-5, worst
    return worst


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_each_document_of_a_packed_row_equals_it_forwarded_alone(name):
    model = _model(name)
    tokens_BL, doc_BL, rope_BL = _packed(LENGTHS)
    with torch.no_grad():
        packed = model(tokens_BL, documents=Documents(doc_BL, rope_BL))
        unmasked = model(tokens_BL)
    alone = _alone_logits(model, tokens_BL)
    _assert_documents_match(packed, alone)
    assert (unmasked[0, 5:] - packed[0, 5:]).abs().max() > 1e-2  # the mask matters (this check can fail)


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_the_gradient_from_one_document_does_not_depend_on_its_neighbours(name):
    """Loss on document 1 of row 0 only: parameter gradients equal those of the document alone, whatever
    tokens surround it."""
    grads = []
    for seed in (1, 2):
        model = _model(name)
        tokens_BL, doc_BL, rope_BL = _packed(LENGTHS, seed=seed)
        tokens_BL[0, 5:22] = torch.arange(17) + 40  # the same document 1 in both, different neighbours
        labels_BL = torch.full_like(tokens_BL, IGNORE_INDEX)
        labels_BL[0, 5:21] = tokens_BL[0, 6:22]
        loss_fn(model(tokens_BL, documents=Documents(doc_BL, rope_BL)), labels_BL, 16).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    model = _model(name)
    alone = torch.arange(17)[None] + 40
    loss_fn(model(alone[:, :-1]), alone[:, 1:], 16).backward()
    reference = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    for got in grads:
        assert got.keys() == reference.keys()
        for k, g in got.items():  # 2e-5 of each tensor's largest entry, as tests/ranks/test_attention.py
            assert (g - reference[k]).abs().max() <= 2e-5 * reference[k].abs().max() + 1e-12, k


def _cp_rank(rank, world, names):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = {}
    for name in names:
        model = _model(name)
        apply_context_parallel(model, mesh)
        tokens_BL, doc_BL, rope_BL = _packed(LENGTHS)
        positions = load_balanced_positions(L, world, rank)
        with torch.no_grad():
            logits = model(tokens_BL[:, positions], positions, documents=Documents(doc_BL, rope_BL[:, positions]))
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits)
        full = torch.empty(len(LENGTHS), L, logits.shape[-1])
        for r, part in enumerate(gathered):
            full[:, load_balanced_positions(L, world, r)] = part
        out[name] = full
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_chunks_respect_documents_that_straddle_them(cp):
    names = ["debug", "debug_gqa"]
    results = run_ranks(_cp_rank, cp, names, timeout=300)
    for name in names:
        alone = _alone_logits(_model(name), _packed(LENGTHS)[0])
        for rank_result in results:
            _assert_documents_match(rank_result[name], alone)


def test_masked_attention_never_builds_a_per_head_square_float():
    """The masked path's largest float tensors are [B, H, S, E] and no [., ., S, S] float is created."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.square = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and \
                        t.shape[-1] >= 1024 and t.shape[-2] >= 1024:
                    self.square.append((str(func), tuple(t.shape)))
            return out

    S, H, E = 2048, 4, 16
    q, k, v = (torch.randn(1, H, S, E) for _ in range(3))
    doc_BL = torch.from_numpy(np.repeat(np.arange(8), S // 8))[None]
    pos = torch.arange(S)
    with Shapes() as shapes:
        document_attention(q, k, v, pos, pos, doc_BL, E**-0.5, block=512)
    assert shapes.square == [], shapes.square[:3]


# ---- the data side: runtime/data/documents.py through the Loader, and whole runs ------------------------

def _indexed_dataset(tmp_path, seed=0):
    from runtime.data.indexed import IndexedWriter

    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=int(rng.integers(1, 40))) for _ in range(120)]
    writer = IndexedWriter(str(tmp_path / "docs"), np.uint16)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return str(tmp_path / "docs"), docs


def _expected_row(docs, start, seq_len):
    """Independent loop: (inputs, labels with IGNORE at crossings, window doc ids, RoPE positions)."""
    owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    flat = np.concatenate(docs)
    window, who = flat[start:start + seq_len + 1], owner[start:start + seq_len + 1]
    doc_ids = np.cumsum(np.concatenate([[0], who[1:] != who[:-1]]))
    rope = [0]
    for i in range(1, seq_len):
        rope.append(0 if doc_ids[i] != doc_ids[i - 1] else rope[-1] + 1)
    labels = np.where(doc_ids[1:] != doc_ids[:-1], IGNORE_INDEX, window[1:])
    return window[:-1], labels, doc_ids[:-1], np.asarray(rope)


def test_loader_marks_documents_restarts_positions_and_skips_crossing_labels(tmp_path):
    from runtime.data.loader import Loader, window_starts
    from runtime.data.config import DataConfig

    prefix, docs = _indexed_dataset(tmp_path)
    config = DataConfig(source="bin", path=prefix, seq_len=32, batch_size=8, document_mask=True)
    n_tokens = sum(len(d) for d in docs)
    for step in range(3):
        starts = window_starts(0, step, 8, n_tokens, 32)
        expected = [_expected_row(docs, int(a), 32) for a in starts]
        crossing = sum(int((e[1] == IGNORE_INDEX).sum()) for e in expected)
        assert crossing > 8  # many documents cross: the check has teeth
        for dp, cp, accum in [(1, 1, 1), (2, 2, 2), (4, 2, 1)]:
            rows, per_micro = 8 // (accum * dp), 8 // accum
            for d in range(dp):
                for c in range(cp):
                    loader = Loader(config, 0, dp_rank=d, dp_degree=dp, cp_rank=c, cp_degree=cp, grad_accum=accum)
                    for m, micro in enumerate(loader.batch(step)):
                        assert micro.global_labels == 8 * 32 - crossing
                        pos = micro.positions_S
                        for j in range(rows):
                            inputs, labels, doc_ids, rope = expected[m * per_micro + d * rows + j]
                            assert micro.inputs_BS[j].tolist() == inputs[pos].tolist()
                            assert micro.labels_BS[j].tolist() == labels[pos].tolist()
                            assert micro.documents.doc_BL[j].tolist() == doc_ids.tolist()
                            assert micro.documents.rope_BS[j].tolist() == rope[pos].tolist()


def test_document_mask_refuses_files_without_documents(tmp_path):
    from runtime.config import ConfigError
    from runtime.config_parser import load_config
    from launch.pretrain import check_environment

    np.arange(500, dtype=np.uint16).tofile(tmp_path / "flat.bin")
    with pytest.raises(ValueError, match=r"^data.document_mask: data.path is a flat token file without document"):
        check_environment(load_config([f"--data.path={tmp_path}/flat.bin", "--data.dtype=uint16",
                                       "--data.document_mask=true", f"--run.dir={tmp_path}/run"]))
    with pytest.raises(ConfigError, match=r"^data.document_mask needs token files with document boundaries"):
        load_config(["--data.document_mask=true"])


FOLDED = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.cp=2", "--parallel.ep=4",
          "--parallel.edp_replicate=1", "--parallel.edp_shard=2"]
HEADLINE = ["--parallel.dp_shard=4", "--parallel.cp=2", "--parallel.ep=8", "--parallel.edp_shard=1"]


def test_one_process_and_eight_ranks_give_the_same_masked_losses(tmp_path):
    from entry_point import run_ok

    prefix, _ = _indexed_dataset(tmp_path)
    argv = [f"--data.path={prefix}", "--data.document_mask=true", "--data.seq_len=32", "--data.batch_size=8",
            "--training.steps=2", "--training.warmup_steps=1", "--checkpoint.interval=0", "--eval.interval=2",
            "--eval.steps=1"]
    single = run_ok(tmp_path / "single", 1, argv)
    for name, layout in (("headline", HEADLINE), ("folded", FOLDED)):
        records = run_ok(tmp_path / name, 8, argv + layout)
        for a, b in zip(single, records, strict=True):
            for key in ("loss", "eval_loss"):
                if key in a:  # fp32, reduction order only
                    assert b[key] == pytest.approx(a[key], rel=1e-5), (name, key, a, b)


def _plain_document_attention(q, k, v, q_pos, kv_pos, doc_BL, scale):
    """float64 loop: each query's softmax over the keys of its document at or before it."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for i, p in enumerate(q_pos.tolist()):
            visible = (kv_pos <= p) & (doc_BL[b, kv_pos] == doc_BL[b, p])
            weights = torch.softmax((q[b, :, i:i + 1] @ k[b][:, visible].transpose(-1, -2)) * scale, dim=-1)
            out[b, :, i] = (weights @ v[b][:, visible])[:, 0]
    return out


@pytest.mark.parametrize("cp_rank", [None, 0, 1])
def test_blocks_equal_a_plain_loop_on_the_flash_and_the_masked_path(monkeypatch, cp_rank):
    """Blocks of 8 queries: blocks inside one document take the mask-free flash path, the others the
    masked one; both against float64 (outputs and input gradients). cp_rank: a CP rank's queries (cp=2)."""
    import models.document_attention as D

    calls = []
    monkeypatch.setattr(D, "prefix_causal_attention", lambda *a: calls.append(1) or
                        __import__("models.block_attention").block_attention.prefix_causal_attention(*a))
    S, lengths = 64, [[30, 2, 32], [64]]
    doc_BL = torch.from_numpy(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths]))
    kv_pos = torch.arange(S)
    q_pos = kv_pos if cp_rank is None else load_balanced_positions(S, 2, cp_rank)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, len(q_pos), 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 3, S, 16, generator=gen, requires_grad=True) for _ in range(2))
    out = D.document_attention(q, k, v, q_pos, kv_pos, doc_BL, 0.25, block=8)
    ref = _plain_document_attention(q, k, v, q_pos, kv_pos, doc_BL, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)  # tests/ranks/test_attention.py's fp32 yardstick
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)  # measured <= 6e-7 on gradients up to 4.9; a leak: > 1
    assert 0 < len(calls) < len(q_pos) // 8  # both paths ran


@pytest.mark.parametrize("cp_rank", [None, 1])
def test_the_cuda_flex_attention_predicate_equals_the_block_path(cp_rank):
    """flex_document_attention (the CUDA path) in eager mode on the CPU: the same outputs as the block
    path (its kernel and compiled form are not exercised: no GPU here). MLA-like narrower values."""
    from models.document_attention import flex_document_attention

    S, lengths = 64, [[30, 2, 32], [64]]
    doc_BL = torch.from_numpy(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths]))
    kv_pos = torch.arange(S)
    q_pos = kv_pos if cp_rank is None else load_balanced_positions(S, 2, cp_rank)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, len(q_pos), 16, generator=gen), torch.randn(2, 3, S, 16, generator=gen)
    v = torch.randn(2, 3, S, 8, generator=gen)
    flex = flex_document_attention(q, k, v, q_pos, kv_pos, doc_BL, 0.25, compiled=False)
    blocks = document_attention(q, k, v, q_pos, kv_pos, doc_BL, 0.25, block=8)
    torch.testing.assert_close(flex, blocks, rtol=0, atol=2e-6)  # measured 4.8e-7
