"""The prefix-shared teacher's forwards (runtime/posttrain/objective.py prefix_shared_teacher), per rank, for
planning/memory/posttrain.py: what its KV cache holds and one block's working set in each of its passes,
measured on the CPU at the real widths like planning/memory/probe.py's activations.

The teacher runs without grad, in two passes (runtime/posttrain/rollout_batch.py builds their rows):
  prefix  the slot's trajectories' prefixes packed into one row (document masking), split over cp like the
          student's: each layer appends the row's compact keys to the KV cache (under cp its `kv_source`
          gathers the whole row first, so every rank caches all of it)
  items   this cp rank's I items packed in one row, not split: item after item, its cached prefix (P
          positions read back from the cache, `KVCache.rows`: a copy, one layer at a time) then its own
          S = hint + turn queries, at RoPE positions continuing its prefix; the document mask keeps each
          item to its own prefix and tokens. No padding.
The cache lives through both passes. A block's working set (what its forward creates, its input and
the cache excluded), fitted per sequence or item:
  prefix pass   a S + b S^2 + e S E per document of S local tokens (keys S x cp), a, b, e as
                planning/memory/probe.block_fits (two lengths, two expert counts, no cache)
  one item      a' S + b S (S + P) + k P + e S E for S queries over P cached positions: a' and k from
                the item at (s1, s1), (s2, s1) and (s1, s2) queries and cached positions (its attention
                runs the mask-free path, models/block_attention.prefix_causal_attention)
  I >= 2 items  I (a'' S + k' P + e S E) + m pairs: on the CPU the packed row's attention runs in query
                blocks (models/document_attention.py), and a block whose queries span two or more items
                holds its boolean mask and SDPA's copy of it, [queries, visible keys], shared by the
                heads: m bytes per pair of the largest such block (`masked_pairs`); m from rows of 2 and
                4 items at (s1, s1) (the linear part grows by the item count, the block's pairs by its
                square), k' from 2 items at (s1, s2)
b and m count on the CPU only (CUDA runs FlexAttention: no mask, no probabilities kept). Against the
forward of the runtime's own packed item rows (the debug model, 1-32 items of 48-576 queries over 0-512
cached positions each, fp32 and bf16; tests/unit/test_posttrain_memory.py): 0.95-1.02 of the measured
working set.
"""

import functools
import inspect

import torch

from planning.memory.probe import PROBE_SEQ, build_block
from models.document_attention import Documents, document_attention
from models.kv_cache import CachedRows, LayerCache

QUERY_BLOCK = inspect.signature(document_attention).parameters["block"].default  # the CPU path's query block


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


def _items(block, n: int, seq: int, cached: int, dtype: torch.dtype) -> int:
    """A block's forward of n items of `seq` queries, each over `cached` cached positions, packed in one row
    as the item pass runs them (each item's prefix read back before its queries, one document per item);
    the cache (one prefix, which every item reads) is filled beforehand."""
    dim = block.attention_norm.weight.shape[0]
    layer = LayerCache()
    with torch.no_grad():
        block(torch.randn(1, cached, dim).to(dtype), torch.arange(cached), cache=layer)
    span = torch.arange(n)[:, None] * (cached + seq)  # where each item starts in the row
    rows = CachedRows(layer, torch.arange(cached).repeat(n)[None], (span + torch.arange(cached)).flatten())
    doc = torch.arange(n).repeat_interleave(cached + seq)[None]
    documents = Documents(doc, (cached + torch.arange(seq)).repeat(n)[None])
    x = torch.randn(1, n * seq, dim).to(dtype)
    return _working(block, lambda: block(x, (span + cached + torch.arange(seq)).flatten(), cache=rows,
                                         documents=documents))


@functools.lru_cache(maxsize=None)
def block_fit(model_config, layer_id: int, dtype: torch.dtype, moe: bool) -> tuple[float, ...]:
    """(a, b, e) of the module docstring's fit for block `layer_id` without a cache (the prefix pass), and
    (a, k) of one item over its cached prefix: queries s1 and s2 over s1 cached, s1 over s2 (b removed)."""
    e1 = model_config.n_activated_experts if moe else model_config.n_routed_experts
    s1, s2 = PROBE_SEQ
    block = build_block(model_config, layer_id, e1, dtype)
    w1, w2 = _plain(block, s1, dtype), _plain(block, s2, dtype)
    e = 0.0
    if moe:
        e = (_plain(build_block(model_config, layer_id, 2 * e1, dtype), s1, dtype) - w1) / (s1 * e1)
    w1, w2 = w1 - e * s1 * e1, w2 - e * s2 * e1
    b = (w2 / s2 - w1 / s1) / (s2 - s1)
    item = {(q, c): _items(block, 1, q, c, dtype) - e * q * e1 - b * q * (q + c)
            for q, c in ((s1, s1), (s2, s1), (s1, s2))}
    a_item = (item[s2, s1] - item[s1, s1]) / (s2 - s1)
    k = (item[s1, s2] - item[s1, s1]) / (s2 - s1)
    return w1 / s1 - b * s1, b, e, a_item, k


@functools.lru_cache(maxsize=None)
def packed_fit(model_config, layer_id: int, dtype: torch.dtype, moe: bool) -> tuple[float, float, float]:
    """(a, k, m) of the module docstring's fit for block `layer_id` with two or more items in the row (its
    masked blocks): 2 and 4 items of s1 queries over s1 cached positions give m, 2 items over s2 k."""
    e1 = model_config.n_activated_experts if moe else model_config.n_routed_experts
    s1, s2 = PROBE_SEQ
    e = block_fit(model_config, layer_id, dtype, moe)[2]  # the MoE's per routed row, as without a cache
    block = build_block(model_config, layer_id, e1, dtype)
    w2, w4 = _items(block, 2, s1, s1, dtype), _items(block, 4, s1, s1, dtype)
    m = max(0.0, (w4 / 4 - w2 / 2) / (masked_pairs(4, s1, s1) / 4 - masked_pairs(2, s1, s1) / 2))
    per_item = {c: (_items(block, 2, s1, c, dtype) - m * masked_pairs(2, s1, c)) / 2 - e * s1 * e1 for c in (s1, s2)}
    k = (per_item[s2] - per_item[s1]) / (s2 - s1)
    return (per_item[s1] - k * s1) / s1, k, m


def masked_pairs(items: int, queries: int, cached: int) -> int:
    """(query, visible key) pairs of the largest masked query block of the packed item row on the CPU
    (models/document_attention.py): blocks of QUERY_BLOCK queries; a block's keys run from the first
    position of its earliest item to its last query; a block inside one item takes the mask-free path."""
    span, largest = cached + queries, 0
    for start in range(0, items * queries, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, items * queries)
        first, last = start // queries, (end - 1) // queries
        if first != last:
            keys = last * span + cached + (end - 1) % queries + 1 - first * span
            largest = max(largest, (end - start) * keys)
    return largest


def working(job, n_seq: int, queries: int, cached: int) -> float:
    """The largest working set of one teacher block: the prefix pass (`cached` = 0) over n_seq documents of
    `queries` local tokens, each attending over queries x cp keys; or the item pass over n_seq items of
    `queries` queries, each over `cached` cached positions, packed in one row (one item: `block_fit`, more:
    `packed_fit` with its masked blocks' pairs)."""
    cfg = job.config.model
    dtype = torch.bfloat16 if job.c == 2 else torch.float32
    cpu = 1.0 if job.device == "cpu" else 0.0
    kinds = ([(0, False)] if cfg.n_dense_layers else []) + ([(cfg.n_dense_layers, True)] if cfg.n_moe_layers else [])
    out = 0.0
    for layer_id, moe in kinds:
        a, b, e, a_item, k = block_fit(cfg, layer_id, dtype, moe)
        experts = e * queries * cfg.n_routed_experts
        if cached == 0:
            w = n_seq * (a * queries + cpu * b * queries * queries * job.layout.cp + experts)
        elif n_seq == 1:
            w = a_item * queries + cpu * b * queries * (cached + queries) + k * cached + experts
        else:
            a, k, m = packed_fit(cfg, layer_id, dtype, moe)
            w = n_seq * (a * queries + k * cached + experts) + cpu * m * masked_pairs(n_seq, queries, round(cached))
        out = max(out, w)
    return out
