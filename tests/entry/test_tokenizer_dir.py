"""launch/tokenize_text.py with a Hugging Face tokenizer directory (runtime/data/tokenizer_dir.py): a tiny Kimi-style
tiktoken tokenizer (a `tiktoken.model` rank file + a `tokenization_kimi.py` loader named by `auto_map`)
tokenizes exactly as `transformers.AutoTokenizer(..., trust_remote_code=True)` and `tiktoken` itself do;
`--workers 1` and `--workers 4` write the same file; without `--trust-remote-code` it is refused in one line.
The same directory with launch/generate.py (ids in and text out as AutoTokenizer's) and launch/export_hf.py
--tokenizer (its files carried whole, bos/eos ids right), each refusing it without the flag."""

import base64
import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
tiktoken = pytest.importorskip("tiktoken")

# Kimi's pre-tokenizer pattern (tokenization_kimi.py of the K2 / K2.5 repositories)
PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MERGES = [b"th", b"the", b" t", b" the", b"at", b" c", b" cat", b" s", b" sat", b"in", b"ing", b" m", b" mat",
          "中文".encode()[:2], "中文".encode()[:3]]
SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>"]

LOADER = f'''"""A tiny tokenizer in the style of Kimi's tokenization_kimi.py: tiktoken ranks + special tokens."""
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

PAT = {PAT!r}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {{"vocab_file": "tiktoken.model"}}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        names = {{int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {{}}).items()}}
        self.special_tokens = {{names.get(i, f"<|reserved_token_{{i}}|>"): i for i in range(len(ranks), len(ranks) + 4)}}
        self.model = tiktoken.Encoding(name="tiny", pat_str=PAT, mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.decoder = {{i: self.model.decode_single_token_bytes(i).decode("latin-1") for i in range(self.model.n_vocab)}}
        self.encoder = {{v: k for k, v in self.decoder.items()}}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, **kwargs)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:  # as Kimi's: other arguments go through PreTrainedTokenizer.encode
            return super().encode(text, **kwargs)
        return self.model.encode(text, allowed_special="all")

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token)

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).encode("latin-1").decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''

TEXTS = {"a.txt": "the cat sat on the mat\nThe cat's thing[EOS] 中文 123456\n\n  spaced   out\n" * 40,
         "b.txt": "中文中文 the mat\nsitting 7 cats\n" * 25}


def kimi_style_dir(directory) -> dict:
    """Write the tokenizer directory; returns the mergeable ranks."""
    directory.mkdir()
    ranks = {bytes([i]): i for i in range(256)}
    for token in MERGES:
        ranks[token] = len(ranks)
    (directory / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (directory / "tokenization_kimi.py").write_text(LOADER)
    n = len(ranks)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(n + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                              "normalized": False, "single_word": False} for i, t in enumerate(SPECIAL)},
        "model_max_length": 1048576}))
    return ranks


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    ranks = kimi_style_dir(base / "kimi")
    for name, text in TEXTS.items():
        (base / name).write_text(text)
    return base, ranks


def _run(base, out, *extra):
    from launch.tokenize_text import main

    return main(["--tokenizer", str(base / "kimi"), "--out", str(base / out), "--eos", "[EOS]", *extra,
                 str(base / "a.txt"), str(base / "b.txt")])


def test_kimi_style_directory_matches_autotokenizer_and_tiktoken(tok_dir, monkeypatch):
    from transformers import AutoTokenizer

    import launch.tokenize_text as tt

    base, ranks = tok_dir
    monkeypatch.setattr(tt._chunks, "__defaults__", (200,))  # many chunks per file, cut at line breaks
    assert _run(base, "w1.bin", "--trust-remote-code", "--workers", "1") == 0
    assert _run(base, "w4.bin", "--trust-remote-code", "--workers", "4") == 0
    w1, w4 = (base / "w1.bin").read_bytes(), (base / "w4.bin").read_bytes()
    assert w1 == w4
    hf = AutoTokenizer.from_pretrained(str(base / "kimi"), trust_remote_code=True)
    n = len(ranks)
    plain = tiktoken.Encoding(name="ref", pat_str=PAT, mergeable_ranks=ranks,
                              special_tokens={t: n + i for i, t in enumerate(SPECIAL)})
    expected, direct = [], []
    for name, text in TEXTS.items():
        lines = text.splitlines(keepends=True)  # the chunks the tool cut (each ends at a line break)
        expected += hf.encode(text, add_special_tokens=False) + [n + 1]
        direct += [i for line in lines for i in plain.encode(line, allowed_special="all")] + [n + 1]
    meta = json.loads((base / "w1.bin.json").read_text())
    got = np.fromfile(base / "w1.bin", dtype=meta["dtype"]).tolist()
    assert meta["vocab_size"] == n + len(SPECIAL) and meta["num_tokens"] == len(got)
    assert got == direct  # tiktoken itself, chunk by chunk
    assert got == expected  # AutoTokenizer on whole files: this text has no merge across a line break
    assert n + 1 in got[:-1] and n - 1 in got  # the in-text [EOS] and the 3-byte merge of 中 occur


def test_tokenizer_json_directory_and_workers(tmp_path):
    """A directory holding a tokenizer.json reads it with `tokenizers`; --workers 3 writes what 1 writes."""
    tokenizers = pytest.importorskip("tokenizers")
    from launch.tokenize_text import main

    (tmp_path / "hf").mkdir()
    vocab = {"[UNK]": 0, "<eos>": 1, "the": 2, "cat": 3, "sat": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("the cat sat\n" * 3000 + "dog\n")
    outs = []
    for workers in ("1", "3"):
        out = tmp_path / f"o{workers}.bin"
        assert main(["--tokenizer", str(tmp_path / "hf"), "--out", str(out), "--eos", "<eos>", "--workers", workers,
                     str(tmp_path / "a.txt")]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert np.frombuffer(outs[0], dtype=np.uint16).tolist() == [2, 3, 4] * 3000 + [0, 1]


@pytest.mark.parametrize("extra, phrase", [
    ([], "loads its tokenizer with custom code (tokenization_kimi.TikTokenTokenizer, from tokenizer_config.json "
         "auto_map); pass --trust-remote-code to run it"),
    (["--trust-remote-code", "--workers", "0"], "--workers 0: must be >= 1"),
])
def test_refused_in_one_line_and_nothing_written(tok_dir, capsys, extra, phrase):
    base, _ = tok_dir
    assert _run(base, "refused.bin", *extra) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and phrase in err, err
    assert not [p for p in os.listdir(base) if p.startswith("refused")]


# ---- the same directory with every tool: launch/generate.py and launch/export_hf.py --tokenizer ----------------

@pytest.fixture(scope="module")
def kimi_model(tok_dir, tmp_path_factory):
    """A tiny random Hugging Face model whose vocabulary is the Kimi-style tokenizer's (275 ids), and a run
    directory holding the same weights as its one complete checkpoint (what export_hf reads)."""
    from hf_reference import hf_config, random_hf_model

    from models.hf.checkpoint import load_pretrained
    from runtime.checkpoint import checkpoint

    base, ranks = tok_dir
    root = tmp_path_factory.mktemp("kimi_model")
    random_hf_model(hf_config(vocab_size=len(ranks) + len(SPECIAL))).save_pretrained(root / "hf")
    model = load_pretrained(str(root / "hf"))
    run = root / "run"
    checkpoint.save(1, checkpoint.checkpoint_dir(str(run)), {"train": {"model": model.state_dict()}},
                    meta={"model": dataclasses.asdict(model.config)})
    return {"hf": str(root / "hf"), "run": str(run), "tokenizer": str(base / "kimi"), "n": len(ranks)}


def test_generate_with_the_kimi_style_directory_encodes_and_decodes_as_autotokenizer(kimi_model, capsys):
    from transformers import AutoTokenizer

    from launch import generate
    from runtime.data import tokenizer_dir

    prompts = ["the cat sat on the mat", "中文 the[EOS] cat"]
    argv = ["--model", kimi_model["hf"], "--tokenizer", kimi_model["tokenizer"], "--trust-remote-code",
            "--temperature", "0", "--max-new-tokens", "8", "--json"]
    assert generate.main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    hf = AutoTokenizer.from_pretrained(kimi_model["tokenizer"], trust_remote_code=True)
    eos = kimi_model["n"] + 1  # [EOS]: tokenizer_config.json's eos_token, in its added_tokens_decoder
    assert len(results) == 2 and eos in results[1]["prompt_tokens"]  # the in-text [EOS] is one special id
    loaded = tokenizer_dir.load_directory(kimi_model["tokenizer"], trust_remote_code=True)
    assert tokenizer_dir.eos_ids(kimi_model["tokenizer"], loaded) == (eos,)  # where generation stops
    for prompt, result in zip(prompts, results):
        assert result["prompt_tokens"] == hf.encode(prompt, add_special_tokens=False)
        tokens = result["tokens"][:-1] if result["stopped"] else result["tokens"]
        assert len(tokens) >= 1 and result["completion"] == hf.decode(tokens)
        assert result["stopped"] == (result["tokens"][-1] == eos) and eos not in tokens


def test_export_with_the_kimi_style_directory_carries_it_whole(kimi_model, tmp_path, capsys):
    """Files copied byte for byte, bos/eos ids from its added tokens, and AutoTokenizer loads the export's
    copy (with its tokenization_kimi.py) to the same ids; --out's missing parents are created."""
    from transformers import AutoTokenizer

    from launch import export_hf

    source = tmp_path / "kimi"
    shutil.copytree(kimi_model["tokenizer"], source, ignore=shutil.ignore_patterns("__pycache__"))
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = tmp_path / "a" / "b" / "export"
    assert export_hf.main(["--run-dir", kimi_model["run"], "--out", str(out), "--tokenizer", str(source),
                           "--trust-remote-code", "--dtype", "float32"]) == 0
    n = kimi_model["n"]
    ids = {"bos_token_id": n, "eos_token_id": n + 1}
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids and json.loads((out / "generation_config.json").read_text()) == ids
    copied = {"tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json", "chat_template.jinja"}
    assert copied | {"generation_config.json", "config.json"} <= set(os.listdir(out))
    assert all((out / name).read_bytes() == (source / name).read_bytes() for name in copied)
    text = "the cat[EOS] 中文 sat"
    ours = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    theirs = AutoTokenizer.from_pretrained(str(source), trust_remote_code=True)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.eos_token_id == n + 1 and ours.bos_token_id == n


@pytest.mark.parametrize("tool", ["generate", "export_hf", "prepare_rollouts"])
def test_every_tool_refuses_the_custom_code_without_the_flag_in_one_line(kimi_model, tmp_path, capsys, tool):
    from launch import export_hf, generate, prepare_rollouts

    tokenizer = kimi_model["tokenizer"]
    if tool == "generate":
        code = generate.main(["--model", kimi_model["hf"], "--tokenizer", tokenizer, "--prompt", "the cat"])
    elif tool == "prepare_rollouts":
        chats = tmp_path.parent / f"{tmp_path.name}_chats.jsonl"  # the input, outside the directory checked
        chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "reward": 1.0}) + "\n")
        code = prepare_rollouts.main(["--tokenizer", tokenizer, "--in", str(chats), "--out", str(tmp_path / "r.jsonl")])
    else:
        code = export_hf.main(["--run-dir", kimi_model["run"], "--out", str(tmp_path / "a" / "out"),
                               "--tokenizer", tokenizer])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (f"--tokenizer: {tokenizer} loads its tokenizer with custom code (tokenization_kimi.TikTokenTokenizer, "
            f"from tokenizer_config.json auto_map); pass --trust-remote-code to run it") in err
    assert os.listdir(tmp_path) == []  # nothing written (export_hf: not even --out's parent)
