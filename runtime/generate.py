"""Sampling from the model with a KV cache (models/kv_cache.py), batched, in one process or on the
sharded model.

    prefill: one forward over the B prompts (equal length P, positions 0..P-1) fills the cache
    decode:  for t = 0..max_new_tokens-1: sample one token per sequence from the last logits, then one
             forward of those B tokens at position P + t against the cache

Sampling is per sequence and independent of the batch: sequence i draws its uniform number for step t
from its own generator seeded by (seed, sequence_ids[i]), and picks the token by inverse CDF over
the temperature-scaled, top-p-truncated distribution. So a sequence gets the same tokens whether it
is sampled alone, in a batch, or on another rank (up to the batch-composition rounding of fp32 matmuls).

Sharded (FSDP2 / EP, cp = 1): every rank runs this loop on its own prompts in lockstep. Each forward
is collective (FSDP all-gathers, EP all-to-alls), so all ranks take the same number of decode steps:
they stop when every sequence on every rank is done (one MIN all-reduce of a flag per step).

Returned log-probabilities are those of the distribution sampled from (temperature and top-p applied);
for greedy decoding (temperature 0) they are the model's, at temperature 1.
Letters: B sequences, P prompt tokens, N new tokens, V vocabulary.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from models.kv_cache import KVCache
from runtime.sampling import SamplingConfig

_SAMPLING_STREAM = 0x5A3E


class Generation(NamedTuple):
    tokens_BN: torch.Tensor  # int64; after a stop token, the rest repeats it
    logprobs_BN: torch.Tensor  # fp32; 0 after the stop token
    lengths_B: torch.Tensor  # new tokens up to and including the stop token


def sampling_probs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampled from, fp32 [B, V]: softmax(logits / temperature), truncated to the top-p
    nucleus (the most likely tokens until their mass reaches top_p, the crossing token included) and
    renormalized. Temperature 0: a one-hot of the argmax."""
    logits_BV = logits_BV.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits_BV.argmax(-1), logits_BV.shape[-1]).float()
    probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
    if top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        before_BV = sorted_BV.cumsum(-1) - sorted_BV  # mass of the more likely tokens
        sorted_BV = sorted_BV.masked_fill(before_BV >= top_p, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)
        probs_BV = probs_BV / probs_BV.sum(-1, keepdim=True)
    return probs_BV


def sample(probs_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u, int64 [B]."""
    cdf_BV = probs_BV.cumsum(-1)
    token_B = torch.searchsorted(cdf_BV, uniform_B[:, None].to(cdf_BV), right=True)[:, 0]
    return token_B.clamp(max=probs_BV.shape[-1] - 1)


def _generators(seed: int, sequence_ids: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(hash((_SAMPLING_STREAM, seed, i)) & (2**63 - 1)) for i in sequence_ids]


def _all_done(done: bool, device) -> bool:
    flag = torch.tensor([int(done)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # communication: one int per decode step
    return bool(flag.item())


@torch.no_grad()
def generate(model: nn.Module, prompts_BP: torch.Tensor, config: SamplingConfig, *, seed: int = 0,
             sequence_ids: list[int] | None = None) -> Generation:
    """Sample up to `config.max_new_tokens` tokens after each of the B equal-length prompts.

    `sequence_ids` (default 0..B-1) name the sequences' random streams: give every sequence of a
    sharded batch a distinct id (e.g. its global index). Collective on a sharded model."""
    if any(hasattr(block.attention.sdpa, "local_sdpa") for block in model.layers):
        raise ValueError("generation needs a layout with cp=1 (context parallelism splits sequences, decoding "
                         "does not)")
    B, P = prompts_BP.shape
    device = prompts_BP.device
    sequence_ids = list(range(B)) if sequence_ids is None else list(sequence_ids)
    generators = _generators(seed, sequence_ids)
    was_training = model.training
    model.eval()
    cache = KVCache(len(model.layers))
    logits_BV = model(prompts_BP, torch.arange(P, device=device), cache=cache)[:, -1]
    tokens, logprobs = [], []
    finished_B = torch.zeros(B, dtype=torch.bool)
    lengths_B = torch.zeros(B, dtype=torch.long)
    stops = torch.tensor(config.stop_tokens, dtype=torch.long)
    for t in range(config.max_new_tokens):
        probs_BV = sampling_probs(logits_BV, config.temperature, config.top_p).cpu()
        uniform_B = torch.cat([torch.rand(1, generator=g) for g in generators])
        token_B = sample(probs_BV, uniform_B)
        if config.temperature == 0:
            logprob_B = torch.log_softmax(logits_BV.float().cpu(), -1).gather(1, token_B[:, None])[:, 0]
        else:
            logprob_B = probs_BV.gather(1, token_B[:, None])[:, 0].log()
        previous_B = tokens[-1] if tokens else token_B
        token_B = torch.where(finished_B, previous_B, token_B)
        tokens.append(token_B)
        logprobs.append(torch.where(finished_B, torch.zeros_like(logprob_B), logprob_B))
        lengths_B += (~finished_B).long()
        finished_B |= torch.isin(token_B, stops)
        if t + 1 == config.max_new_tokens or _all_done(bool(finished_B.all()), device):
            break
        logits_BV = model(token_B[:, None].to(device), torch.tensor([P + t], device=device), cache=cache)[:, -1]
    model.train(was_training)
    return Generation(torch.stack(tokens, 1), torch.stack(logprobs, 1), lengths_B)
