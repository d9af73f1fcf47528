"""Data: the global batch of a step is the same under every layout; each rank gets its rows and CP chunks."""

import hashlib
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from parallel.context_parallel import load_balanced_positions
from runtime.data import corpus
from runtime.data.config import DataConfig
from runtime.data.loader import Loader, window_starts
from word_tokenizer import _tiny_tokenizer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _write_bin(path, tokens, dtype, vocab_size=None):
    np.asarray(tokens, dtype=dtype).tofile(path)
    if vocab_size is not None:
        with open(path + ".json", "w") as f:
            json.dump({"dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "num_tokens": len(tokens)}, f)


def _global_from_ranks(config, seed, step, dp, cp, grad_accum, vocab_size=None):
    """Reassemble the global batch [batch_size, seq_len] from every (dp, cp) rank's micro-batches."""
    inputs = torch.full((config.batch_size, config.seq_len), -1, dtype=torch.int64)
    labels = inputs.clone()
    per_micro, rows = config.batch_size // grad_accum, config.batch_size // (grad_accum * dp)
    for d in range(dp):
        for c in range(cp):
            loader = Loader(config, seed, dp_rank=d, dp_degree=dp, cp_rank=c, cp_degree=cp, grad_accum=grad_accum,
                            vocab_size=vocab_size)
            micro = loader.batch(step)
            assert len(micro) == grad_accum
            for m, (x_BS, y_BS, pos_S) in enumerate(micro):
                assert x_BS.shape == (rows, config.seq_len // cp) and pos_S.shape == (config.seq_len // cp,)
                first = m * per_micro + d * rows
                inputs[first:first + rows, pos_S] = x_BS
                labels[first:first + rows, pos_S] = y_BS
    return inputs, labels


@pytest.fixture(scope="module")
def bin_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bin") / "tokens.bin")
    _write_bin(path, np.random.default_rng(0).integers(0, 70000, size=5000), np.uint32, vocab_size=70000)
    return path


@pytest.mark.parametrize("source", ["corpus", "bin", "synthetic"])
def test_global_batch_is_the_same_under_every_layout(source, bin_path):
    config = DataConfig(source=source, seq_len=16, batch_size=8, path=bin_path if source == "bin" else "")
    vocab = 70000 if source != "corpus" else 256
    reference = Loader(config, seed=3, vocab_size=vocab).batch(5)  # single rank, one micro-batch
    assert len(reference) == 1
    ref_x, ref_y, ref_pos = reference[0]
    assert torch.equal(ref_pos, torch.arange(16))
    assert torch.equal(ref_x[:, 1:], ref_y[:, :-1])  # labels are the inputs shifted by one token
    for dp, cp, grad_accum in [(2, 2, 1), (4, 1, 2), (1, 4, 2), (8, 2, 1), (1, 1, 8)]:
        x, y = _global_from_ranks(config, 3, 5, dp, cp, grad_accum, vocab)
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y), (dp, cp, grad_accum)


def test_corpus_windows_come_from_the_corpus_at_the_drawn_starts():
    config = DataConfig(seq_len=32, batch_size=4)
    tokens = corpus.corpus_tokens()
    x_BS, y_BS, _ = Loader(config, seed=1).batch(7)[0]
    starts = window_starts(1, 7, 4, len(tokens), 32)
    for row, start in enumerate(starts):
        assert x_BS[row].tolist() == tokens[start:start + 32].tolist()
        assert y_BS[row].tolist() == tokens[start + 1:start + 33].tolist()


def test_batches_depend_on_seed_and_step_only():
    config = DataConfig(seq_len=16, batch_size=4)
    a, b = Loader(config, seed=0), Loader(config, seed=0)
    assert torch.equal(a.batch(2)[0].inputs_BS, b.batch(2)[0].inputs_BS)
    assert not torch.equal(a.batch(2)[0].inputs_BS, a.batch(3)[0].inputs_BS)
    assert not torch.equal(a.batch(2)[0].inputs_BS, Loader(config, seed=1).batch(2)[0].inputs_BS)


def test_loader_position_resumes_from_state_dict():
    config = DataConfig(seq_len=16, batch_size=4)
    first = Loader(config, seed=0, grad_accum=2)
    for _ in range(3):
        first.next_step()
    resumed = Loader(config, seed=0, grad_accum=2)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"step": 3}
    for got, want in zip(resumed.next_step(), first.next_step()):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_cp_chunks_are_load_balanced_and_cover_the_sequence():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    everything = torch.cat([load_balanced_positions(24, 3, r) for r in range(3)])
    assert sorted(everything.tolist()) == list(range(24))


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=16, batch_size=6, dp_degree=4), r"data.batch_size=6 is not divisible by training.grad_accum=1 "
                                                  r"x data-parallel degree 4 = 4"),
    (dict(seq_len=16, batch_size=8, dp_degree=2, grad_accum=3),
     r"data.batch_size=8 .*grad_accum=3 x data-parallel degree 2 = 6"),
    (dict(seq_len=18, batch_size=4, cp_degree=2), r"data.seq_len=18 is not divisible by 2\*cp=4"),
])
def test_split_errors_name_every_number(kwargs, message):
    split = ("dp_degree", "cp_degree", "grad_accum")
    config = DataConfig(**{k: v for k, v in kwargs.items() if k not in split})
    with pytest.raises(ValueError, match=message):
        Loader(config, seed=0, **{k: v for k, v in kwargs.items() if k in split})


def test_source_errors(tmp_path):
    short = str(tmp_path / "short.bin")
    _write_bin(short, range(10), np.uint16, vocab_size=300)
    with pytest.raises(ValueError, match=r"data.seq_len=16 needs windows of 17 tokens but the bin source has only 10"):
        Loader(DataConfig(source="bin", path=short, seq_len=16), seed=0)
    with pytest.raises(ValueError, match=r"vocab size 300 but model.vocab_size=256"):
        Loader(DataConfig(source="bin", path=short, seq_len=4), seed=0, vocab_size=256)
    with pytest.raises(ValueError, match=r"data.dtype=uint32 but the sidecar .* says uint16"):
        Loader(DataConfig(source="bin", path=short, seq_len=4, dtype="uint32"), seed=0)
    bare = str(tmp_path / "bare.bin")
    _write_bin(bare, range(100), np.uint16)
    with pytest.raises(ValueError, match=r"data.dtype: 'auto' needs the sidecar"):
        Loader(DataConfig(source="bin", path=bare, seq_len=4), seed=0)
    x_BS = Loader(DataConfig(source="bin", path=bare, seq_len=4, dtype="uint16"), seed=0).batch(0)[0].inputs_BS
    assert x_BS.dtype == torch.int64 and int(x_BS.max()) < 100
    with pytest.raises(ValueError, match=r"'synthetic' needs the model's vocab_size"):
        Loader(DataConfig(source="synthetic"), seed=0)
    with pytest.raises(ValueError, match=r"data.path: source 'bin' needs"):
        DataConfig(source="bin")


def test_corpus_is_deterministic_and_structured():
    tokens = corpus.corpus_tokens()
    # Pinned: a change of the generator silently changes every run's data; update deliberately.
    assert hashlib.sha256(tokens.tobytes()).hexdigest() == (
        "6b6a5aa462da4632b2159b84366db1a4dd4649a324c3b0a0d52c9c49ed3e7fef")
    assert 1 << 20 <= len(tokens) < 2 << 20 and int(tokens.max()) < corpus.VOCAB_SIZE
    # Structure a model can learn: zlib needs ~1.15 bits per byte (uniform bytes: 8, English prose: ~3).
    bits_per_byte = 8 * len(zlib.compress(tokens.tobytes(), 9)) / len(tokens)
    assert bits_per_byte < 2.0


def test_tokenize_script_writes_a_bin_the_loader_reads(tmp_path):
    ids = _tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("the cat sat\non the mat\n")
    (tmp_path / "b.txt").write_text("a cat dog\n")
    out = str(tmp_path / "train.bin")
    cmd = [sys.executable, os.path.join(REPO, "launch", "tokenize_text.py"),
           "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", out, "--eos", "<eos>",
           str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = [ids[w] for w in "the cat sat on the mat <eos> a cat [UNK] <eos>".split()]
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    with open(out + ".json") as f:
        assert json.load(f) == {"dtype": "uint16", "vocab_size": 8, "num_tokens": 11}
    x_BS, y_BS, _ = Loader(DataConfig(source="bin", path=out, seq_len=10, batch_size=1), seed=0).batch(0)[0]
    assert x_BS[0].tolist() == expected[:10] and y_BS[0].tolist() == expected[1:]


def test_no_launch_script_shadows_a_standard_library_module():
    # launch/ is sys.path[0] when its scripts run: a launch/tokenize.py broke `import torch` there.
    scripts = {name[:-3] for name in os.listdir(os.path.join(REPO, "launch")) if name.endswith(".py")}
    assert not scripts & set(sys.stdlib_module_names)


def test_tokenize_uses_uint32_above_65536_tokens(tmp_path):
    from launch.tokenize_text import tokenize_files

    ids = _tiny_tokenizer(str(tmp_path / "tokenizer.json"), extra_words=70000)
    (tmp_path / "a.txt").write_text("w69999 the w0\n")
    meta = tokenize_files(str(tmp_path / "tokenizer.json"), [str(tmp_path / "a.txt")], str(tmp_path / "o.bin"))
    assert meta == {"dtype": "uint32", "vocab_size": 70008, "num_tokens": 3}
    assert np.fromfile(tmp_path / "o.bin", dtype=np.uint32).tolist() == [ids["w69999"], ids["the"], ids["w0"]]


@pytest.mark.parametrize("case, message", [
    ("out_is_input", "--out {tmp}/a.txt is also an input file; writing it would destroy the input"),
    ("missing_tokenizer", "--tokenizer: no such file {tmp}/missing.json"),
    ("invalid_tokenizer", "--tokenizer: {tmp}/bad.json is not a valid tokenizer.json ("),
    ("empty_input", "the input files ({tmp}/empty.txt) hold no tokens"),
    ("missing_input", "no such input file {tmp}/nope.txt"),
])
def test_tokenize_errors_are_one_line_and_leave_nothing_behind(tmp_path, case, message):
    _tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("the cat sat\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.json").write_text('{"version": "1.0", "model": 42}')
    tokenizer, out, inputs = "tokenizer.json", "out.bin", ["a.txt"]
    if case == "out_is_input":
        out = "a.txt"
    elif case == "missing_tokenizer":
        tokenizer = "missing.json"
    elif case == "invalid_tokenizer":
        tokenizer = "bad.json"
    elif case == "empty_input":
        inputs = ["empty.txt"]
    else:
        inputs = ["nope.txt"]
    cmd = [sys.executable, os.path.join(REPO, "launch", "tokenize_text.py"), "--tokenizer", str(tmp_path / tokenizer),
           "--out", str(tmp_path / out)] + [str(tmp_path / name) for name in inputs]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: " + message.format(tmp=tmp_path)] or (
        case == "invalid_tokenizer" and result.stderr.startswith("error: " + message.format(tmp=tmp_path))
        and result.stderr.count("\n") == 1), result.stderr
    assert (tmp_path / "a.txt").read_text() == "the cat sat\n"  # the input survives
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp") or name.startswith("out.bin")]


# (--tokenizer, --out, input files, relative to tmp_path; the message's key phrase)
TOKENIZE_MISTAKES = {
    "tokenizer_is_a_directory": ("hf", "out.bin", ["a.txt"],
                                 "--tokenizer: {tmp}/hf is a directory; give the tokenizer.json"),
    "input_is_a_directory": ("tokenizer.json", "out.bin", ["a.txt", "hf"],
                             "input {tmp}/hf is a directory, not a text file"),
    "input_not_utf8": ("tokenizer.json", "out.bin", ["a.txt", "latin1.txt"],
                       "input file {tmp}/latin1.txt is not UTF-8 text (byte 0xe9: "),
    "out_is_the_tokenizer": ("tokenizer.json", "tokenizer.json", ["a.txt"],
                             "--out {tmp}/tokenizer.json is also the --tokenizer file; writing it would destroy"),
    "sidecar_is_the_tokenizer": ("tokenizer.json", "tokenizer", ["a.txt"],
                                 "--out {tmp}/tokenizer's sidecar {tmp}/tokenizer.json is also the --tokenizer file"),
    "out_is_a_directory": ("tokenizer.json", "hf", ["a.txt"],
                           "--out {tmp}/hf is a directory; give a file such as {tmp}/hf/train.bin"),
    "out_in_a_missing_directory": ("tokenizer.json", "nodir/out.bin", ["a.txt"],
                                   "--out {tmp}/nodir/out.bin: {tmp}/nodir does not exist"),
}


@pytest.mark.parametrize("case", list(TOKENIZE_MISTAKES))
def test_tokenize_mistakes_exit_2_in_one_line_and_touch_nothing(tmp_path, capsys, case):
    from launch.tokenize_text import main

    _tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "a.txt").write_text("the cat sat\n")
    (tmp_path / "latin1.txt").write_bytes("the caf\xe9 mat\n".encode("latin-1"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    tokenizer, out, inputs, phrase = TOKENIZE_MISTAKES[case]
    assert main(["--tokenizer", str(tmp_path / tokenizer), "--out", str(tmp_path / out),
                 *[str(tmp_path / name) for name in inputs]]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert phrase.format(tmp=tmp_path) in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before  # nothing written


def test_a_directory_as_a_token_source_is_called_a_directory(tmp_path):
    from runtime.data.loader import open_bin

    with pytest.raises(ValueError, match=r"^data.sources\[1\].path: '.*' is a directory; give a token file"):
        open_bin(str(tmp_path), key="data.sources[1].path")
