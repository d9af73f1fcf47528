"""The commands of docs/posttraining.md and docs/posttrain_transcripts.md, run as written (tests/helpers/doc_commands.py)
in a fresh directory that holds what a clone has (configs/, examples/), with `$MODEL` a small model that is
not debug-shaped (a Hugging Face DeepSeek-V3 directory of another vocabulary, width and context) and its
real tokenizer (byte-level BPE, ChatML template), and chat transcripts with text feedback. Before, the
example config's `[model] preset = "debug"` contradicted any other checkpoint given as posttrain.init_from,
and the transcripts page paired a real tokenizer with that config's 256-token vocabulary. Each training
command gets `--training.steps=2` appended (the config's 20 steps add only time)."""

import json
import os

import pytest

pytest.importorskip("transformers")

from chat_tokenizers import CHATML, conversations, make_tokenizer_dir  # noqa: E402
from doc_commands import REPO, commands, doc_blocks, run_command  # noqa: E402
from hf_reference import hf_config, random_hf_model  # noqa: E402
from models import preset  # noqa: E402

VOCAB, CONTEXT = 448, 32768
SKIPPED = ("pip ", "python experiments/feedback_experiment.py")  # an install; an 8-minute experiment of its own


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """$MODEL: a small Hugging Face DeepSeek-V3 directory with its tokenizer (vocabulary 448, context 32768)."""
    path = tmp_path_factory.mktemp("model")
    make_tokenizer_dir(str(path), CHATML, vocab_size=VOCAB)
    random_hf_model(hf_config(vocab_size=VOCAB, max_position_embeddings=CONTEXT)).save_pretrained(path)
    return str(path)


@pytest.fixture
def clone(tmp_path, model):
    """A working directory like a fresh clone's root (configs/, examples/), with chats.jsonl; $MODEL set."""
    for folder in ("configs", "examples"):
        os.symlink(os.path.join(REPO, folder), tmp_path / folder)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(6, seed=5)))
    cwd, saved = os.getcwd(), os.environ.get("MODEL")
    os.environ["MODEL"] = model
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)
        os.environ.pop("MODEL") if saved is None else os.environ.__setitem__("MODEL", saved)


def _run(block: str) -> list[str]:
    """Every command of the block as written (training ones 2 steps); returns the training commands."""
    trained = []
    for line in commands(block):
        if line.startswith(SKIPPED):
            continue
        if "launch/posttrain.py" in line:
            line += " --training.steps=2"
            trained.append(line)
        assert set(run_command(line)) == {0}, line
    return trained


def _records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_posttraining_page_commands_run_as_written(clone):
    trained = _run(doc_blocks("posttraining.md")[0])
    assert len(trained) == 2 and "--posttrain.init_from=$MODEL" in trained[1]
    assert [r["step"] for r in _records("runs/posttrain_example")] == [0, 1]  # the bundled example
    records = _records("runs/posttrain")
    assert [r["step"] for r in records] == [0, 1] and all(r["target_tokens"] > 0 for r in records)
    assert preset("debug").vocab_size != VOCAB  # the model is not debug-shaped


def test_the_transcripts_page_commands_run_as_written(clone):
    assert len(_run(doc_blocks("posttrain_transcripts.md")[0])) == 1
    records = _records("runs/posttrain_example")  # the config's run.dir
    assert records[-1]["sft_loss"] > 0 and records[-1]["target_tokens"] > 0


def test_model_preset_none_unsets_the_config_files_preset(clone, capsys):
    """A config with a [model] preset of its own contradicts another checkpoint; --model.preset=none drops it."""
    from runtime.config import ConfigError
    from runtime.config_parser import load_config

    (clone / "with_preset.toml").write_text('[model]\npreset = "debug"\n[data]\nsource = "rollouts"\n'
                                            'path = "rollouts.jsonl"\n')
    argv = ["--config", "with_preset.toml", f"--posttrain.init_from={os.environ['MODEL']}"]
    with pytest.raises(ConfigError, match=r"model.preset='debug' \(.*\): contradicts posttrain.init_from="):
        load_config(argv)
    assert load_config([*argv, "--model.preset=none"]).model.vocab_size == VOCAB
    with pytest.raises(ConfigError, match="model.preset='none': the model's shape then comes from"):
        load_config(["--config", "with_preset.toml", "--model.preset=none"])


def test_the_readmes_post_training_limitation_matches_the_code():
    """The README's post-training limitation said "pads rows (no packing), and every rank reads the whole
    rollout file", after packing and the ranks' shares of the file made both false. Checked against the code:
    a step's student, prefix and item rows are one packed row each (so no claim of padded rows), the line
    naming the limitations page is there, and what it says is on that page."""
    from posttrain_cases import many_feedback_record
    from runtime.posttrain.rollout_batch import RolloutLoader
    from runtime.posttrain.rollouts import trajectory_from_record

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        limits = f.read().split("## Known limitations", 1)[1]
    (bullet,) = [b for b in limits.split("\n- ") if "ost-training" in b]
    trajs = [trajectory_from_record(many_feedback_record(i, n, 256), 256, 256) for i, n in enumerate((90, 40, 70))]
    data = type("Data", (), {"batch_tokens": sum(t.cost() for t in trajs)})
    (mb,) = RolloutLoader(data, seed=0, vocab_size=256, max_seq_len=256, trajectories=trajs).batch(0).micro_batches
    assert mb.inputs_BS.shape[0] == mb.teacher_inputs_BS.shape[0] == mb.item_inputs_IS.shape[0] == 1
    assert mb.padding <= 3  # the rows' tails (to a multiple of 2) and nothing else
    assert "pads" not in bullet and "no packing" not in bullet and "whole rollout file" not in bullet, bullet
    assert "docs/posttraining.md#limitations" in bullet
    with open(os.path.join(REPO, "docs", "posttraining.md"), encoding="utf-8") as f:
        page = f.read().split("## Limitations", 1)[1].split("\n## ", 1)[0]
    for claim in ("runs eager", "gathers its trajectory's cached prefix K/V on its own", "rewriting it in place"):
        assert claim in page, claim
