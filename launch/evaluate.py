"""Held-out loss and perplexity of a model, in one process.

    python launch/evaluate.py --model RUN_DIR|CHECKPOINT_DIR [--step N] [--json]
    python launch/evaluate.py --model RUN_DIR|CHECKPOINT_DIR|HF_DIR --data FILE.bin [--holdout 0.05]
                              [--seq-len 128] [--batch-size 16] [--steps 4] [--seed 0] [--document-mask] [--json]

`--model`: a run directory (its newest complete checkpoint, or `--step N`), one checkpoint directory
(any training layout: DCP reassembles the tensors) or a Hugging Face directory.

Without `--data`, the run's own evaluation, as its checkpoint recorded it (runtime/eval_config.py): the
same sources (each source of a mixture, eval_loss their weighted mean), document mask, eval.path or
eval.holdout, data.seq_len, data.batch_size, eval.steps and training.seed, so the loss equals the logged
`eval_loss` of that step; `--steps`, `--seq-len`, `--batch-size`, `--holdout`, `--seed` override one
setting. Refused in one line when there is nothing recorded to follow (a Hugging Face directory, a
checkpoint from before the record, a run with evaluation off): then give `--data`.

With `--data`: that token file as `data.source = "bin"` reads it (launch/tokenize_text.py writes one),
batches the held-out draws of runtime/evaluate.py from its last `--holdout` fraction (0: all of it, as
with `eval.path`); `--document-mask` as `data.document_mask` (an indexed dataset). Prints
`loss L  perplexity P  (N tokens)`, or one JSON object with `--json`. A bad argument exits with status 2
and one line. One process, fp32 on the CPU: for models that fit one host's memory (a run with
training.param_dtype = "bfloat16" logged its eval_loss in bf16 and differs by that rounding).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from launch.precheck import ToolParser, add_model_flags  # noqa: E402
from runtime.cli import report  # noqa: E402

DEFAULTS = {"seq_len": 128, "batch_size": 16, "steps": 4, "seed": 0, "holdout": 0.0}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.split("\n\n")[0], prefix="evaluate error")
    add_model_flags(parser)
    parser.add_argument("--data", default=None, help="token file (.bin; dtype from its .json sidecar or --dtype); "
                                                     "default: the run's recorded evaluation")
    parser.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto", help="token dtype (--data)")
    parser.add_argument("--document-mask", action="store_true", help="--data: data.document_mask (indexed dataset)")
    parser.add_argument("--holdout", type=float, default=None,
                        help="evaluate the last fraction of the file (eval.holdout); 0 = all of it (--data: default 0)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (data.seq_len; --data: 128)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per batch (data.batch_size; --data: 16)")
    parser.add_argument("--steps", type=int, default=None, help="batches (eval.steps; --data: 4)")
    parser.add_argument("--seed", type=int, default=None, help="training.seed (--data: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def _given(args) -> dict:
    return {key: getattr(args, key) for key in DEFAULTS if getattr(args, key) is not None}


def check_flags(args) -> None:
    """ValueError naming the flag for a value no model or data is needed to refuse."""
    given = _given(args)
    if not 0 <= given.get("holdout", 0) < 1 or given.get("steps", 1) < 1:
        raise ValueError(f"--holdout {args.holdout} must be in [0, 1) and --steps {args.steps} >= 1")
    if args.data is None and (args.document_mask or args.dtype != "auto"):
        raise ValueError("--document-mask and --dtype apply to --data only (without it the run's own settings hold)")


if __name__ == "__main__":  # a bad flag exits here with status 2, before torch and the model code load
    try:
        check_flags(parse(sys.argv[1:]))
    except ValueError as e:
        sys.exit(report(e, prefix="evaluate error"))

from launch.export_hf import checkpoint_path  # noqa: E402
from launch.model_source import kind, load_model  # noqa: E402
from runtime.checkpoint import checkpoint  # noqa: E402
from runtime.data.loader import Loader  # noqa: E402
from runtime.data.config import DataConfig, SourceConfig  # noqa: E402
from runtime.errors import RunError  # noqa: E402
from runtime.eval_config import EvalConfig  # noqa: E402
from runtime.evaluate import evaluate  # noqa: E402
from runtime.data.mixture import mixture_eval_loss  # noqa: E402
from runtime.train import micro_batch_loss  # noqa: E402


def held_out_loss(model, data: DataConfig, *, steps: int, holdout: float, seed: int, split: str = "eval",
                  path_key: str = "--data") -> float:
    """Mean next-token cross-entropy of `model` over the held-out batches 0..steps-1 of `split` of `data`."""
    loader = Loader(data, seed, vocab_size=model.config.vocab_size, holdout=holdout, split=split,
                    path_key=path_key)  # the eval split: the run's held-out part and its own stream of draws
    device = next(model.parameters()).device
    return evaluate(model, loader, steps, data.tokens_per_step(),
                    lambda batch, tokens: sum(micro_batch_loss(model, micro, tokens, device) for micro in batch))


class Plan(NamedTuple):
    splits: dict  # {split: (data config, holdout, key naming the file)}: runtime/eval_config.py
    steps: int
    seed: int
    sources: tuple = ()  # a mixture's sources: eval_loss is their weighted mean


def explicit_plan(args) -> Plan:
    given = {**DEFAULTS, **_given(args)}
    data = DataConfig(source="bin", path=args.data, dtype=args.dtype, seq_len=given["seq_len"],
                      batch_size=given["batch_size"], document_mask=args.document_mask)
    return Plan({"eval": (data, given["holdout"], "--data")}, given["steps"], given["seed"])


def recorded_plan(args) -> Plan:
    """The run's own evaluation, from what the checkpoint's marker recorded, with the flags given."""
    ckpt = _checkpoint(args)
    meta = checkpoint.read_meta(ckpt)
    if "data" not in meta or "eval" not in meta:
        raise ValueError(f"{ckpt} records no data or eval settings (saved before they were recorded): give --data "
                         f"and the run's --seq-len, --batch-size, --steps, --holdout, --seed")
    data, evaluation = _recorded_configs(meta, ckpt)
    given = _given(args)
    data = dataclasses.replace(data, seq_len=given.get("seq_len", data.seq_len),
                               batch_size=given.get("batch_size", data.batch_size))
    evaluation = dataclasses.replace(evaluation, holdout=given.get("holdout", evaluation.holdout))
    splits = evaluation.held_out_splits(data)
    if not splits:
        raise ValueError(f"{ckpt}: the run evaluated nothing (eval.interval={evaluation.interval}, data.source="
                         f"{data.source!r}, eval.path={evaluation.path!r}), so it held nothing out: give --data")
    return Plan(splits, given.get("steps", evaluation.steps), given.get("seed", meta["training.seed"]),
                () if evaluation.path else data.sources)


def _checkpoint(args) -> str:
    """The checkpoint directory --model (and --step) name; ValueError for a Hugging Face directory."""
    found = kind(args.model)
    if found == "hf":
        raise ValueError(f"--model {args.model} is a Hugging Face directory: it records no data; give --data")
    if found == "checkpoint":
        return args.model
    return checkpoint_path(args.model, args.step)


def _recorded_configs(meta: dict, ckpt: str) -> tuple[DataConfig, EvalConfig]:
    try:
        data = dict(meta["data"], sources=tuple(SourceConfig(**s) for s in meta["data"]["sources"]))
        return DataConfig(**data), EvalConfig(**meta["eval"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{ckpt}: the {checkpoint.MARKER} marker's data or eval settings are unusable ({e})") from None


def run(args: argparse.Namespace) -> dict:
    check_flags(args)
    plan = explicit_plan(args) if args.data is not None else recorded_plan(args)
    model, loaded = load_model(args.model, args.step)
    losses = {}
    for split, (data, holdout, key) in plan.splits.items():
        if data.seq_len > model.config.max_seq_len:
            raise ValueError(f"seq_len {data.seq_len} > the model's max_seq_len {model.config.max_seq_len}")
        losses["eval_loss" + split[4:]] = held_out_loss(model, data, steps=plan.steps, holdout=holdout,
                                                        seed=plan.seed, split=split, path_key=key)
    loss = mixture_eval_loss(plan.sources, losses) if plan.sources else losses["eval_loss"]
    data = next(iter(plan.splits.values()))[0]
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "tokens": len(plan.splits) * plan.steps * data.tokens_per_step(), "model": loaded,
            "data": {split[5:] or "eval": d.path for split, (d, *_) in plan.splits.items()}, "losses": losses,
            "document_mask": data.document_mask, "seed": plan.seed, "steps": plan.steps}


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        result = run(args)
    except (ValueError, RunError) as e:
        return report(e, prefix="evaluate error")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']}; data {', '.join(f'{k}: {v}' for k, v in result['data'].items())} "
              f"(document mask {'on' if result['document_mask'] else 'off'})")
        print(f"loss {result['loss']:.6f}  perplexity {result['perplexity']:.4f}  ({result['tokens']:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
