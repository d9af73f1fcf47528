"""The prefix-shared teacher's forwards (runtime/posttrain/objective.py prefix_shared_teacher), per rank, for
planning/memory/posttrain.py: what its KV cache holds and one block's working set in each of its passes,
measured on the CPU at the real widths like planning/memory/probe.py's activations.

The teacher runs without grad, in two passes:
  prefix  the slot's trajectories packed into one row, split over cp like the student's: each layer
          appends the row's compact keys to the KV cache (under cp its `kv_source` gathers the whole
          row first, so every rank caches all rows x L of it)
  items   I item rows of Si = hint + turn positions, forwarded whole on one cp rank; in each layer an
          item row reads its trajectory's cached prefix back (`KVCache.rows`: a copy of Tp cached
          positions per row, one layer at a time), expands it to keys and values, and attends over
          Tp + Si keys
The cache lives through both passes. A block's working set (what its forward creates, its input and
the cache excluded) is fitted per sequence of S queries over P cached positions as
    a S + b S (S + P) + k P (+ e S E)
a, b, e as planning/memory/probe.block_fits (two lengths, two expert counts, no cache), k per cached
position from two cache lengths at the shorter query length (its S P part, b, removed). b S (S + P),
the attention probabilities of the CPU's kernels, counts on the CPU only.
"""

import functools

import torch

from planning.memory.probe import PROBE_SEQ, build_block
from models.document_attention import Documents
from models.kv_cache import CachedRows, LayerCache


def kv_cache_bytes(job, tokens: int) -> int:
    """Bytes of the teacher's KV cache of `tokens` positions over every layer: the compact keys
    (MLA: latent + rotary key; GQA: keys and values of the kv heads) in the compute dtype."""
    cfg = job.config.model
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attn == "mla" else 2 * cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * tokens * width * job.c


def _working(block, run) -> int:
    """Peak bytes `run()` (a forward of `block`) creates under no_grad; tensors made before excluded."""
    from torch.distributed._tools.mem_tracker import MemTracker  # private, checked on torch 2.13.0

    tracker = MemTracker()
    tracker.track_external(block)
    with tracker, torch.no_grad():
        before = sum(v["Total"] for v in tracker.get_tracker_snapshot("current").values())
        run()
    return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) - before


def _plain(block, seq: int, dtype: torch.dtype) -> int:
    """A block's forward on [1, seq] tokens, no cache."""
    x = torch.randn(1, seq, block.attention_norm.weight.shape[0]).to(dtype)
    return _working(block, lambda: block(x, torch.arange(seq)))


def _item(block, seq: int, cached: int, dtype: torch.dtype) -> int:
    """A block's forward of one item row of `seq` tokens over `cached` cached positions, as the item pass
    runs it (the cache read back as rows, document masking); the cache is filled beforehand."""
    dim = block.attention_norm.weight.shape[0]
    layer = LayerCache()
    with torch.no_grad():
        block(torch.randn(1, cached, dim).to(dtype), torch.arange(cached), cache=layer)
    rows = CachedRows(layer, torch.arange(cached)[None])
    documents = Documents(torch.ones(1, cached + seq, dtype=torch.int64), cached + torch.arange(seq)[None])
    x = torch.randn(1, seq, dim).to(dtype)
    return _working(block, lambda: block(x, cached + torch.arange(seq), cache=rows, documents=documents))


@functools.lru_cache(maxsize=None)
def block_fit(model_config, layer_id: int, dtype: torch.dtype, moe: bool) -> tuple[float, float, float, float]:
    """(a, b, e, k) of the module docstring's fit for block `layer_id`."""
    e1 = model_config.n_activated_experts if moe else model_config.n_routed_experts
    s1, s2 = PROBE_SEQ
    block = build_block(model_config, layer_id, e1, dtype)
    w1, w2 = _plain(block, s1, dtype), _plain(block, s2, dtype)
    e = 0.0
    if moe:
        e = (_plain(build_block(model_config, layer_id, 2 * e1, dtype), s1, dtype) - w1) / (s1 * e1)
    w1, w2 = w1 - e * s1 * e1, w2 - e * s2 * e1
    b = (w2 / s2 - w1 / s1) / (s2 - s1)
    k = (_item(block, s1, s2, dtype) - _item(block, s1, s1, dtype)) / (s2 - s1) - b * s1
    return w1 / s1 - b * s1, b, e, k


def working(job, n_seq: int, queries: int, cached: int) -> float:
    """The largest working set of one teacher block over n_seq sequences of `queries` local tokens, each
    attending over `keys` = queries x cp (the prefix pass) or over `cached` cached positions and itself."""
    cfg = job.config.model
    dtype = torch.bfloat16 if job.c == 2 else torch.float32
    keys = queries * job.layout.cp if cached == 0 else cached + queries
    quadratic = 1.0 if job.device == "cpu" else 0.0
    kinds = ([(0, False)] if cfg.n_dense_layers else []) + ([(cfg.n_dense_layers, True)] if cfg.n_moe_layers else [])
    out = 0.0
    for layer_id, moe in kinds:
        a, b, e, k = block_fit(cfg, layer_id, dtype, moe)
        out = max(out, n_seq * (a * queries + quadratic * b * queries * keys + k * cached
                                + e * queries * cfg.n_routed_experts))
    return out
