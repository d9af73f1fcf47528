"""Generation with a KV cache: cached decoding against full forwards (MLA and GQA), the sampling rule
against a plain loop, batch independence, stop tokens, and the sharded model on 4 ranks (FSDP + EP)
against 1 process."""

import pytest
import torch

from multirank import run_ranks
from parallel.meshes import build_meshes
from runtime import train as T
from runtime.config_parser import load_config
from runtime.generate import SamplingConfig, generate, sample, sampling_probs
from seeded_models import seeded_model


def _prompts(B, P, seed=1):
    return torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["debug", "debug_gqa"])
def test_cached_greedy_decoding_equals_full_forwards(name):
    model = seeded_model(name)
    prompts = _prompts(3, 7)
    out = generate(model, prompts, SamplingConfig(temperature=0, max_new_tokens=12))
    sequence = torch.cat([prompts, out.tokens_BN], dim=1)
    with torch.no_grad():
        logits = model.eval()(sequence)[:, 6:-1].float()  # the logits that chose each new token
    assert torch.equal(logits.argmax(-1), out.tokens_BN)
    # the cached path attends through an explicit mask, the full forward through the fused causal kernel:
    # the same sums in another order, fp32 rounding (measured ~1e-6)
    torch.testing.assert_close(out.logprobs_BN, torch.log_softmax(logits, -1).gather(2, out.tokens_BN[..., None])[..., 0],
                               rtol=0, atol=1e-5)


def plain_sample(probs, u):
    total = 0.0
    for token, p in enumerate(probs.tolist()):
        total += p
        if total > u:
            return token
    return len(probs) - 1


def test_sampling_follows_the_plain_definition():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    probs = sampling_probs(logits, temperature=0.7, top_p=0.8)
    full = torch.softmax(logits / 0.7, -1)[0]
    order = full.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for token in order:  # the nucleus: most likely tokens until their mass reaches top_p
        kept.append(token)
        mass += float(full[token])
        if mass >= 0.8:
            break
    expected = torch.zeros(5)
    expected[kept] = full[kept] / full[kept].sum()
    torch.testing.assert_close(probs[0], expected)
    for u in torch.linspace(0, 0.999, 17):
        assert int(sample(probs, u[None])[0]) == plain_sample(probs[0], float(u))
    assert sampling_probs(logits, temperature=0, top_p=1)[0].tolist() == [1, 0, 0, 0, 0]


def test_a_sequence_samples_the_same_alone_or_in_a_batch_and_stops():
    model = seeded_model("debug")
    prompts = _prompts(3, 5)
    config = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=8)
    batch = generate(model, prompts, config, seed=7)
    for i in range(3):
        alone = generate(model, prompts[i:i + 1], config, seed=7, sequence_ids=[i])
        assert torch.equal(alone.tokens_BN[0], batch.tokens_BN[i])
    first = int(batch.tokens_BN[0, 2])
    stopped = generate(model, prompts[:1], SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=8,
                                                          stop_tokens=(first,)), seed=7)
    n = int(stopped.lengths_B[0])
    assert n <= 3 and int(stopped.tokens_BN[0, n - 1]) == first and stopped.tokens_BN.shape[1] == n


def _sharded_generate(rank, world_size, prompts):
    args = ["--data.seq_len=32", "--data.batch_size=8", f"--parallel.dp_shard={world_size}", "--parallel.cp=1",
            f"--parallel.ep={world_size}", "--parallel.edp_shard=1"]
    config = load_config(args)
    layout = config.layout(world_size)
    model = T.build_model(config, build_meshes(layout, "cpu"), layout, torch.device("cpu"))
    rows = prompts[rank::world_size]  # this rank's sequences; ids = their global index
    out = generate(model, rows, SamplingConfig(temperature=1.0, max_new_tokens=6), seed=3,
                   sequence_ids=list(range(rank, len(prompts), world_size)))
    return out.tokens_BN


def test_sharded_generation_on_4_ranks_equals_one_process():
    prompts = _prompts(4, 6)
    single = run_ranks(_sharded_generate, 1, prompts)[0]
    per_rank = run_ranks(_sharded_generate, 4, prompts)
    for rank, tokens in enumerate(per_rank):
        assert torch.equal(tokens, single[rank::4]), rank
