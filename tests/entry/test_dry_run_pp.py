"""launch/dry_run.py and launch/estimate_memory.py under pipeline parallelism: the dry run (fake process group, one
forked process) builds each played rank's stages with the real code (parallel/pp/part.py, FSDP per stage, Muon
planned over the stage's ranks), and their state bytes equal the memory estimate's for that rank's stages to the
byte; configs/kimi_k2_256gpu_h100.toml's worst stage at 256 ranks equals it too and fits an H100 by the estimate.
The estimate prints one line per pipeline rank and the worst one's parts."""

import json
import os

from dry_run_cases import CONFIG, REPO, _dry_run
from multirank import run_ranks

PP_ARGS = ["--config", CONFIG, "--world", "64", "--parallel.pp=2", "--parallel.dp_shard=-1", "--training.grad_accum=2",
           "--data.batch_size=64"]
H100 = os.path.join(REPO, "configs", "kimi_k2_256gpu_h100.toml")


def _states_equal(r) -> None:
    mine, estimate = r["states_bytes"], r["estimate"]["states_bytes"]
    for key in ("params", "grads", "optimizer"):
        assert mine["dense"][key] + mine["expert"][key] == estimate[key] > 0, (r["rank"], key)
    assert r["states_total_bytes"] == r["estimate"]["states_total_bytes"]


def test_each_stage_s_states_equal_the_estimate_s_to_the_byte(tmp_path, capfd):
    out = tmp_path / "dry.json"
    run_ranks(_dry_run, 1, [*PP_ARGS, "--ranks", "0,63", "--json", str(out)], timeout=300, as_torchrun=True)
    first, last = json.load(open(out))
    for r in (first, last):
        _states_equal(r)
        assert r["step_not_run"].startswith("not run under parallel.pp > 1")
    assert (first["pp_rank"], last["pp_rank"]) == (0, 1)
    assert "stage 0: embedding" in first["stages"] and "norm + head" in last["stages"]
    assert first["estimate"]["stage"]["embedding"] and last["estimate"]["stage"]["head"]
    assert capfd.readouterr().out.count("(equal to the memory estimate's)") == 2


def test_the_k2_h100_config_s_worst_stage_dry_run_equals_its_estimate_and_fits(tmp_path):
    """Rank 48: pipeline rank 3 of 16 (blocks 10-13), the config's worst stage by the estimate."""
    from planning.devices import DEVICES

    out = tmp_path / "dry.json"
    run_ranks(_dry_run, 1, ["--config", H100, "--world", "256", "--ranks", "48", "--json", str(out)], timeout=300,
              as_torchrun=True)
    r = json.load(open(out))
    _states_equal(r)
    assert r["pp_rank"] == 3 and r["stages"].endswith("stage 3: blocks 10-13")
    assert DEVICES["h100"].runtime_gib == DEVICES["h200"].runtime_gib  # the dry run's estimate is h200's
    assert r["estimate"]["total_gib"] <= DEVICES["h100"].memory_gib, r["estimate"]["total_gib"]


def _estimate(rank, world_size, argv):
    from launch import estimate_memory

    try:
        return estimate_memory.main(argv)
    except SystemExit as e:
        return e.code


def test_the_estimate_prints_each_pipeline_rank_and_the_worst(tmp_path, capfd):
    out = tmp_path / "estimate.json"
    argv = ["--config", CONFIG, "--world", "4", "--parallel.pp=2", "--parallel.dp_shard=2", "--training.grad_accum=2",
            "--parallel.pp_schedule=1f1b", "--device", "cpu", "--json", str(out)]
    (result,) = run_ranks(_estimate, 1, argv, as_torchrun=True)
    printed = capfd.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:2]] == ["pipeline rank  0", "pipeline rank  1"]
    assert printed[2] == f"worst: pipeline rank {result['worst']}" and "embedding" in printed[0]
    assert printed[3].startswith(f"rank {result['stages'][result['worst']]['rank']} of 4,")  # world = pp x dense
    assert json.load(open(out))["worst"] == result["worst"]
    rows = result["stages"]
    assert rows[result["worst"]]["total_gib"] == max(r["total_gib"] for r in rows)


def test_post_training_under_pipeline_parallelism_is_one_line(capfd):
    argv = ["--config", os.path.join(REPO, "configs", "posttrain_example.toml"), "--world", "2", "--parallel.pp=2",
            "--parallel.dp_shard=1", "--training.grad_accum=2"]
    (code,) = run_ranks(_estimate, 1, argv, as_torchrun=True)
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: parallel.pp=2 with post-training (data.source='rollouts'): not composed"), err
