"""`--model.init_from` on real gloo ranks: every layout loads the same weights as one process, takes the
same first step, and each rank reads only about its share of the checkpoint's bytes; launch/export_hf.py
writes a DCP checkpoint back out, and its user mistakes exit 2 in one line."""

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from hf_cases import ARGS, HEADLINE, HSDP, MATRIX_DIM, ONE, _fp8_copy, ep4_sharded_model  # noqa: E402
from hf_reference import hf_config, random_hf_model  # noqa: E402
from models.hf.checkpoint import load_pretrained, load_state  # noqa: E402
from models.hf.files import CheckpointFiles  # noqa: E402
from multirank import run_ranks  # noqa: E402
from parallel.meshes import build_meshes  # noqa: E402
from runtime import train as T  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402

# Losses: the same fp32 step in a different reduction order (tests/ranks/test_parallel_parity.py measures
# <= 5e-7 relative); 1e-5 leaves 20x room for that and none for a real bug. Weights: copied bytes, so equal exactly.
LOSS_RTOL = 1e-5


def _first_step(rank, world_size, cases, run_dir):
    """Per case: (full parameters and router biases on rank 0, first-step loss)."""
    out = {}
    for name, (path, parallel) in cases.items():
        config = load_config(ARGS + parallel + [f"--model.init_from={path}", f"--run.dir={run_dir}"])
        layout = config.layout(world_size)
        meshes = build_meshes(layout, "cpu")
        model = T.build_model(config, meshes, layout, torch.device("cpu"))
        weights = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}  # before the step
        weights |= {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
        optimizer = T.build_optimizer(model, config)
        scheduler = T.build_scheduler(optimizer, config.training)
        stats = T.train_step(model, optimizer, scheduler, T.build_loader(config, meshes, layout), config,
                             torch.device("cpu"))
        out[name] = (weights if rank == 0 else None, stats["loss"])
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    dirs = {"e8": str(base / "e8"), "e4": str(base / "e4")}
    random_hf_model(hf_config()).save_pretrained(dirs["e8"])
    random_hf_model(hf_config(n_routed_experts=4, n_group=2, topk_group=1), seed=1).save_pretrained(str(base / "e4_plain"))
    _fp8_copy(str(base / "e4_plain"), dirs["e4"], str(base / "e4_dequantized"))  # FP8 blocks under Shard(1)
    return dirs


def test_every_layout_loads_the_single_process_weights_and_step(hf_dirs, tmp_path):
    cases = {"headline_cp2_ep8": (hf_dirs["e8"], HEADLINE), "experts_on_matrix_dim": (hf_dirs["e4"], MATRIX_DIM),
             "hsdp_ehsdp_ep2": (hf_dirs["e8"], HSDP),
             "experts_on_matrix_dim_edp_shard_inner": (hf_dirs["e4"],
                                                       MATRIX_DIM + ["--parallel.expert_inner=edp_shard"])}
    eight = run_ranks(_first_step, 8, cases, str(tmp_path / "run8"), timeout=300)
    one = run_ranks(_first_step, 1, {k: (p, ONE) for k, (p, _) in cases.items()}, str(tmp_path / "run1"))[0]
    for name, (path, _) in cases.items():
        reference = load_pretrained(path).state_dict()
        weights, loss = eight[0][name]
        assert all(r[name][1] == loss for r in eight)  # a global value: the same on every rank
        assert abs(loss - one[name][1]) <= LOSS_RTOL * abs(one[name][1]), (name, loss, one[name][1])
        for key, tensor in weights.items():
            assert torch.equal(tensor, reference[key]), (name, key)
            assert torch.equal(tensor, one[name][0][key]), (name, key)


def _bytes_read(rank, world_size, path, run_dir):
    return load_state(ep4_sharded_model(path, run_dir, world_size), path)


def test_each_of_four_ranks_reads_about_a_quarter(hf_dirs, tmp_path):
    path = hf_dirs["e8"]
    files = CheckpointFiles.scan(path)
    sizes = {k: torch.Size(files.shape(k)).numel() * 4 for k in files.entries}  # fp32
    total = sum(sizes.values())
    # Allowed above total/4: torch.chunk rounds a shard up by at most one row per tensor; a rank's
    # rotary rows of q_b_proj / kv_a_proj span at most one more rotary block (8 rows) of the head
    # order; the router bias (a replicated buffer) is read whole by every rank.
    rows = {k: files.shape(k)[0] for k in files.entries}
    slack = sum(sizes[k] // rows[k] * (8 if ("q_b_proj" in k or "kv_a_proj" in k) else 1) for k in sizes)
    slack += sum(sizes[k] for k in sizes if k.endswith("e_score_correction_bias"))
    per_rank = run_ranks(_bytes_read, 4, path, str(tmp_path / "run"))
    print(f"checkpoint {total} B; read per rank {per_rank} B (total/4 = {total / 4:.0f}, slack {slack})")
    assert max(per_rank) <= total / 4 + slack, (per_rank, total, slack)
    assert sum(per_rank) >= total  # every byte is read by some rank


def test_resuming_run_dir_ignores_init_from(hf_dirs, tmp_path, capsys):
    from launch.pretrain import main

    run_dir = str(tmp_path / "run")
    argv = ARGS + ONE + [f"--model.init_from={hf_dirs['e8']}", f"--run.dir={run_dir}", "--training.steps=1"]
    assert run_ranks(lambda r, w: main(argv), 1, as_torchrun=True) == [0]
    argv2 = [a if not a.startswith("--training.steps") else "--training.steps=2" for a in argv]
    capture = run_ranks(_capture_main, 1, argv2, as_torchrun=True)[0]
    assert capture[0] == 0 and "model.init_from=" in capture[1] and "is ignored" in capture[1]


def _capture_main(rank, world_size, argv):
    import contextlib
    import io

    from launch.pretrain import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_bad_init_from_exits_2_before_anything(hf_dirs, tmp_path):
    from launch.pretrain import main

    run_dir = tmp_path / "run"
    bad = str(tmp_path / "missing")
    assert main(ARGS + [f"--model.init_from={bad}", f"--run.dir={run_dir}"]) == 2
    assert main(ARGS + [f"--model.init_from={hf_dirs['e8']}", "--model.moe_inter_dim=24", f"--run.dir={run_dir}"]) == 2
    assert not run_dir.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # reading the checkpoint in one process
def test_export_from_dcp_loads_into_transformers(hf_dirs, tmp_path):
    """Train one step on 2 ranks from a Hugging Face directory, export the DCP checkpoint, and check:
    the export holds exactly the checkpoint's weights, and transformers computes our logits from it."""
    import torch.distributed.checkpoint as dcp
    from transformers import DeepseekV3ForCausalLM

    from launch.export_hf import PREFIX, checkpoint_model_config, export
    from launch.pretrain import main
    from hf_cases import REL_TOL, _rel_err, _tokens

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "export")
    argv = ARGS + [f"--model.init_from={hf_dirs['e8']}", f"--run.dir={run_dir}", "--training.steps=1",
                   "--parallel.dp_shard=2", "--parallel.cp=1", "--parallel.ep=2", "--parallel.edp_shard=1"]
    assert run_ranks(lambda r, w: main(argv), 2, as_torchrun=True) == [0, 0]
    step = export(run_dir, out, dtype="float32", shard_bytes=40_000)
    trained = T.Transformer(checkpoint_model_config(step))
    state = {PREFIX + k: v for k, v in trained.state_dict().items()}
    dcp.load(state, checkpoint_id=step, no_dist=True)
    trained.load_state_dict({k[len(PREFIX):]: v for k, v in state.items()})
    exported = load_pretrained(out)
    for (name, a), (_, b) in zip(trained.state_dict().items(), exported.state_dict().items()):
        assert name.endswith("tokens_per_expert") or torch.equal(a, b), name
    assert not torch.equal(trained.output.weight, load_pretrained(hf_dirs["e8"]).output.weight)  # it trained
    hf = DeepseekV3ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert _rel_err(exported.eval()(_tokens()), hf(input_ids=_tokens()).logits) < REL_TOL


def test_export_bad_step_exits_2(tmp_path, capsys):
    from launch.export_hf import main

    assert main(["--run-dir", str(tmp_path), "--out", str(tmp_path / "out"), "--step", "3"]) == 2
    assert "--step 3: no complete checkpoint" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run dir with one complete checkpoint, step_1, of the debug model trained one step on one rank."""
    from launch.pretrain import main

    run_dir = str(tmp_path_factory.mktemp("trained") / "run")
    argv = ARGS + ONE + ["--training.steps=1", "--eval.interval=0", f"--run.dir={run_dir}"]
    assert run_ranks(lambda r, w: main(argv), 1, as_torchrun=True) == [0]
    return run_dir


def _damage(step_dir, how):
    shards = sorted(f for f in os.listdir(step_dir) if f.endswith(".distcp"))
    if how == "truncate_shard":
        os.truncate(os.path.join(step_dir, shards[0]), 4096)  # inside the first weight
    elif how == "delete_shard":
        os.remove(os.path.join(step_dir, shards[0]))
    elif how == "delete_metadata":
        os.remove(os.path.join(step_dir, ".metadata"))
    elif how == "marker_adds_a_layer":  # the marker's model config asks for a weight the checkpoint lacks
        with open(os.path.join(step_dir, "COMPLETE")) as f:
            meta = json.load(f)
        meta["model"]["n_layers"] += 1
        with open(os.path.join(step_dir, "COMPLETE"), "w") as f:
            json.dump(meta, f)
    elif how == "marker_other_width":  # a hand-edited model.dim: every weight has another shape (was an AssertionError)
        with open(os.path.join(step_dir, "COMPLETE")) as f:
            meta = json.load(f)
        meta["model"]["dim"] += 16
        with open(os.path.join(step_dir, "COMPLETE"), "w") as f:
            json.dump(meta, f)


def _word_level(directory) -> None:
    """`directory`/tokenizer.json: a 3-token word-level tokenizer (fits any model)."""
    tokenizers = pytest.importorskip("tokenizers")
    directory.mkdir()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.save(str(directory / "tokenizer.json"))


# (argv after the defaults `--run-dir {run} --out {tmp}/out`, later flags win; damage; the message's key phrase)
EXPORT_MISTAKES = {
    "run_dir_missing": (["--run-dir", "{tmp}/nope"], None, "--run-dir {tmp}/nope: no such directory"),
    "run_dir_is_a_file": (["--run-dir", "{tmp}/file"], None, "--run-dir {tmp}/file: not a directory"),
    "run_dir_is_the_checkpoint": (["--run-dir", "{run}/checkpoints/step_1"], None,
                                  "is a checkpoint: give the run directory that holds checkpoints/ (and --step 1)"),
    "run_dir_is_checkpoints": (["--run-dir", "{run}/checkpoints"], None,
                               "--run-dir {run}/checkpoints is a checkpoints/ directory"),
    "shard_gb_zero": (["--shard-gb", "0"], None, "--shard-gb 0.0: must be a number of GiB > 0"),
    "shard_gb_negative": (["--shard-gb", "-1"], None, "--shard-gb -1.0: must be a number of GiB > 0"),
    "shard_gb_inf": (["--shard-gb", "inf"], None, "--shard-gb inf: must be a number of GiB > 0"),
    "out_is_a_file": (["--out", "{tmp}/file"], None, "--out {tmp}/file is a file: give a new or an empty dir"),
    "out_not_empty": (["--out", "{run}"], None, "--out {run} exists and is not empty"),
    "out_under_a_file": (["--out", "{tmp}/file/out"], None,
                         "--out {tmp}/file/out: its parent {tmp}/file is not a directory"),
    "out_inside_the_run": (["--out", "{run}/export"], None, "--out {run}/export is inside --run-dir {run}: give a"),
    "out_inside_the_checkpoint": (["--out", "{run}/checkpoints/step_1/new/hf"], None,
                                  "--out {run}/checkpoints/step_1/new/hf is inside --run-dir {run}"),
    "out_inside_the_tokenizer": (["--tokenizer", "{tmp}/tok", "--out", "{tmp}/tok/export"], None,
                                 "--out {tmp}/tok/export is inside --tokenizer {tmp}/tok: give a"),
    "trust_remote_code_without_tokenizer": (["--trust-remote-code"], None,
                                            "--trust-remote-code has no effect without --tokenizer"),
    "truncated_shard": ([], "truncate_shard", "does not load, a shard file is missing or damaged (EOFError)"),
    "truncated_shard_new_parents": (["--out", "{tmp}/new/parents/out"], "truncate_shard",
                                    "does not load, a shard file is missing or damaged (EOFError)"),
    "missing_shard": ([], "delete_shard", "does not load, a shard file is missing or damaged (FileNotFoundError: "),
    "missing_metadata": ([], "delete_metadata", "step_1: unreadable DCP metadata (FileNotFoundError: "),
    "marker_config_not_the_weights": ([], "marker_adds_a_layer", "holds no layers.3.attention_norm.weight, a weight"),
    "marker_other_width": ([], "marker_other_width", "tok_embeddings.weight is [256, 64] in the checkpoint but "
                           "[256, 80] by the model config its COMPLETE marker records (model.dim=80"),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", list(EXPORT_MISTAKES))
def test_export_mistakes_exit_2_in_one_line_and_write_nothing(trained_run, tmp_path, capsys, case):
    from launch.export_hf import main

    extra, damage, phrase = EXPORT_MISTAKES[case]
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained_run, run_dir)
    if damage:
        _damage(os.path.join(run_dir, "checkpoints", "step_1"), damage)
    (tmp_path / "file").write_text("")
    _word_level(tmp_path / "tok")
    fill = {"tmp": str(tmp_path), "run": run_dir}
    argv = [a.format(**fill) for a in ["--run-dir", "{run}", "--out", "{tmp}/out", *extra]]
    before = sorted(os.listdir(run_dir))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("export error: ") and phrase.format(**fill) in err, err
    assert not os.path.exists(tmp_path / "out") and sorted(os.listdir(run_dir)) == before  # nothing written
    assert not os.path.exists(tmp_path / "new") and os.listdir(tmp_path / "tok") == ["tokenizer.json"]


def test_export_creates_the_missing_parents_of_out(trained_run, tmp_path):
    from launch.export_hf import main

    out = tmp_path / "new" / "parents" / "out"
    assert main(["--run-dir", trained_run, "--out", str(out), "--dtype", "float32"]) == 0
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(out))
