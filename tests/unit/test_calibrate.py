"""The calibrated step model against published runs (benchmarks/calibrate.py, benchmarks/calibration/*.toml),
its network model against the published figures it rests on, and bad case files (one line, exit 2)."""

import glob
import json
import os

import pytest

from benchmarks import calibrate
from benchmarks.lib import layout_step, network_model
from benchmarks.lib.device_model import DEVICES

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = sorted(glob.glob(os.path.join(REPO, "benchmarks", "calibration", "*.toml")))
TOLERANCE = 0.15  # the accuracy asked of the fitted cases; the spread of the committed cases is 0.87-1.12


def test_three_published_runs_are_committed():
    names = {os.path.basename(c) for c in CASES}
    assert {"torchtitan_dsv3_b200_nccl.toml", "torchtitan_dsv3_b200_deepep.toml",
            "deepseek_v3_h800_fp8.toml"} <= names


@pytest.mark.parametrize("case", CASES, ids=os.path.basename)
def test_each_published_run_is_projected_within_15_percent(case, tmp_path):
    out = tmp_path / "out.json"
    calibrate.main(["--case", case, "--json", str(out)])
    result = json.loads(out.read_text())
    assert abs(result["ratio"] - 1) <= TOLERANCE, result
    assert round(result["ratio"], 3) in network_model.CALIBRATION_RATIOS  # the spread the bands quote
    assert result["projected_tokens_per_gpu_s"] == pytest.approx(result["ratio"] * result["measured_tokens_per_gpu_s"])


HELD_OUT = sorted(glob.glob(os.path.join(REPO, "benchmarks", "calibration", "held_out", "*.toml")))
HELD_OUT_TOLERANCE = 0.25  # the accuracy asked of a run the model was not fitted on


@pytest.mark.parametrize("case", HELD_OUT, ids=os.path.basename)
def test_each_held_out_run_is_projected_within_25_percent_and_stays_out_of_the_bands(case):
    result = calibrate.project_case(case)
    assert abs(result["ratio"] - 1) <= HELD_OUT_TOLERANCE, result
    assert round(result["ratio"], 3) not in network_model.CALIBRATION_RATIOS


def test_docs_hold_the_generated_calibration_and_band_tables():
    """docs/performance.md holds benchmarks/bands_table.py's tables verbatim: the calibration ratios from the
    case files, the bands from the committed result files (regenerate them with `python benchmarks/bands_table.py`)."""
    from benchmarks import bands_table

    with open(os.path.join(REPO, "docs", "performance.md")) as f:
        docs = f.read()
    assert HELD_OUT and {p for p, held in bands_table.case_files() if held} == set(HELD_OUT)
    assert bands_table.calibration_table() in docs
    assert bands_table.reranking_table() in docs


def test_nccl_efficiency_meets_the_published_all_to_all_figure():
    """NCCL all-to-all across 64 H800 (8 nodes): ~24 GB/s busbw on 50 GB/s NICs; and it falls with nodes."""
    assert network_model.nccl_efficiency(8) * DEVICES["h800"].nic_line_gbs == pytest.approx(24, abs=0.5)
    falls = [network_model.nccl_efficiency(n) for n in (2, 4, 8, 16, 32)]
    assert falls == sorted(falls, reverse=True) and falls[0] == network_model.NCCL_A2A_2_NODES


def test_group_limited_routing_reaches_at_most_four_of_eight_nodes():
    """DeepSeek-V3's routing on EP 64 over 8 nodes (one expert group per node): of K = 8 copies, 7 leave the
    node on average (uniform), and a token reaches 4 nodes, 3.5 of them others (independent count)."""
    from models.presets import preset

    config = preset("deepseek_v3_671b", n_expert_groups=8, n_limited_groups=4)
    rows = layout_step.routing_rows(config, 64, 8)
    assert rows["copies_inter"] == pytest.approx(7.0, abs=0.2)  # sampling: 128 tokens x 64 ranks
    assert rows["copies_intra"] == pytest.approx(8 * 7 / 64, abs=0.2)
    assert rows["nodes_inter"] == pytest.approx(3.5, abs=0.1)


def test_pipeline_bubbles_follow_the_published_formulas():
    from models.presets import preset

    base = dict(model=preset("debug"), device=DEVICES["h800"], gpus=64, gpus_per_node=8, seq_len=16,
                global_batch=32, micro_batch=1)
    run = lambda **kw: layout_step.Run(**base, **kw)  # noqa: E731  dp = 64 / 8 = 8, m = 32 / 8 = 4
    assert layout_step.bubble_fraction(run(pp=8)) == 7 / 4
    assert layout_step.bubble_fraction(run(pp=8, pp_schedule="interleaved", virtual_stages=2)) == 7 / 8
    assert layout_step.bubble_fraction(run(pp=8, pp_schedule="dualpipe")) == pytest.approx(3 * 2 / (3 * 4))


def test_contention_slows_only_the_overlapped_compute():
    share = network_model.COMM_SM_SHARE
    assert network_model.contended_compute_s(10.0, 0.0) == 10.0
    assert network_model.contended_compute_s(10.0, 4.0) == pytest.approx(6.0 + 4.0 / (1 - share))


def _write_case(tmp_path, edit):
    text = open(os.path.join(REPO, "benchmarks", "calibration", "torchtitan_dsv3_b200_nccl.toml")).read()
    path = tmp_path / "case.toml"
    path.write_text(edit(text))
    return str(path)


BAD = {
    "missing key": (lambda t: t.replace("global_batch = 1024\n", ""), "missing key step.global_batch"),
    "unknown device": (lambda t: t.replace('device = "b200"', 'device = "a100"'), "unknown device 'a100'"),
    "unknown dispatcher": (lambda t: t.replace('dispatcher = "nccl"', 'dispatcher = "mpi"'),
                           "step.dispatcher = 'mpi': expected one of nccl, deepep"),
    "layout does not divide": (lambda t: t.replace("pp = 1\n", "pp = 3\n"), "= 3 does not divide cluster.gpus = 256"),
    "pp beyond the layers": (lambda t: t.replace("gpus = 256", "gpus = 512").replace("pp = 1\n", "pp = 64\n"),
                             "layout.pp x virtual_stages = 64 x 1 exceeds the model's 61 layers"),
    "unknown key": (lambda t: t.replace("ep = 64", "ep = 64\nexperts = 3"), "unknown key(s) ['layout.experts']"),
    "wrong type": (lambda t: t.replace("seq_len = 4096", 'seq_len = "4k"'), "step.seq_len = '4k' must be int"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_case_files_are_one_line_exit_2(name, tmp_path, capsys):
    edit, message = BAD[name]
    with pytest.raises(SystemExit) as info:
        calibrate.main(["--case", _write_case(tmp_path, edit)])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and message in err, err
