"""Teacher weights: `live` (the student itself), `initial` (frozen copy), `ema`; an exact resume with an
EMA teacher through the real entry point (the teacher is part of the checkpoint); starting from a
pretraining checkpoint (`posttrain.init_from`)."""

import json
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launch.posttrain import build_objective, main
from models import Transformer
from entry_point import run_ok
from multirank import run_ranks
from parallel.meshes import build_meshes
from runtime.config_parser import load_config
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective, copy_weights
from runtime.posttrain.rollout_batch import RolloutLoader
from runtime.train import build_model
from posttrain_cases import Data, records
from seeded_models import seeded_model

EXAMPLE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rollouts.jsonl"))


def _model(seed: int) -> Transformer:
    return seeded_model("debug", seed, init="default")


@pytest.fixture
def step(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return RolloutLoader(Data(str(path)), seed=0, vocab_size=256, max_seq_len=256).batch(0)


def _kl(model, step, teacher=None, mode="live"):
    objective = FeedbackObjective(PosttrainConfig(rl_coef=0.0, teacher=mode), teacher=teacher)
    return objective.forward_backward(model, step, torch.device("cpu"))[2]["feedback_kl"]


def test_separate_teacher_is_used_and_a_copy_equals_live(step):
    student = _model(0)
    twin = _model(1)
    copy_weights(student, twin)
    assert _kl(student, step, twin, "initial") == pytest.approx(_kl(student, step), rel=1e-6)
    assert _kl(student, step, _model(1), "initial") > 10 * _kl(student, step)  # another model: far larger KL


def test_ema_update_is_the_definition():
    student, teacher = _model(0), _model(1)
    before = {k: p.detach().clone() for k, p in teacher.named_parameters()}
    objective = FeedbackObjective(PosttrainConfig(teacher="ema", ema_decay=0.9), teacher=teacher)
    objective.after_step(student)
    for k, p in teacher.named_parameters():
        expected = 0.9 * before[k] + 0.1 * dict(student.named_parameters())[k].detach()
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    frozen = {k: p.detach().clone() for k, p in teacher.named_parameters()}
    FeedbackObjective(PosttrainConfig(teacher="initial"), teacher=teacher).after_step(student)
    assert all(torch.equal(p, frozen[k]) for k, p in teacher.named_parameters())  # initial: never moves


CP2 = ["--parallel.dp_shard=1", "--parallel.cp=2", "--parallel.ep=2", "--parallel.edp_shard=1"]


def _run(run_dir, world_size=2, layout=CP2):
    argv = ["--data.source=rollouts", f"--data.path={EXAMPLE}", "--data.batch_tokens=600", "--training.steps=4",
            "--training.warmup_steps=1", "--checkpoint.interval=2", "--checkpoint.keep=0",
            "--posttrain.teacher=ema", "--posttrain.ema_decay=0.5", "--posttrain.mode=topk",
            "--posttrain.top_k=16", *layout]
    return run_ok(run_dir, world_size, argv, entry=main)


def test_resume_with_ema_teacher_is_exact(tmp_path):
    """cp=2 with the EMA teacher and the topk mode (its top-k ids, log-probs and tail cross cp ranks)
    equals one process (tolerances as in tests/entry/test_posttrain_layouts.py). Steps 2-3 after resuming
    from step 2 equal the uninterrupted run bitwise: same weights, optimizer state, EMA teacher, data
    position and reduction order. Without the teacher in the checkpoint, the EMA would restart from
    the initial weights and feedback_kl would differ (checked by leaving it out: the test fails)."""
    single = _run(tmp_path / "single", 1, [])
    full = _run(tmp_path / "run")
    for a, b in zip(single, full):
        for key in ("loss", "rl_loss", "teacher_entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)
        assert b["feedback_kl"] == pytest.approx(a["feedback_kl"], rel=1e-5, abs=5e-7), (a, b)
    os.rename(tmp_path / "run" / "checkpoints" / "step_4", tmp_path / "step_4.bak")
    resumed = _run(tmp_path / "run")
    keys = ("loss", "feedback_kl", "rl_loss", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full]
    assert full[-1]["target_tokens"] > 0


def _init_from_weights(rank, world_size, path):
    run_dir = f"{path}/../../posttrain_run"  # not the default runs/debug: checkpoints there would win over init_from
    config = load_config(["--data.source=rollouts", f"--data.path={EXAMPLE}", f"--posttrain.init_from={path}",
                          "--posttrain.teacher=initial", f"--run.dir={run_dir}"])
    layout = config.layout(world_size)
    meshes = build_meshes(layout, "cpu")
    model = build_model(config, meshes, layout, torch.device("cpu"))
    fresh = model.output.weight.full_tensor().clone()
    objective = build_objective(config, model, meshes, layout, torch.device("cpu"))
    return fresh, {k: v.full_tensor() for k, v in model.state_dict().items() if k.endswith("weight")}, \
        objective.teacher.output.weight.full_tensor()


def test_init_from_loads_a_pretraining_checkpoint_into_another_layout(tmp_path):
    """Checkpoint written by launch/pretrain.py on 1 process, loaded on 2 ranks (FSDP 2 | ep 2); the
    reference is DCP's own converter to a plain torch.save file. The `initial` teacher copies it too."""
    run_ok(tmp_path, 1, ["--training.steps=2", "--data.seq_len=32", "--data.batch_size=4", "--eval.interval=0"])
    path = str(tmp_path / "checkpoints" / "step_2")
    dcp_to_torch_save(path, tmp_path / "plain.pt")
    saved = torch.load(tmp_path / "plain.pt", weights_only=False)["train"]["model"]
    (fresh, loaded, teacher), _ = run_ranks(_init_from_weights, 2, path, timeout=120)
    assert loaded.keys() <= saved.keys() and len(loaded) > 10
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), k
    assert not torch.equal(fresh, loaded["output.weight"]) and torch.equal(teacher, loaded["output.weight"])


@pytest.mark.parametrize("bad, message", [("missing", "no such directory"),
                                          ("other_model", "model.dim=32 (checkpoint: 64)")])
def test_init_from_errors_name_the_key(tmp_path, bad, message):
    """Read by load_config, before any rank works: the checkpoint supplies the shape, a contradicting key is refused."""
    run_dir = tmp_path / "run"
    if bad == "other_model":
        run_ok(run_dir, 1, ["--training.steps=1", "--data.seq_len=32", "--data.batch_size=4", "--eval.interval=0"])
    with pytest.raises(ValueError, match="posttrain.init_from") as err:
        load_config(["--data.source=rollouts", f"--data.path={EXAMPLE}", "--model.dim=32",
                     f"--posttrain.init_from={run_dir}/checkpoints/step_1"])
    assert message in str(err.value)
