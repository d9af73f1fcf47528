"""A config typo is refused before torch loads (launch/precheck.py): the config tree imports no torch, every
shipped config loads through each entry point's check, and each entry point run as a script exits 2 on a
typo without importing torch (`python -X importtime` lists every module the script imported), in one line
(argparse's typos of evaluate and generate too, and generate's sampling flags out of range or not finite). The
other tools' bad flags are one line and exit 2 as well, before torch loads where their argparse needs none."""

import importlib
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Run in a fresh interpreter (pytest's has torch loaded): every shipped config through every entry point's
# check, clean and with each typo, a TOML with a typo, and posttrain.init_from naming a run dir; one line per
# call on stderr, exit 2 for a typo; torch never imported.
CHECK_ALL_CONFIGS = r'''
import contextlib, glob, io, math, os, sys, tomllib
sys.path.insert(0, os.getcwd())
from launch import precheck

CHECKS = {"pretrain": lambda argv: precheck.training_job(argv),
          "posttrain": lambda argv: precheck.training_job(argv, path_source="rollouts"),
          "dry_run": lambda argv: precheck.tool_config(argv, prefix="config error"),
          "estimate_memory": lambda argv: precheck.tool_config(argv)}
PREFIX = {"pretrain": "config error: ", "posttrain": "config error: ", "dry_run": "config error: ",
          "estimate_memory": "error: "}
TYPOS = {"--training.stepz=3": "training.stepz: unknown key", "--trainng.steps=3": "trainng.steps: unknown section",
         "--optim.lr=abc": "optim.lr: expected a finite float", "--data.seq_len=0": "data.seq_len=0"}
# What a shipped config is refused for as written, on this machine: (config, checks) -> the message. K2.5 names
# the published checkpoint's directory (model.init_from to pretrain, posttrain.init_from to post-train).
REFUSED = {("kimi_k25_256gpu.toml", tuple(CHECKS)): "model.init_from: checkpoints/Kimi-K2.5: no such directory",
           ("kimi_k25_posttrain_256gpu.toml", tuple(CHECKS)):
               "posttrain.init_from=checkpoints/Kimi-K2.5: no such directory"}

def refusal(path, name):
    return next((m for (config, names), m in REFUSED.items() if config == os.path.basename(path) and name in names),
                None)

def call(check, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            check(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()

def world(path):
    p = tomllib.load(open(path, "rb")).get("parallel", {})
    dense = [p.get(k, -1) for k in ("dp_replicate", "dp_shard", "cp")]
    return p.get("pp", 1) * math.prod(dense) if min(dense) > 0 else 8

configs = sorted(glob.glob("configs/*.toml"))
assert len(configs) >= 7, configs
for path in configs:
    os.environ["WORLD_SIZE"] = str(world(path))
    for name, check in CHECKS.items():
        code, err = call(check, ["--config", path])
        expected = refusal(path, name)
        if expected:
            assert code == 2 and err == PREFIX[name] + expected + "\n", (path, name, err)
        elif (name == "posttrain") == path.endswith("posttrain_example.toml"):  # each job's own entry points
            assert code == 0 and err == "", (path, name, err)
        for typo, message in TYPOS.items():
            code, err = call(check, ["--config", path, typo])
            assert code == 2 and err.startswith(PREFIX[name] + message) and err.count("\n") == 1, (path, name, err)
toml = os.path.join(sys.argv[1], "typo.toml")
open(toml, "w").write(open("configs/debug.toml").read() + "\n[comm]\nheartbeet = true\n")
for name, check in CHECKS.items():
    code, err = call(check, ["--config", toml])
    assert code == 2 and err == PREFIX[name] + "comm.heartbeet: unknown key (valid: init_timeout_s, train_timeout_s, " \
        "checkpoint_timeout_s, trace_entries, heartbeat)\n", (name, err)
# posttrain.init_from = a run dir: the model config its newest checkpoint's marker records (runtime/posttrain/init_source.py)
import dataclasses, json
from models.presets import preset
run = os.path.join(sys.argv[1], "run")
os.makedirs(os.path.join(run, "checkpoints", "step_2"))
with open(os.path.join(run, "checkpoints", "step_2", "COMPLETE"), "w") as f:
    json.dump({"step": 2, "world_size": 8, "model": dataclasses.asdict(preset("debug"))}, f)
code, err = call(CHECKS["posttrain"], [f"--posttrain.init_from={run}", "--data.path=r.jsonl", "--model.dim=4096"])
assert code == 2 and err.startswith("config error: model.dim=4096 (checkpoint: "), err
heavy = sorted(m for m in ("torch", "numpy", "safetensors", "transformers") if m in sys.modules)
assert heavy == [], heavy
print("checked", len(configs), "configs")
'''


def test_every_shipped_config_and_typo_is_checked_without_torch(tmp_path):
    result = subprocess.run([sys.executable, "-c", CHECK_ALL_CONFIGS, str(tmp_path)], capture_output=True,
                            text=True, cwd=REPO, timeout=300, env=dict(os.environ, WORLD_SIZE="1", RANK="0"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("checked ")


# (script, arguments with a typo, the start of its one stderr line)
TYPO_RUNS = [
    ("launch/pretrain.py", ["--training.stepz=3"], "config error: training.stepz: unknown key"),
    ("launch/posttrain.py", ["--config", "configs/posttrain_example.toml", "--posttrain.top_k=x"],
     "config error: posttrain.top_k: expected int, got 'x'"),
    ("launch/dry_run.py", ["--config", "configs/kimi_k2_256gpu.toml", "--parallel.epp=2"],
     "config error: parallel.epp: unknown key"),
    ("launch/estimate_memory.py", ["--config", "configs/kimi_k2_256gpu.toml", "--optim.lr=-1"],
     "error: optim.lr=-1.0: must be finite and > 0"),
    ("launch/evaluate.py", ["--model", "RUN", "--holdout", "1.5"], "evaluate error: --holdout 1.5 must be in [0, 1)"),
    ("launch/evaluate.py", ["--model", "RUN", "--hold-out", "0.1"],
     "evaluate error: unrecognized arguments: --hold-out 0.1"),  # argparse's, no usage lines
    ("launch/evaluate.py", ["--modle", "RUN"], "evaluate error: the following arguments are required: --model"),
    ("launch/generate.py", ["--model", "RUN", "--temprature", "0"],
     "generate error: unrecognized arguments: --temprature 0"),
    ("launch/generate.py", ["--model", "RUN", "--top-p", "x"],
     "generate error: argument --top-p: invalid float value: 'x'"),
    ("launch/generate.py", ["--model", "RUN", "--temperature", "-1"],
     "generate error: sampling: temperature=-1.0 must be finite and >= 0, top_p=1.0 in (0, 1], max_new_tokens=64 >= 1"),
    ("launch/generate.py", ["--model", "RUN", "--top-p", "0"],
     "generate error: sampling: temperature=1.0 must be finite and >= 0, top_p=0.0 in (0, 1], max_new_tokens=64 >= 1"),
    ("launch/generate.py", ["--model", "RUN", "--max-new-tokens", "0", "--prompt", "hi"],
     "generate error: sampling: temperature=1.0 must be finite and >= 0, top_p=1.0 in (0, 1], max_new_tokens=0 >= 1"),
    ("launch/generate.py", ["--model", "RUN", "--temperature", "inf"],  # not a uniform draw
     "generate error: sampling: temperature=inf must be finite and >= 0, top_p=1.0 in (0, 1], max_new_tokens=64 >= 1"),
    ("launch/generate.py", ["--model", "RUN", "--top-p", "nan"],
     "generate error: sampling: temperature=1.0 must be finite and >= 0, top_p=nan in (0, 1], max_new_tokens=64 >= 1"),
]


def _run_script(script: str, argv: list[str], cwd) -> tuple[int, list[str], set[str]]:
    """(exit status, stderr lines, modules imported) of `python script argv` in a fresh interpreter."""
    argv = [os.path.join(REPO, a) if a.startswith("configs/") else a for a in argv]
    result = subprocess.run([sys.executable, "-X", "importtime", os.path.join(REPO, script), *argv],
                            capture_output=True, text=True, cwd=cwd, timeout=300)
    lines = result.stderr.splitlines()
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    return result.returncode, [line for line in lines if not line.startswith("import time:")], imported


def test_each_entry_point_exits_2_on_a_typo_before_importing_torch(tmp_path):
    for script, argv, message in TYPO_RUNS:
        code, said, imported = _run_script(script, argv, tmp_path)
        assert code == 2, (script, said)
        assert len(said) == 1 and said[0].startswith(message), (script, said)
        assert "launch.precheck" in imported and not {"torch", "numpy"} & imported, script
    assert os.listdir(tmp_path) == []  # nothing written (run.dir defaults to runs/debug under the cwd)


def test_generate_main_refuses_sampling_flags_with_the_precheck_line(capsys):
    """Called as a function (torch loaded), launch/generate.main gives the line its script run gives, before
    it looks for the model or the tokenizer (--model RUN does not exist)."""
    from launch import generate
    for script, argv, message in TYPO_RUNS:
        if script == "launch/generate.py" and "sampling:" in message:
            assert generate.main(argv) == 2
            assert capsys.readouterr().err == message + "\n"


def test_sampling_refuses_non_finite_temperature_and_top_p():
    """inf would make sampling a uniform draw (temperature) or keep every token (top_p); nan compares false."""
    from runtime.sampling import SamplingConfig

    for bad in ({"temperature": math.inf}, {"temperature": -math.inf}, {"temperature": math.nan},
                {"top_p": math.inf}, {"top_p": math.nan}):
        with pytest.raises(ValueError, match=r"^sampling: temperature=\S+ must be finite and >= 0, top_p="):
            SamplingConfig(**bad)


# (script, a bad flag, its one stderr line): each tool's argparse is precheck.ToolParser with the prefix of
# the tool's other errors; parsed before torch loads (dry_run parses its flags in its precheck block)
FLAG_RUNS = [
    ("launch/dry_run.py", ["--config", "configs/debug.toml", "--world", "x"],
     "config error: argument --world: invalid int value: 'x'"),
    ("launch/dry_run.py", ["--wrold", "8"], "config error: the following arguments are required: --config"),
    ("launch/tokenize_text.py", ["--tokenizer", "t", "--out", "o.bin", "--workers", "x", "a.txt"],
     "error: argument --workers: invalid int value: 'x'"),
    ("launch/tokenize_text.py", ["--tokenizer", "t", "--out", "o.bin", "--eso", "e", "a.txt"],
     "error: unrecognized arguments: --eso"),
    ("launch/prepare_rollouts.py", ["--tokenizer", "t", "--in", "i", "--out", "o", "--max-len", "x"],
     "error: argument --max-len: invalid int value: 'x'"),
    ("launch/prepare_rollouts.py", ["--tokenizer", "t", "--in", "i", "--out", "o", "--maxlen", "3"],
     "error: unrecognized arguments: --maxlen 3"),
    ("launch/plot_metrics.py", ["run", "--out", "c.png", "--dpi", "3"], "error: unrecognized arguments: --dpi 3"),
    ("launch/plot_metrics.py", ["run", "--out"], "error: argument --out: expected one argument"),
]


def test_each_tool_refuses_a_bad_flag_in_one_line_before_importing_torch(tmp_path):
    for script, argv, message in FLAG_RUNS:
        code, said, imported = _run_script(script, argv, tmp_path)
        assert code == 2 and said == [message], (script, said)
        assert "launch.precheck" in imported and "torch" not in imported, script
    assert os.listdir(tmp_path) == []


# Tools whose flags are checked after torch loads, called as functions (pytest has torch loaded): export_hf's
# and estimate_memory's parsers take choices and flags from modules that import torch (models.hf.checkpoint,
# planning/memory/posttrain.py); an unknown flag of dry_run and estimate_memory is a config override to them,
# refused by load_config, which names it
IN_PROCESS_FLAG_RUNS = [
    ("export_hf", ["--run-dir", "run", "--out", "hf", "--shard-gb", "x"],
     "export error: argument --shard-gb: invalid float value: 'x'"),
    ("export_hf", ["--run-dir", "run", "--out", "hf", "--dtpye", "float32"],
     "export error: unrecognized arguments: --dtpye float32"),
    ("estimate_memory", ["--config", "configs/debug.toml", "--rank", "x"],
     "error: argument --rank: invalid int value: 'x'"),
    ("estimate_memory", ["--config", "configs/debug.toml", "--rnak", "1"],
     "error: --rnak: expected --config PATH or --section.key=value (see --help)"),
    ("dry_run", ["--config", "configs/debug.toml", "--wrold", "8"],
     "config error: --wrold: expected --config PATH or --section.key=value (see --help)"),
]


def test_tools_that_need_torch_refuse_a_bad_flag_in_one_line(tmp_path, capsys):
    for tool, argv, message in IN_PROCESS_FLAG_RUNS:
        argv = [os.path.join(REPO, a) if a.startswith("configs/") else str(tmp_path / a) if a in ("run", "hf")
                else a for a in argv]
        with pytest.raises(SystemExit) as stop:
            importlib.import_module(f"launch.{tool}").main(argv)
        assert stop.value.code == 2
        assert capsys.readouterr().err.splitlines() == [message], tool
    assert os.listdir(tmp_path) == []
