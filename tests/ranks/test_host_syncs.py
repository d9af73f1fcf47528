"""Host-sync counting (runtime/syncs.py) and the training step's sync budget.

The counter is checked against operations whose CUDA behaviour is documented (item/tolist read a
device value; a boolean mask, bincount and repeat_interleave without output_size size their
output from device values), and the step's count against its stated budget: one readback per step
(loss and gradient norm, to skip non-finite steps) plus, under expert parallelism, one split-size
readback per MoE layer and micro-batch (NCCL's all-to-all takes host split sizes). Neither may
grow with the number of dense layers, nor (without EP) with layers or micro-batches. QK-clip adds none:
its metrics join the one readback.
"""

import json

import pytest
import torch

from benchmarks.host_syncs import measure
from launch.pretrain import main
from models.moe import expert_counts
from multirank import run_ranks
from runtime.syncs import count_syncs, host_side, mark_host, mark_optimizer_host_state


def test_counts_the_ops_that_sync_on_cuda():
    x = torch.arange(6)
    with count_syncs() as c:
        x[0].item()
        bool((x > 2).all())
        x.tolist()
        x[x > 2]
        torch.bincount(x, minlength=8)
        x.repeat_interleave(x)
    assert c.by_kind == {"item": 2, "tolist": 1, "shape": 3}
    assert c.total == 6 and sum(c.by_site.values()) == 6


def test_sync_free_ops_are_not_counted():
    x = torch.arange(6)
    with count_syncs() as c:
        x.repeat_interleave(x, output_size=15)
        torch.histc(x.float(), 8, 0, 8)
        expert_counts(x.view(3, 2), 8)
        torch._assert_async((x >= 0).all())
        x.sum() + 1
    assert c.total == 0, c.as_dict()


def test_host_side_data_is_not_counted():
    x, step = torch.arange(6), torch.tensor(3.0)
    mark_host([step])
    with count_syncs() as c:
        step.item()
        with host_side():
            x.tolist()
        x.tolist()  # outside the block: counted
    assert c.total == 1


def test_expert_counts_equal_bincount():
    """Outside reference: torch.bincount (which syncs on CUDA) gives the same counts."""
    experts_TK = torch.randint(0, 16, (100, 4), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(experts_TK, 16), torch.bincount(experts_TK.flatten(), minlength=16))


def _measure(rank, world_size, argvs):
    return [measure(argv) for argv in argvs]


LARGER = ["--model.n_layers=5", "--training.grad_accum=2"]
QK_CLIP = ["--optim.qk_clip_tau=0.05"]  # below the debug model's max logits (0.06-0.08): heads are clipped
MAX_LOGIT = ["--metrics.max_logit=true"]  # recorded without QK-clip


@pytest.fixture(scope="module")
def counts():
    """{(world, larger): measure()} for the debug preset on 1 and 8 ranks (8: cp=2 and ep=8); larger
    "qk" is the debug preset with QK-clip on."""
    out = {}
    for world in (1, 8):
        per_rank = run_ranks(_measure, world, [[], LARGER, QK_CLIP, MAX_LOGIT], timeout=300)
        for i, larger in enumerate((False, True, "qk", "max_logit")):
            out[world, larger] = [results[i] for results in per_rank]
    return out


def test_qk_clip_adds_no_host_sync(counts):
    """QK-clip's metrics join the step's one readback and its factors stay on the device."""
    for world in (1, 8):
        for plain, clipped in zip(counts[world, False], counts[world, "qk"]):
            assert clipped["per_step"] == plain["per_step"], clipped["by_site"]
            assert not any("qk_clip" in site for site in clipped["by_site"]), clipped["by_site"]
        for plain, watched in zip(counts[world, False], counts[world, "max_logit"]):  # [metrics] max_logit
            assert watched["per_step"] == plain["per_step"], watched["by_site"]


def test_one_sync_per_step_without_expert_parallelism(counts):
    for larger in (False, True):
        (result,) = counts[1, larger]
        assert result["ep"] == 1 and result["per_step"] == 1, result["by_site"]


def test_expert_parallel_adds_one_readback_per_moe_layer_and_micro_batch(counts):
    for larger in (False, True):
        for result in counts[8, larger]:
            inherent = result["moe_layers"] * result["micro_batches"]
            assert result["ep"] == 8 and result["per_step"] == 1 + inherent, result["by_site"]
            assert sum(v for site, v in result["by_site"].items() if "parallel/ep/direct.py" in site) == inherent
    assert counts[8, True][0]["moe_layers"] * counts[8, True][0]["micro_batches"] == 8  # 4 MoE layers x 2


def _profiled(rank, world_size, argv):
    return main(argv)


def test_profile_mode_reports_syncs(tmp_path):
    argv = ["--training.steps=3", "--data.seq_len=32", "--data.batch_size=8", "--checkpoint.interval=0",
            "--profile.enabled=true", "--profile.steps=1,2", f"--run.dir={tmp_path}"]
    assert run_ranks(_profiled, 2, argv, as_torchrun=True) == [0, 0]
    for rank in (0, 1):
        with open(tmp_path / "profile" / f"syncs_rank{rank}.json") as f:
            per_step = json.load(f)
        assert sorted(per_step) == ["1", "2"]
        # 2 ranks: ep=2 over the debug preset's 2 MoE layers, one micro-batch
        assert all(s["total"] == 1 + 2 for s in per_step.values()), per_step


def test_device_tensors_made_from_host_data_are_counted():
    """torch.tensor(x, device=...) copies from pageable host memory, which on CUDA waits for the stream;
    the dispatcher never sees that copy. torch's own host scalars (AdamW's CPU steps) are not ours."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    adamw = torch.optim.AdamW([p], foreach=True)
    adamw.step()
    mark_optimizer_host_state(adamw)
    with count_syncs() as c:
        torch.tensor(1.0, device="cpu")
        torch.as_tensor([1, 2], device=torch.device("cpu"))
        torch.tensor(1.0)  # a host tensor
        torch.full((), 1.0, device="cpu")  # a fill: no copy
        adamw.step()  # torch.tensor(1.0, device="cpu") inside torch: a host scalar by design
    assert c.by_kind == {"copy": 2}, c.as_dict()
    assert all("test_host_syncs.py" in site for site in c.by_site), c.as_dict()
