"""Damaged Hugging Face directories under `--model.init_from`: a truncated shard, a malformed header or
index, layers the config does not declare, NaN weights. Each stops in one line naming the file, before
any process group where the headers show it, else on every rank with the run-dir lock released."""

import json
import os
import struct

import pytest
from safetensors.torch import load_file, save_file

from launch.pretrain import main
from models.hf.check import check_checkpoint
from models.hf.checkpoint import save_pretrained
from models.hf.config import read_hf_config
from multirank import run_ranks
from runtime.checkpoint.run_lock import LOCK_NAME, _try_lock
from seeded_models import seeded_model

ARGS = ["--data.source=synthetic", "--data.seq_len=16", "--data.batch_size=4", "--training.steps=1",
        "--training.warmup_steps=1", "--checkpoint.interval=0", "--parallel.dp_replicate=1", "--parallel.cp=1",
        "--parallel.edp_replicate=1"]
SHARD = "model.safetensors"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf"))
    model = seeded_model("debug")
    save_pretrained(model, path, shard_bytes=1 << 40)  # one file: model-00001-of-00001
    os.rename(os.path.join(path, "model-00001-of-00001.safetensors"), os.path.join(path, SHARD))
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    return path


def _copy(src, dst, *, config_edit=None, tensor_edit=None):
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config_edit(config) if config_edit else config, f)
    state = load_file(os.path.join(src, SHARD))
    save_file(tensor_edit(state) if tensor_edit else state, os.path.join(dst, SHARD))
    return dst


def _check_error(path) -> str:
    with pytest.raises(ValueError) as info:
        config, fmt = read_hf_config(path)
        check_checkpoint(path, config, fmt)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_truncated_shard_exits_2_at_start_up(hf_dir, tmp_path, capsys):
    """Header intact, data cut (an interrupted download): refused from the file size, nothing written."""
    bad = _copy(hf_dir, str(tmp_path / "cut"))
    shard = os.path.join(bad, SHARD)
    full = os.path.getsize(shard)
    os.truncate(shard, full - 1000)
    run_dir = tmp_path / "run"
    assert main(ARGS + [f"--model.init_from={bad}", f"--run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"config error: model.init_from: {shard}: truncated: its header places tensor data up to byte "
                   f"{full:,}, the file has {full - 1000:,} bytes (an interrupted download or copy?)"], err
    assert not run_dir.exists()


def test_malformed_header_entry_and_index_name_their_file(hf_dir, tmp_path):
    bad = _copy(hf_dir, str(tmp_path / "header"))
    shard = os.path.join(bad, SHARD)
    with open(shard, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(size)), f.read()
    key = next(k for k in header if k != "__metadata__")
    del header[key]["shape"]
    text = json.dumps(header).encode()
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    assert _check_error(bad).startswith(f"{shard}: malformed safetensors header entry for '{key}'")

    with open(shard, "wb") as f:  # not a safetensors file: its first 8 bytes read as a header of ~1e12 bytes
        f.write(struct.pack("<Q", 10**12) + b"{}")
    assert _check_error(bad) == (f"{shard}: not a readable safetensors file (its header length 1,000,000,000,000 "
                                 f"exceeds the file's 10 bytes)")  # was a MemoryError

    index_dir = _copy(hf_dir, str(tmp_path / "index"))
    index = os.path.join(index_dir, "model.safetensors.index.json")
    for garbage in ('{"weight_map": {"a": ', '["not", "a", "map"]', '{"weight_map": {"a": "../x"}}'):
        with open(index, "w") as f:
            f.write(garbage)
        assert _check_error(index_dir).startswith(f"{index}: not a"), garbage


def test_layers_beyond_the_config_are_unexpected_unless_declared_mtp(hf_dir, tmp_path):
    """config.json says 2 layers, the weights hold 3: the third is a real layer, not an MTP module."""
    shallow = _copy(hf_dir, str(tmp_path / "shallow"), config_edit=lambda c: dict(c, num_hidden_layers=2))
    message = _check_error(shallow)
    assert "unexpected tensor(s), e.g. ['model.layers.2." in message
    assert "(layers 2..2: the model has n_layers=2 and config.json declares 0 multi-token-prediction layers)" in message
    # declared as one MTP layer: its keys are skipped with a note
    mtp = _copy(hf_dir, str(tmp_path / "mtp"),
                config_edit=lambda c: dict(c, num_hidden_layers=2, num_nextn_predict_layers=1))
    config, fmt = read_hf_config(mtp)
    assert check_checkpoint(mtp, config, fmt)[0].endswith("multi-token-prediction tensors (layers >= 2)")
    # a smaller model.n_layers on the command line leaves layer 2 neither used nor MTP
    config, fmt = read_hf_config(hf_dir)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\), e.g. \['model.layers.2."):
        check_checkpoint(hf_dir, config.__class__(**{**config.__dict__, "n_layers": 2}), fmt)


def _nan_in_expert_7(state):
    key = next(k for k in state if ".mlp.experts.7.down_proj" in k)
    state[key][0, 0] = float("nan")
    return state


def _run(rank, world_size, argv):
    return main(argv)


def test_nan_weight_read_by_one_rank_stops_every_rank_and_releases_the_lock(hf_dir, tmp_path):
    """Expert 7 of 8 lives on rank 1 only (ep=2): the NaN is seen there at load; both ranks exit 2 together."""
    bad = _copy(hf_dir, str(tmp_path / "nan"), tensor_edit=_nan_in_expert_7)
    run_dir = tmp_path / "run"
    argv = ARGS + [f"--model.init_from={bad}", f"--run.dir={run_dir}", "--parallel.dp_shard=2", "--parallel.ep=2",
                   "--parallel.edp_shard=1"]
    assert run_ranks(_run, 2, argv, as_torchrun=True, timeout=300) == [2, 2]
    fd, holder = _try_lock(str(run_dir / LOCK_NAME))
    assert fd is not None and holder is None
    os.close(fd)
    assert not (run_dir / "checkpoints").exists() or not os.listdir(run_dir / "checkpoints")


def test_nan_weight_message_names_file_and_key(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, str(tmp_path / "nan"), tensor_edit=_nan_in_expert_7)
    argv = ARGS + [f"--model.init_from={bad}", f"--run.dir={tmp_path / 'run'}", "--parallel.dp_shard=1",
                   "--parallel.ep=1", "--parallel.edp_shard=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"model.init_from: {bad}/{SHARD}: model.layers.") and \
        "holds non-finite values (NaN or inf)" in err[0], err


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{", "not valid JSON ('utf-8' codec can't decode byte 0xff"),
    (b"[1, 2]", "not a model config (a JSON list, not an object)"),
    (b"[" * 100000, "not valid JSON (maximum recursion depth exceeded"),
], ids=["not_utf8", "a_list", "nested_too_deeply"])
def test_bad_config_json_names_the_file(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_hf_config(str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path}/config.json: {message}"), str(info.value)
