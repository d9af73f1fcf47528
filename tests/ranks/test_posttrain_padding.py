"""Padding in post-training counts nowhere, and costs no host sync.

QK-clip's recorded max logits: a padded micro-batch records the same per-head maxima as its
trajectories forwarded one by one without padding (the plain reference), on 1 process (with and
without activation checkpointing, which reruns attention in backward) and on 2 cp ranks (each rank's
padded queries are its own; the MAX all-reduce joins them). The routers' padded-token counts equal
torch.bincount of the padded tokens' experts. A step's only host sync is its metrics readback."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import Transformer
from models.document_attention import max_document_logits
from multirank import run_ranks
from optim.qk_clip import enable_recording, reset_recording, step_max_logits
from parallel.activation_checkpoint import apply_activation_checkpoint
from parallel.context_parallel import apply_context_parallel
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective, _padded_counts
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.posttrain.rollouts import trajectory_from_record
from runtime.syncs import count_syncs
from seeded_models import seeded_model

LENGTHS = (50, 23, 37)  # one micro-batch of 3 rows padded to a multiple of 2*cp (50, or 52 with cp=2)
# fp32 both sides; the same tokens in another batch composition (one row vs three) only reorder the
# matmul sums: measured <= 1.2e-7 relative; 1e-5 allowed. Padded queries move some heads' maxima by > 1e-2.
RTOL = 1e-5


def _records() -> list[dict]:
    records = []
    for i, n in enumerate(LENGTHS):
        tokens = [(7 * j + 13 * i + 1) % 256 for j in range(n)]
        turns = [{"role": "user", "start": 0, "end": 9}, {"role": "assistant", "start": 9, "end": n}]
        records.append({"tokens": tokens, "turns": turns, "advantage": 1.0 - i})
    return records


def _model(activation_checkpoint: str = "none") -> Transformer:
    model = seeded_model("debug", init="generator")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(3.0)  # a spread of per-head maxima (as in tests/ranks/test_qk_clip.py)
    apply_activation_checkpoint(model, activation_checkpoint)
    enable_recording(model)
    return model


def _reference() -> torch.Tensor:
    """[L, H]: the max over the trajectories, each forwarded alone (no padding)."""
    model = _model()
    for r in _records():
        model(torch.tensor([r["tokens"]]))
    return step_max_logits(model)


def _step(cp: int = 1, cp_rank: int = 0, pack: bool = False):
    """pack=False: one row per trajectory (3 rows, padded); True: one packed row (padded tail under cp=2)."""
    trajs = [trajectory_from_record(r, vocab_size=256, max_seq_len=256) for r in _records()]
    loader = RolloutLoader(SimpleNamespace(batch_tokens=sum(LENGTHS)), seed=0, vocab_size=256, max_seq_len=256,
                           cp_rank=cp_rank, cp_degree=cp, trajectories=trajs, pack=pack)
    return loader.batch(0)


def _objective_maxima(model, step, cp_group=None) -> torch.Tensor:
    objective = FeedbackObjective(PosttrainConfig(rl_coef=1.0, feedback_coef=0.0), cp_group=cp_group)
    objective.forward_backward(model, step, torch.device("cpu"))
    return step_max_logits(model)


@pytest.mark.parametrize("activation_checkpoint", ["none", "full"])
def test_padded_micro_batch_records_the_unpadded_maxima(activation_checkpoint):
    step = _step()
    (mb,) = step.micro_batches
    assert mb.pad_BS.shape == (3, 50) and mb.pad_BS.sum() == 3 * 50 - sum(LENGTHS)
    reference_LH = _reference()
    model = _model(activation_checkpoint)
    torch.testing.assert_close(_objective_maxima(model, step), reference_LH, rtol=RTOL, atol=0)
    reset_recording(model)
    model(mb.inputs_BS, mb.positions_S)  # the padded batch without the objective: padding counts
    assert (step_max_logits(model) > reference_LH * (1 + 1e-2)).any()  # so the comparison above can fail


def _cp_rank(rank, world, pack):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model()
    apply_context_parallel(model, mesh)
    step = _step(world, rank, pack)
    return _objective_maxima(model, step, cp_group=mesh.get_group()), int(step.micro_batches[0].pad_BS.sum())


@pytest.mark.parametrize("pack", [False, True])
def test_context_parallel_padded_maxima_equal_the_unpadded_reference(pack):
    reference_LH = _reference()
    results = run_ranks(_cp_rank, 2, pack, timeout=120)
    assert sum(pads for _, pads in results) == (2 if pack else 3 * 52 - sum(LENGTHS))  # packed: 110 in 112
    for rank_LH, _ in results:
        torch.testing.assert_close(rank_LH, reference_LH, rtol=RTOL, atol=0)


def test_padded_counts_equal_bincount_of_the_padded_tokens():
    g = torch.Generator().manual_seed(0)
    experts_TK, pad_T = torch.randint(0, 16, (40, 4), generator=g), torch.rand(40, generator=g) < 0.3
    assert torch.equal(_padded_counts(experts_TK, pad_T, 16), torch.bincount(experts_TK[pad_T].flatten(), minlength=16))


def test_a_padded_step_syncs_once():
    """Whether a micro-batch has padding is read from its host-side mask, and padded tokens leave the
    expert counts by a scatter-add: the step's one sync is the metrics readback (it was 6 here: 1 per
    micro-batch, and a boolean-mask index and a bincount per MoE layer and micro-batch)."""
    model, step = _model(), _step()
    with count_syncs() as syncs:
        FeedbackObjective(PosttrainConfig()).forward_backward(model, step, torch.device("cpu"))
    assert syncs.total == 1, syncs.as_dict()


def test_document_maxima_leave_out_a_packed_rows_padded_tail():
    """A packed row's tail of padding is a document of its own; its queries' logits stay out of QK-clip's
    maxima (the cp=2 packed case above has a 2-token tail whose logits happen to be small)."""
    g = torch.Generator().manual_seed(0)
    q_BHSE, k_BHSE = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 4, 12, 8, generator=g)
    q_BHSE[:, :, 10:] *= 100  # padded queries with large logits
    doc_BL = torch.tensor([[0] * 6 + [1] * 4 + [2] * 2])
    pos_S, pad_BS = torch.arange(12), torch.arange(12)[None] >= 10
    got_H = max_document_logits(q_BHSE, k_BHSE, pos_S, pos_S, doc_BL, 0.5, query_pad_BS=pad_BS)
    want_H = max_document_logits(q_BHSE[:, :, :10], k_BHSE[:, :, :10], pos_S[:10], pos_S[:10], doc_BL[:, :10], 0.5)
    torch.testing.assert_close(got_H, want_H, rtol=1e-6, atol=0)  # another matmul size: measured 8e-8
    assert (max_document_logits(q_BHSE, k_BHSE, pos_S, pos_S, doc_BL, 0.5) > want_H + 1).any()  # can fail
