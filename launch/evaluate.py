"""Held-out loss and perplexity of a model on a token file, in one process.

    python launch/evaluate.py --model RUN_DIR|CHECKPOINT_DIR|HF_DIR --data FILE.bin [--holdout 0.05]
                              [--seq-len 128] [--batch-size 16] [--steps 4] [--seed 0] [--json]

`--model`: a run directory (its newest complete checkpoint, or `--step N`), one checkpoint directory
(any training layout: DCP reassembles the tensors) or a Hugging Face directory. `--data`: a token file
as `data.source = "bin"` reads it (launch/tokenize_text.py writes one). The batches are the training
run's held-out batches (runtime/evaluate.py): the same (seed, batch) draws from the last `--holdout`
fraction of the file (0: the whole file, as with `eval.path`), so with the run's data.seq_len,
data.batch_size, eval.steps, eval.holdout and training.seed the loss equals its logged `eval_loss`.
Prints `loss L  perplexity P  (N tokens)`, or one JSON object with `--json`. A bad argument exits with
status 2 and one line. One process, fp32 on the CPU: for models that fit one host's memory (a run with
training.param_dtype = "bfloat16" logged its eval_loss in bf16 and differs by that rounding).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch.model_source import add_model_flags, load_model  # noqa: E402
from runtime.cli import report  # noqa: E402
from runtime.data import DataConfig, Loader  # noqa: E402
from runtime.errors import RunError  # noqa: E402
from runtime.evaluate import evaluate  # noqa: E402
from runtime.train import micro_batch_loss  # noqa: E402


def held_out_loss(model, data: DataConfig, *, steps: int, holdout: float, seed: int) -> float:
    """Mean next-token cross-entropy of `model` over the held-out batches 0..steps-1 of `data`."""
    loader = Loader(data, seed, vocab_size=model.config.vocab_size, holdout=holdout, split="eval",
                    path_key="--data")  # the eval split: the run's held-out part and its own stream of draws
    device = next(model.parameters()).device
    return evaluate(model, loader, steps, data.tokens_per_step(),
                    lambda micro, tokens: micro_batch_loss(model, micro, tokens, device))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--data", required=True, help="token file (.bin; dtype from its .json sidecar or --dtype)")
    parser.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto", help="token dtype")
    parser.add_argument("--holdout", type=float, default=0.0,
                        help="evaluate the last fraction of the file (the run's eval.holdout); 0 = all of it")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (data.seq_len)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per batch (data.batch_size)")
    parser.add_argument("--steps", type=int, default=4, help="batches (eval.steps)")
    parser.add_argument("--seed", type=int, default=0, help="training.seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    if not 0 <= args.holdout < 1 or args.steps < 1:
        raise ValueError(f"--holdout {args.holdout} must be in [0, 1) and --steps {args.steps} >= 1")
    data = DataConfig(source="bin", path=args.data, dtype=args.dtype, seq_len=args.seq_len,
                      batch_size=args.batch_size)
    model, loaded = load_model(args.model, args.step)
    if data.seq_len > model.config.max_seq_len:
        raise ValueError(f"--seq-len {data.seq_len} > the model's max_seq_len {model.config.max_seq_len}")
    loss = held_out_loss(model, data, steps=args.steps, holdout=args.holdout, seed=args.seed)
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "tokens": args.steps * data.tokens_per_step(), "model": loaded, "data": args.data,
            "holdout": args.holdout}


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        result = run(args)
    except (ValueError, RunError) as e:
        return report(e, prefix="evaluate error")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']}; data {args.data} (holdout {args.holdout})")
        print(f"loss {result['loss']:.6f}  perplexity {result['perplexity']:.4f}  ({result['tokens']:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
