"""Text in, text out: sample from a model with its tokenizer, in one process.

    python launch/generate.py --model RUN_DIR|CHECKPOINT_DIR|HF_DIR [--tokenizer DIR [--trust-remote-code]]
                              --prompt "Once upon"
                              [--prompt ...] [--max-new-tokens 64] [--temperature 0] [--top-p 1] [--seed 0] [--json]

`--model`: as launch/evaluate.py (a run's newest checkpoint or `--step N`, one checkpoint, or a Hugging
Face directory). `--tokenizer`: a tokenizer directory, tokenizer.json or one AutoTokenizer loads (Kimi
K2.5's tiktoken tokenizer needs `--trust-remote-code`; runtime/data/tokenizer_dir.py), default: the model
directory when it holds one, as an export made with `--tokenizer` does; its generation_config.json or
tokenizer_config.json names the end-of-sequence token, after which a completion stops. No `--prompt`: one
prompt per line of standard input. Decoding is runtime/generate.py (KV cache): temperature 0 is greedy; otherwise the
temperature-scaled distribution, truncated to the top-p nucleus, sampled from a generator seeded by
(`--seed`, prompt index). Prints each completion, or with `--json` one JSON object per prompt (prompt,
completion, prompt_tokens, tokens, stopped). A bad argument exits with status 2 and one line.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch.precheck import ToolParser, add_model_flags  # noqa: E402
from runtime.cli import report  # noqa: E402
from runtime.sampling import SamplingConfig  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.split("\n\n")[0], prefix="generate error",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model's)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the tokenizer directory's own code (Kimi K2.5's tokenization_kimi.py)")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; none: stdin lines)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated at most per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the most likely tokens up to this mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return parser.parse_args(argv)


def sampling_config(args: argparse.Namespace, stop_tokens: tuple[int, ...] = ()) -> SamplingConfig:
    """The flags' sampling config; ValueError for a --temperature, --top-p or --max-new-tokens out of range."""
    return SamplingConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                          stop_tokens=stop_tokens)


if __name__ == "__main__":  # a bad flag exits here with status 2, before torch and the model code load
    try:
        sampling_config(parse(sys.argv[1:]))
    except ValueError as e:
        sys.exit(report(e, prefix="generate error"))

import torch  # noqa: E402

from launch.model_source import load_model  # noqa: E402
from runtime.data import tokenizer_dir  # noqa: E402
from runtime.errors import RunError  # noqa: E402
from runtime.generate import generate  # noqa: E402


def complete(model, tokenizer, prompt: str, sampling: SamplingConfig, seed: int, index: int) -> dict:
    """One prompt's completion (B = 1: prompts of different lengths need no padding)."""
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError(f"--prompt {prompt!r} encodes to no tokens")
    if len(ids) + sampling.max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"--prompt {prompt[:40]!r}: {len(ids)} tokens + --max-new-tokens {sampling.max_new_tokens} "
                         f"> the model's max_seq_len {model.config.max_seq_len}")
    if max(ids) >= model.config.vocab_size:
        raise ValueError(f"--tokenizer: token id {max(ids)} >= the model's vocab_size {model.config.vocab_size}")
    out = generate(model, torch.tensor([ids]), sampling, seed=seed, sequence_ids=[index])
    tokens = out.tokens_BN[0, :int(out.lengths_B[0])].tolist()
    stopped = bool(tokens) and tokens[-1] in sampling.stop_tokens
    text = tokenizer.decode(tokens[:-1] if stopped else tokens)
    return {"prompt": prompt, "completion": text, "prompt_tokens": ids, "tokens": tokens, "stopped": stopped}


def run(args: argparse.Namespace) -> list[dict]:
    directory, flag = args.tokenizer or args.model, "--tokenizer" if args.tokenizer else "--model (no --tokenizer)"
    tokenizer = tokenizer_dir.load_directory(directory, args.trust_remote_code, flag)
    config = sampling_config(args, tokenizer_dir.eos_ids(directory, tokenizer, flag))
    prompts = args.prompt if args.prompt is not None else [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT or lines on standard input")
    model, loaded = load_model(args.model, args.step)
    print(loaded, file=sys.stderr)
    return [complete(model, tokenizer, p, config, args.seed, i) for i, p in enumerate(prompts)]


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        sampling_config(args)  # the flags before the tokenizer and the model load, as when run as a script
        results = run(args)
    except (ValueError, RunError) as e:
        return report(e, prefix="generate error")
    for result in results:
        print(json.dumps(result) if args.json else result["prompt"] + result["completion"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
