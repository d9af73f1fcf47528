"""The new user's path of docs/new_user.md, its commands run as written: a tiny Hugging Face checkpoint
with its tokenizer -> tokenize_text -> continued pretraining on 2 ranks -> evaluate -> export with the
tokenizer -> `transformers` loads and generates -> post-training from the checkpoint. Around it:
evaluate's loss equals the run's logged eval_loss (from the checkpoint and from its fp32 export),
generate's greedy tokens equal `transformers`' greedy generation on the export, and an export with
`--tokenizer` serves in `transformers` with no other file."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from doc_commands import commands, doc_blocks, run_command  # noqa: E402
from hf_reference import hf_config, random_hf_model  # noqa: E402
from launch import evaluate, export_hf, generate, tokenize_text  # noqa: E402

WORDS = "the cat sat on a mat while dogs ran past quiet green hills under bright morning light".split()
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
EVAL = ["--seq-len", "32", "--batch-size", "4", "--steps", "2", "--holdout", "0.1"]


def write_text(path, n_lines: int) -> str:
    g = torch.Generator().manual_seed(0)
    text = "".join(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) + "\n"
                   for _ in range(n_lines))
    path.write_text(text)
    return text


def write_tokenizer(directory, text: str) -> int:
    """A BPE tokenizer.json trained on `text`, and a tokenizer_config.json naming its end-of-sequence token."""
    os.makedirs(directory, exist_ok=True)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.BPEDecoder()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<eos>"])
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT}, f)
    return tokenizer.get_vocab_size()


def write_rollouts(path, tokenizer) -> None:
    """Chat-like transcripts in the tokenizer's ids: user turn, assistant turn (with a hint on every other)."""
    with open(path, "w") as f:
        for i in range(4):
            user, reply = tokenizer.encode(" ".join(WORDS[i:i + 4])).ids, tokenizer.encode(" ".join(WORDS[i + 4:i + 9])).ids
            feedback = [{"turn": 1, "hint": tokenizer.encode("quiet green").ids}] if i % 2 else []
            f.write(json.dumps({"tokens": user + reply, "advantage": 1.0 - i / 2, "feedback": feedback,
                                "turns": [{"role": "user", "start": 0, "end": len(user)},
                                          {"role": "assistant", "start": len(user), "end": len(user) + len(reply)}]})
                    + "\n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """$MODEL: a tiny HF checkpoint with a tokenizer of its vocabulary; corpus.txt; then the first two commands
    of docs/new_user.md (tokenize, continue pretraining on 2 ranks), run in that directory."""
    root = tmp_path_factory.mktemp("user")
    text = write_text(root / "corpus.txt", 300)
    vocab = write_tokenizer(root / "tok", text)
    random_hf_model(hf_config(vocab_size=vocab)).save_pretrained(root / "hf")
    write_tokenizer(root / "hf", text)  # the same tokenizer, inside the checkpoint as published ones have it
    cwd, model = os.getcwd(), os.environ.get("MODEL")
    os.environ["MODEL"] = str(root / "hf")
    os.chdir(root)
    try:
        steps = commands(doc_blocks("new_user.md")[0])
        for line in steps[:2]:
            assert set(run_command(line)) == {0}, line
        yield {"root": root, "data": str(root / "train.bin"), "run": str(root / "runs" / "cpt"),
               "records": [json.loads(line) for line in open(root / "runs" / "cpt" / "metrics.jsonl")],
               "later": steps[2:]}
    finally:
        os.chdir(cwd)
        os.environ.pop("MODEL") if model is None else os.environ.__setitem__("MODEL", model)


def _json_out(capsys, main, argv) -> list[dict]:
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_evaluate_equals_the_runs_eval_loss_from_the_checkpoint_and_its_export(trained, capsys, tmp_path):
    logged = trained["records"][-1]["eval_loss"]
    [result] = _json_out(capsys, evaluate.main, ["--model", trained["run"], "--data", trained["data"], *EVAL, "--json"])
    # fp32, the same weights and batches: 2 ranks (FSDP + EP sums) against one process, ~1e-7 relative
    assert result["loss"] == pytest.approx(logged, rel=1e-6)
    assert result["perplexity"] == pytest.approx(torch.tensor(logged).exp().item(), rel=1e-5)
    assert result["tokens"] == 2 * 4 * 32
    out = str(tmp_path / "export")
    assert export_hf.main(["--run-dir", trained["run"], "--out", out, "--dtype", "float32"]) == 0
    capsys.readouterr()
    [exported] = _json_out(capsys, evaluate.main, ["--model", out, "--data", trained["data"], *EVAL, "--json"])
    assert exported["loss"] == pytest.approx(logged, rel=1e-6)
    [initial] = _json_out(capsys, evaluate.main, ["--model", str(trained["root"] / "hf"), "--data", trained["data"],
                                                  *EVAL, "--json"])
    assert initial["loss"] > logged * (1 + 1e-3)  # the weights before training score worse: the comparison can fail


def test_evaluate_errors_are_one_line(trained, capsys, tmp_path):
    assert evaluate.main(["--model", str(tmp_path), "--data", trained["data"]]) == 2
    assert "evaluate error: --model" in capsys.readouterr().err
    assert evaluate.main(["--model", trained["run"], "--step", "7", "--data", trained["data"]]) == 2
    assert "--step 7" in capsys.readouterr().err


def test_greedy_generation_equals_transformers_on_the_export(trained, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    tok = str(trained["root"] / "tok")
    out = str(tmp_path / "export")
    assert export_hf.main(["--run-dir", trained["run"], "--out", out, "--dtype", "float32"]) == 0
    capsys.readouterr()
    argv = ["--tokenizer", tok, "--prompt", "the cat sat on", "--prompt", "quiet green", "--temperature", "0",
            "--max-new-tokens", "12", "--json"]
    ours = _json_out(capsys, generate.main, ["--model", out, *argv])
    from_checkpoint = _json_out(capsys, generate.main, ["--model", trained["run"], *argv])
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in from_checkpoint]
    reference = AutoModelForCausalLM.from_pretrained(out).eval()
    eos = tokenize_text.load_tokenizer(os.path.join(tok, "tokenizer.json")).token_to_id("<eos>")
    for result in ours:
        prompt = torch.tensor([result["prompt_tokens"]])
        expected = reference.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=eos,
                                      pad_token_id=eos)[0, prompt.shape[1]:].tolist()
        assert result["tokens"] == expected[:len(result["tokens"])] and len(result["tokens"]) >= 1
        assert result["stopped"] == (eos in expected)
    assert len({tuple(r["tokens"]) for r in ours}) == 2


def test_sampling_is_seeded_and_top_p_1e_9_is_greedy(trained, capsys):
    tok = str(trained["root"] / "tok")
    base = ["--model", trained["run"], "--tokenizer", tok, "--prompt", "the cat", "--max-new-tokens", "10", "--json"]
    a = _json_out(capsys, generate.main, [*base, "--temperature", "1.5", "--seed", "3"])
    b = _json_out(capsys, generate.main, [*base, "--temperature", "1.5", "--seed", "3"])
    nucleus = _json_out(capsys, generate.main, [*base, "--temperature", "1.5", "--top-p", "1e-9"])
    greedy = _json_out(capsys, generate.main, [*base, "--temperature", "0"])
    assert a == b and nucleus[0]["tokens"] == greedy[0]["tokens"]
    assert generate.main(["--model", trained["run"], "--tokenizer", str(trained["root"]), "--prompt", "x"]) == 2
    assert "has neither tokenizer.json nor tokenizer_config.json" in capsys.readouterr().err


def _dtypes(directory) -> set[str]:
    from safetensors import safe_open

    out = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return out


def test_an_export_with_its_tokenizer_serves_in_transformers(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, out = str(trained["root"] / "tok"), str(tmp_path / "export")
    assert export_hf.main(["--run-dir", trained["run"], "--out", out, "--tokenizer", tok]) == 0  # default dtype
    eos = tokenize_text.load_tokenizer(os.path.join(tok, "tokenizer.json")).token_to_id("<eos>")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and _dtypes(out) == {"BF16", "F32"}
    assert config["eos_token_id"] == eos and config["bos_token_id"] is None
    assert json.load(open(os.path.join(out, "generation_config.json"))) == {"eos_token_id": eos}
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and tokenizer.eos_token_id == eos
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=False)
    assert prompt == "user: the cat\n"
    inputs = tokenizer(prompt, return_tensors="pt")
    generated = model.generate(**inputs, do_sample=False, max_new_tokens=6)
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    assert "default: bfloat16" in " ".join(_help(capsys, export_hf.main).split())


def _help(capsys, main) -> str:
    with pytest.raises(SystemExit):
        main(["--help"])
    return capsys.readouterr().out


def test_an_export_without_tokenizer_states_no_token_ids_and_a_bad_tokenizer_writes_nothing(trained, tmp_path, capsys):
    out = str(tmp_path / "export")
    assert export_hf.main(["--run-dir", trained["run"], "--out", out, "--dtype", "float32"]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["torch_dtype"] == "float32" and config["eos_token_id"] is None and _dtypes(out) == {"F32"}
    small = tmp_path / "small"
    write_tokenizer(small, "a b c")  # fits; one of another vocabulary size than the model's would not:
    big = tmp_path / "big"
    write_tokenizer(big, " ".join(f"w{i}" for i in range(400)) * 2)
    capsys.readouterr()
    assert export_hf.main(["--run-dir", trained["run"], "--out", str(tmp_path / "x"), "--tokenizer", str(big)]) == 2
    assert "tokens but the model's vocab_size is" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_the_rest_of_the_new_user_path_as_docs_new_user_md_writes_it(trained, capfd, monkeypatch):
    """Commands 3-6 (evaluate, export with the tokenizer, generate, post-train from the checkpoint) and the
    doc's Python snippet (transformers loads the export and generates), in the fixture's directory."""
    root = trained["root"]
    monkeypatch.chdir(root)
    monkeypatch.setenv("MODEL", str(root / "hf"))
    write_rollouts(root / "rollouts.jsonl", tokenize_text.load_tokenizer(str(root / "hf" / "tokenizer.json")))
    evaluate_line, export_line, generate_line, posttrain_line = trained["later"]
    assert run_command(evaluate_line) == [0]
    assert f"loss {trained['records'][-1]['eval_loss']:.6f}" in capfd.readouterr().out  # the run's eval_loss
    assert run_command(export_line) == [0]
    assert capfd.readouterr().out == "exported runs/cpt/checkpoints/step_2 to cpt_hf\n"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir("cpt_hf"))
    assert run_command(generate_line) == [0]
    assert capfd.readouterr().out.startswith("the cat")
    exec(doc_blocks("new_user.md", "python")[0], {})  # transformers: AutoTokenizer + AutoModelForCausalLM + generate
    assert capfd.readouterr().out.strip()
    assert run_command(posttrain_line) == [0, 0]
    out = capfd.readouterr().out
    assert f"posttrain.init_from: model shape and weights from checkpoint {os.path.join('runs/cpt', 'checkpoints', 'step_2')} (step 2, saved on 2 ranks)" in out
    records = [json.loads(line) for line in open(root / "runs" / "post" / "metrics.jsonl")]
    assert len(records) == 1 and records[0]["target_tokens"] > 0
    r = records[0]  # the console line of post-training
    assert f"| rl {r['rl_loss']:.4f} | kl {r['feedback_kl']:.4f} | targets {r['target_tokens']} |" in out
