"""Config: TOML + `--section.key=value`, typed values, one-line errors naming the key, --help, layouts."""

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

import pytest
import torch

from models import preset
from optim.config import OptimConfig
from parallel.layout import ParallelConfig
from runtime.config import ConfigError, JobConfig, default_layout, fill_layout
from runtime.config_parser import field_help, help_text, load_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIGS = os.path.join(REPO, "configs")


def _toml(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_debug_toml_is_the_embedded_default():
    assert load_config(["--config", os.path.join(CONFIGS, "debug.toml")]) == load_config([]) == JobConfig()


def test_toml_then_command_line_overrides(tmp_path):
    path = _toml(tmp_path, '[model]\nn_layers = 2\n[training]\nsteps = 50\ngrad_clip = 2\n[profile]\nsteps = [5, 6]\n')
    config = load_config([f"--config={path}", "--training.steps=7", "--model.preset=debug_gqa",
                          "--optim.nesterov=false", "--optim.lr=3", "--data.source=synthetic",
                          "--profile.enabled=true", "--run.dir=/x"])
    assert config.training.steps == 7 and config.training.grad_clip == 2.0  # TOML int accepted for a float
    assert isinstance(config.training.grad_clip, float) and isinstance(config.optim.lr, float)
    assert config.model_preset == "debug_gqa" and config.model == preset("debug_gqa", n_layers=2)
    assert config.optim.nesterov is False and config.profile.enabled is True and config.profile.steps == (5, 6)
    assert config.data.source == "synthetic" and config.run.dir == "/x"
    assert load_config(["--profile.steps=[1, 2,3]"]).profile.steps == (1, 2, 3)
    assert load_config(["--profile.steps="]).profile.steps == ()


@pytest.mark.parametrize("argv, toml, message", [
    (["--training.steps=abc"], None, "training.steps: expected int, got 'abc'"),
    ([], '[training]\nsteps = "10"\n', "training.steps: expected int, got '10'"),
    ([], "[training]\nsteps = 1.5\n", "training.steps: expected int, got 1.5"),
    ([], "[training]\nseed = true\n", "training.seed: expected int, got True"),
    (["--optim.lr=fast"], None, "optim.lr: expected a finite float, got 'fast'"),
    (["--optim.nesterov=yes"], None, "optim.nesterov: expected bool, got 'yes'"),
    (["--training.schedule=linear"], None, "training.schedule: expected one of 'cosine', 'wsd', got 'linear'"),
    (["--parallel.expert_inner=cp"], None, "parallel.expert_inner: expected one of 'ep', 'edp_shard', got 'cp'"),
    (["--profile.steps=1,x"], None, "profile.steps: expected int, got 'x'"),
    (["--training.stepz=1"], None, "training.stepz: unknown key"),
    ([], "[trainin]\nsteps = 1\n", "trainin: unknown section"),
    (["--nope.steps=1"], None, "nope.steps: unknown section 'nope'"),
    (["--model.preset=gpt5"], None, "model.preset: unknown preset 'gpt5'"),
    (["--model.depth=3"], None, "model.depth: unknown key"),
    (["--model.dim=0"], None, "model.dim=0 must be >= 1"),
    (["--training.warmup_steps=-1"], None, "training.warmup_steps=-1 must be >= 0"),
    (["--checkpoint.keep=-1"], None, "checkpoint.interval=100 and checkpoint.keep=-1 must be >= 0"),
    (["--data.source=bin"], None, "data.path: source 'bin' needs the path of a token file"),
    (["stray"], None, "stray: expected --config PATH or --section.key=value"),
    (["--profile.enabled=true", "--profile.steps="], None, "profile.steps is empty but profile.enabled=true"),
    (["--profile.steps=5,3"], None, "profile.steps=5,3 must be consecutive and increasing"),
    (["--profile.steps=-1,0"], None, "profile.steps=-1,0 must be >= 0"),
    (["--profile.enabled=true", "--training.steps=4"], None, "profile.steps=3,4 but training.steps=4: the last "
                                                              "step is 3 (0-based)"),
    ([], "[training\n", "--config: "),
])
def test_errors_are_one_line_naming_the_key(tmp_path, argv, toml, message):
    if toml is not None:
        argv = ["--config", _toml(tmp_path, toml)] + argv
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_compile_takes_a_toml_bool_as_the_docs_write_it(tmp_path):
    for text, want in (("true", "true"), ("false", "false"), ('"auto"', "auto")):
        path = _toml(tmp_path, f"[training]\ncompile = {text}\n")
        assert load_config([f"--config={path}"]).training.compile == want
    with pytest.raises(ConfigError, match=r"^training.compile: expected one of 'auto', 'true', 'false', got 1$"):
        load_config([f"--config={_toml(tmp_path, '[training]' + chr(10) + 'compile = 1' + chr(10))}"])


def test_binary_toml_names_the_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=f"--config: {path} is not valid TOML"):
        load_config(["--config", str(path)])


def test_optim_config_rejects_inf_when_built_directly():
    with pytest.raises(ValueError, match=r"optim.lr=inf: must be finite and > 0"):
        OptimConfig(lr=math.inf)


def test_zero_lr_is_refused_in_one_line():
    """lr 0 trains nothing (every step leaves the weights as they are): refused like a negative lr."""
    with pytest.raises(ConfigError, match=r"^optim.lr=0.0: must be finite and > 0 \(0 trains nothing\)$"):
        load_config(["--optim.lr=0"])


@pytest.mark.parametrize("argv, world_size, message", [
    (["--parallel.cp=3"], 8, r"dense layout .*cp=3"),
    (["--parallel.ep=3", "--data.batch_size=12"], 6, r"parallel.ep=3 does not divide model.n_routed_experts=8"),
    (["--data.batch_size=10"], 8, r"data.batch_size=10 is not divisible by training.grad_accum=1 x data-parallel "
                                  r"degree 4 = 4"),
    (["--training.grad_accum=3"], 1, r"data.batch_size=16 is not divisible by training.grad_accum=3"),
    (["--data.seq_len=130"], 8, r"data.seq_len=130 is not divisible by 2\*cp=4"),
    (["--data.seq_len=512"], 1, r"^data.seq_len=512 exceeds model.max_seq_len=256"),
    (["--parallel.dp_shard=0"], 2, r"^parallel.dp_shard=0: degrees must be positive or -1"),  # not a ZeroDivisionError
    (["--parallel.edp_shard=0", "--parallel.ep=-1"], 2, r"^parallel.edp_shard=0: degrees must be positive or -1"),
    # 1000 pieces of 512 copies per expert: 45x slower steps with no word before this refusal
    (["--parallel.ep_overlap_chunks=1000"], 2, r"^parallel.ep_overlap_chunks=1000 is more than the 512 token copies "
                                              r"each expert receives per micro-batch \(8 sequence\(s\) x data.seq_len=128"),
])
def test_impossible_layouts_fail_naming_the_key(argv, world_size, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(argv).layout(world_size)
    assert "\n" not in str(error.value)


def test_rollouts_ignore_the_token_batch_shape_unless_eval_reads_a_token_file():
    """Rollouts are packed by data.batch_tokens: data.seq_len and data.batch_size only shape eval.path's batches."""
    rollouts = ["--config", os.path.join(CONFIGS, "posttrain_example.toml"), "--model.max_seq_len=200"]
    config = load_config(rollouts)  # data.seq_len=128 would not fit a 100-token model, but nothing reads it
    assert config.layout(1).dp == 1 and load_config(rollouts + ["--model.max_seq_len=100"]).layout(1).dp == 1
    with pytest.raises(ConfigError, match=r"^data.batch_size=3 has no effect: rollouts are packed by data.batch_tokens"):
        load_config(rollouts + ["--data.batch_size=3"])  # a key without effect is refused (issue 33)
    assert set(config.token_splits()) == set() and set(JobConfig().token_splits()) == {"train", "eval"}
    with_eval = load_config(rollouts + ["--eval.path=held_out.bin", "--data.batch_size=3"])
    assert with_eval.token_splits()["eval"][0].path == "held_out.bin" and with_eval.token_splits()["eval"][2] == "eval.path"
    with pytest.raises(ConfigError, match=r"data.batch_size=3 is not divisible by training.grad_accum=1 x "
                                          r"data-parallel degree 2 = 2"):
        with_eval.layout(2)


def test_default_layout_is_the_headline_on_8_ranks():
    layout = JobConfig().layout(8)
    assert (layout.dp_replicate, layout.dp_shard, layout.cp) == (1, 4, 2)
    assert (layout.edp_replicate, layout.edp_shard, layout.ep) == (1, 1, 8)
    for world_size, (dp_shard, ep, edp_shard) in {1: (1, 1, 1), 2: (2, 2, 1), 4: (4, 4, 1), 16: (16, 8, 2)}.items():
        layout = JobConfig().layout(world_size)
        assert (layout.dp_shard, layout.cp, layout.ep, layout.edp_shard) == (dp_shard, 1, ep, edp_shard), world_size
    assert default_layout(6, n_experts=8).ep == 2  # the widest ep dividing both 6 ranks and 8 experts


def test_explicit_degrees_are_kept_and_one_unknown_left_to_infer():
    infer = dict(dp_replicate=-1, dp_shard=-1, cp=-1, ep=-1, edp_replicate=-1, edp_shard=-1)
    filled = fill_layout(ParallelConfig(**{**infer, "dp_shard": 8}), 8, n_experts=8)
    assert (filled.dp_replicate, filled.dp_shard, filled.cp) == (1, 8, -1)  # resolve() infers cp = 1
    filled = fill_layout(ParallelConfig(**{**infer, "cp": 4, "ep": 2}), 8, n_experts=8)
    assert (filled.dp_replicate, filled.dp_shard, filled.cp, filled.ep, filled.edp_shard) == (1, -1, 4, 2, -1)
    layout = load_config(["--parallel.cp=4", "--parallel.ep=2"]).layout(8)
    assert (layout.dp_shard, layout.cp, layout.ep, layout.edp_shard) == (2, 4, 2, 4)


@pytest.mark.parametrize("name, world_sizes, experts", [
    ("kimi_k2_256gpu", [256], (1, 4, 64, "ep")), ("deepseek_v3_256gpu", [256], (1, 4, 64, "ep")),
    ("moonlight_16b", [8, 64], (None, None, 8, "ep")),
])
def test_large_configs_load_and_fit_their_world_size(name, world_sizes, experts):
    config = load_config(["--config", os.path.join(CONFIGS, f"{name}.toml")])
    assert config.training.param_dtype == "bfloat16" and config.data.source == "bin"
    for world_size in world_sizes:
        layout = config.layout(world_size)
        assert layout.dp_shard == 8, layout  # dense FSDP inside one 8-GPU node
        got = (layout.edp_replicate, layout.edp_shard, layout.ep, layout.expert_inner)
        assert all(want in (None, g) for want, g in zip(experts, got)), got


@pytest.mark.parametrize("model", ["kimi_k2", "deepseek_v3"])
def test_large_configs_are_a_row_the_projection_cannot_tell_from_the_recommended_one(model):
    """The 256-GPU configs' layout and EP knobs: a row of the projection at 256 H200s whose cross-validated band
    overlaps the recommended row's (the fastest of every layout x dispatch combination that fits by the memory
    estimate: benchmarks/results/step_projection_<model>_h200.json, rerun with the command in
    docs/performance.md#re-ranked-on-the-cross-validated-bands), and that fits an H200 by the memory estimate (its
    figure recorded in the H100 results, where none fitting at 256 made the projection estimate every row).
    The config's own row is projected here, now (about 5 s), and must be the committed row figure for figure, so a
    change of the step model fails here until the JSON is regenerated; whether the recommended row is still the
    fastest that fits (every other row and the memory estimate: minutes) is benchmarks/recommended_rows.py's check."""
    from benchmarks import recommended_rows
    from planning.bands import overlap
    from planning.devices import DEVICES, device_model
    from planning.dual_mesh import Options, compute_rates, project_layout

    committed, recommended = recommended_rows.committed_rows(model, "h200")
    config = recommended_rows.config_row(model)
    job = load_config(["--config", os.path.join(CONFIGS, f"{model}_256gpu.toml")])
    device = device_model("h200", None)
    opts = Options(act_dtype="bfloat16", param_dtype="bfloat16", memory_gib=device.memory_gib)
    row = json.loads(json.dumps(project_layout(job, job.layout(256), device, compute_rates(device, None), opts)))
    figures = sorted(set(row) - {"cpu_paths", "band_rests_on"})  # those two describe, they do not measure
    assert {"time_s", "mfu", "tokens_per_gpu_s_band", "fsdp", "ep", "memory_gib"} <= set(figures)
    assert [k for k in figures if not _same_figures(row[k], committed[k])] == []
    assert (config["layout"], config["dispatch"]) == (row["layout"], row["dispatch"])
    assert overlap(row["tokens_per_gpu_s_band"], recommended["tokens_per_gpu_s_band"]), (row, recommended)
    estimated, _ = recommended_rows.committed_rows(model, "h100")  # every row estimated there
    assert estimated["estimate_gib"] <= DEVICES["h200"].memory_gib
    assert recommended_rows.differences(recommended, recommended, committed, config) == []
    moved = {**recommended, "time_s": {**recommended["time_s"], "step": recommended["time_s"]["step"] * 1.01}}
    assert [d.split(":")[0] for d in recommended_rows.differences(moved, recommended, committed, config)] == [
        "step time"]
    slow = {**committed, "tokens_per_gpu_s_band": [b / 10 for b in committed["tokens_per_gpu_s_band"]]}
    assert [d.split(":")[0] for d in recommended_rows.differences(recommended, recommended, slow, config)] == [
        "config band"]


def _same_figures(a, b, rel: float = 1e-9) -> bool:
    """Equal nested figures, floats to `rel` (the projection is plain float arithmetic)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_figures(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_figures(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=rel)
    return a == b


def test_the_k25_config_runs_k2_s_layout_and_dispatch():
    """K2.5 trains the K2 decoder: its [parallel] table is configs/kimi_k2_256gpu.toml's (the calibrated row)."""
    import tomllib

    tables = []
    for name in ("kimi_k2_256gpu", "kimi_k25_256gpu"):
        with open(os.path.join(CONFIGS, f"{name}.toml"), "rb") as f:
            tables.append(tomllib.load(f)["parallel"])
    assert tables[0] == tables[1]


def test_the_k2_h100_config_trains_k2_s_model_and_batch_in_16_stages():
    """configs/kimi_k2_256gpu_h100.toml: the K2 config's model, tokens per step and optimizer on 256 ranks as 16
    pipeline stages of 16 consecutive ranks (2 nodes), ep and dense FSDP over each stage. Its memory by stage and
    its dry run: tests/entry/test_dry_run_pp.py. It is not a planner row (those pipeline rows are ZeRO-1 layouts)."""
    h100, h200 = (load_config(["--config", os.path.join(CONFIGS, f"{n}.toml")])
                  for n in ("kimi_k2_256gpu_h100", "kimi_k2_256gpu"))
    assert (h100.model, h100.optim, h100.data) == (h200.model, h200.optim, h200.data)
    layout = h100.layout(256)
    assert (layout.pp, layout.stage_size, layout.dp_shard, layout.ep, layout.edp_shard) == (16, 16, 16, 16, 1)
    assert layout.pp_config.pp_schedule == "1f1b" and sum(layout.pp_config.pp_layers) == h100.model.n_layers
    assert h100.training.grad_accum * layout.dp == h100.data.batch_size  # one sequence per rank and micro-batch


def test_help_lists_every_key_with_its_default_and_a_meaning():
    text, defaults = help_text(), JobConfig()
    lines = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^  --(\S+?)=(\S*)\s+(.*)$", text, re.M)}
    sections = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(JobConfig)
                if f.name not in ("model_preset", "model_init_from")}
    expected = {"model.preset": "debug", "model.init_from": ""}
    for section, obj in sections.items():
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            expected[f"{section}.{f.name}"] = (str(value).lower() if isinstance(value, bool) else
                                              ",".join(map(str, value)) if isinstance(value, tuple) else str(value))
    assert set(lines) == set(expected)
    for key, default in expected.items():
        assert lines[key][0] == default, key
        assert lines[key][1].strip(), f"{key} has no help"


@dataclass(frozen=True, kw_only=True)
class _Documented:
    alpha: int = 1  # the alpha knob
    beta: float = field(default=2.0, metadata={"help": "from metadata"})  # ignored: metadata wins
    gamma: str = "x"


def test_field_help_reads_trailing_comments_and_metadata():
    assert field_help(_Documented) == {"alpha": "the alpha knob", "beta": "from metadata", "gamma": ""}


def test_the_launcher_sets_expandable_segments_unless_the_user_chose():
    from launch.pretrain import set_allocator_defaults

    env = {}
    set_allocator_defaults(env)
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # the new name and the legacy one
        env = {key: "max_split_size_mb:512"}
        set_allocator_defaults(env)
        assert env == {key: "max_split_size_mb:512"}


@pytest.mark.parametrize("name", ["kimi_k2_256gpu", "deepseek_v3_256gpu"])
def test_the_256_gpu_configs_prefetch_as_the_projections_assume(name):
    """The step projection overlaps FSDP with compute and the memory estimate holds one prefetched unit:
    explicit prefetch of 1 makes that hold whatever the host does (parallel/overlap.py)."""
    from planning.memory.pretrain import Job, fsdp_buffers

    config = load_config(["--config", f"configs/{name}.toml"])
    assert config.training.fsdp_prefetch == 1
    deeper = dataclasses.replace(config, training=dataclasses.replace(config.training, fsdp_prefetch=2))
    one, two = (fsdp_buffers(Job(c, c.layout(256), 0, "h200")) for c in (config, deeper))
    assert all(b >= a for a, b in zip(one, two)) and sum(two) > sum(one)


# moved from tests/ranks/test_ep_dispatch.py (EP knobs of the configs and of the launch)
@pytest.mark.parametrize("key", ["ep_dispatch_dtype", "ep_combine_grad_dtype"])
def test_fp8_dispatch_on_a_gpu_without_float8_fails_in_one_line_with_exit_2(monkeypatch, capsys, key):
    """Before any process group: a CUDA device of capability 8.0 (A100) has no float8."""
    from launch.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert main(["--training.device=cuda", "--parallel.ep=2", f"--parallel.{key}=float8_e4m3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"config error: parallel.{key}='float8_e4m3' needs a GPU with float8 support (compute "
                   "capability >= 8.9: Ada, Hopper or newer); this one is 8.0")
