"""launch/tokenize_text.py with a Hugging Face tokenizer directory (runtime/tokenizer_dir.py): a tiny Kimi-style
tiktoken tokenizer (a `tiktoken.model` rank file + a `tokenization_kimi.py` loader named by `auto_map`)
tokenizes exactly as `transformers.AutoTokenizer(..., trust_remote_code=True)` and `tiktoken` itself do;
`--workers 1` and `--workers 4` write the same file; without `--trust-remote-code` it is refused in one line."""

import base64
import json
import os

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
