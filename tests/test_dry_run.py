"""launch/dry_run.py at W = 64 on the debug model (fake process group, one forked process): the groups of
the layout, this rank's state bytes equal to launch/estimate_memory.py's to the byte (the real
parallelized model and optimizer against the estimator's own placement model), the step's collectives
on the meshes they belong to, and a broken layout failing with the launch's own line."""

import json
import os

import pytest

from launch import dry_run, pretrain  # imported once here, not in each forked process
from multirank import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "debug.toml")
ARGS = ["--config", CONFIG, "--world", "64", "--layers", "2", "--seq", "32", "--data.batch_size=64"]


def _dry_run(rank, world_size, argv):
    try:
        return dry_run.main(argv)
    except SystemExit as e:
        return e.code


def _pretrain(rank, world_size, argv, world):
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world), "0"
    return pretrain.main(argv)


@pytest.fixture(scope="module")
def ranks_0_and_63(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry") / "dry.json"
    run_ranks(_dry_run, 1, [*ARGS, "--ranks", "0,63", "--json", str(out)], timeout=300, as_torchrun=True)
    return json.load(open(out))


def test_groups_and_states_equal_the_estimate_to_the_byte(ranks_0_and_63):
    for r in ranks_0_and_63:
        assert r["world"] == 64
        sizes = {name.split(" = ")[0]: size for name, size in r["groups"].items()}
        assert sizes["dense.dp_shard"] == 64 and sizes["expert.ep"] == 8 and sizes["expert.edp_shard"] == 8
        mine, estimate = r["states_bytes"], r["estimate"]["states_bytes"]
        for key in ("params", "grads", "optimizer"):
            assert mine["dense"][key] + mine["expert"][key] == estimate[key], (r["rank"], key)
        assert r["states_total_bytes"] == r["estimate"]["states_total_bytes"] > 0
        assert mine["host_bytes"] > 0  # AdamW's step counters: host memory, outside the estimate
        assert r["planner_s"] >= 0 and r["peak_memory_bytes"] > 0
    first, last = ranks_0_and_63
    assert first["states_bytes"] != last["states_bytes"] or first["rank"] != last["rank"]


def test_the_step_counts_collectives_on_their_meshes(ranks_0_and_63):
    rows = {(c["kind"], c["mesh"].split(" = ")[0]): c for c in ranks_0_and_63[0]["collectives"]}
    assert rows[("alltoall_base", "expert.ep")]["bytes"] > 0  # EP dispatch/combine, symmetric counts
    assert rows[("_allgather_base", "dense.dp_shard")]["count"] > 0  # FSDP, dense mesh
    assert rows[("_allgather_base", "expert.edp_shard")]["count"] > 0  # FSDP, expert mesh
    assert rows[("_reduce_scatter_base", "expert.edp_shard")]["bytes"] > 0


def test_a_broken_layout_fails_with_the_launchs_line(tmp_path, capfd):
    bad = ["--parallel.ep=3"]  # 3 does not divide 8 experts nor 64 ranks
    assert run_ranks(_dry_run, 1, [*ARGS, *bad], timeout=300, as_torchrun=True) == [2]
    dry = capfd.readouterr().err.strip().splitlines()
    argv = ["--config", CONFIG, "--data.batch_size=64", *bad, f"--run.dir={tmp_path}/run"]
    assert run_ranks(_pretrain, 1, argv, 64, timeout=300, as_torchrun=True) == [2]
    launch = capfd.readouterr().err.strip().splitlines()
    assert len(dry) == 1 and dry == launch and dry[0].startswith("config error: "), (dry, launch)
