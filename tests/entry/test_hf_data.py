"""The continued-pretraining data path end to end: a real BPE tokenizer.json (trained here with the
`tokenizers` package, nothing downloaded) -> launch/tokenize_text.py -> a `.bin` -> a training run that
starts from a Hugging Face checkpoint with that vocabulary. The run's first loss equals the loss of the
single-process `load_pretrained` model on the same first batch."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hf_reference import hf_config, random_hf_model  # noqa: E402
from launch import tokenize_text  # noqa: E402
from launch.pretrain import main  # noqa: E402
from models.hf.checkpoint import load_pretrained  # noqa: E402
from multirank import run_ranks  # noqa: E402
from runtime.config_parser import load_config  # noqa: E402
from runtime.data.loader import Loader  # noqa: E402

WORDS = "the cat sat on a mat while dogs ran past quiet green hills under bright morning light".split()


def _text(n_lines: int) -> str:
    g = torch.Generator().manual_seed(0)
    return "".join(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) + "\n"
                   for _ in range(n_lines))


def _bpe_tokenizer(path: str, text: str) -> int:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<eos>"])
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.save(path)
    return tokenizer.get_vocab_size()


def test_tokenized_text_trains_from_a_hugging_face_checkpoint(tmp_path):
    text = _text(400)
    (tmp_path / "a.txt").write_text(text)
    vocab = _bpe_tokenizer(str(tmp_path / "tokenizer.json"), text)
    out = str(tmp_path / "train.bin")
    assert tokenize_text.main(["--tokenizer", str(tmp_path / "tokenizer.json"), "--out", out, "--eos", "<eos>",
                               str(tmp_path / "a.txt")]) == 0
    hf_dir = str(tmp_path / "hf")
    random_hf_model(hf_config(vocab_size=vocab)).save_pretrained(hf_dir)
    run_dir = str(tmp_path / "run")
    argv = ["--data.source=bin", f"--data.path={out}", "--data.seq_len=32", "--data.batch_size=4",
            "--training.steps=2", "--training.warmup_steps=1", "--checkpoint.interval=0",
            f"--model.init_from={hf_dir}", f"--run.dir={run_dir}"]
    assert run_ranks(lambda r, w: main(argv), 1, as_torchrun=True) == [0]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    config = load_config(argv)  # the run's own first batch: the same data config, seed and held-out split
    inputs_BS, labels_BS, positions_S = Loader(config.data, config.training.seed, vocab_size=config.model.vocab_size,
                                               holdout=config.eval.train_holdout()).batch(0)[0]
    with torch.no_grad():
        logits = load_pretrained(hf_dir)(inputs_BS, positions_S)
    reference = float(F.cross_entropy(logits.flatten(0, 1), labels_BS.flatten()))
    # fp32, the same math in one process: ulp-level differences only (1e-5 as the layout-parity tests)
    assert abs(losses[0] - reference) <= 1e-5 * reference, (losses, reference)
    assert len(losses) == 2 and losses[1] < losses[0]
