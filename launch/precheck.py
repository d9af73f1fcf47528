"""A config typo comes back in the time Python takes to start: the entry points check the job's config
here, before they import torch, the models and the parallel code (seconds on a loaded machine).

Run as a script, each entry point that reads a config calls one function of this module above its heavy
imports; its `main` then runs the same checks again (load_config, and for a training job the layout)
with the same messages, so a caller of `main` sees no difference. Nothing here imports torch: the config
tree (runtime/config_parser.py and what it imports) is torch-free, and tests/entry/test_precheck.py keeps it so.

  training_job(argv, path_source)  launch/pretrain.py, posttrain.py: the config and its layout for
                                   WORLD_SIZE; `config error: ...` from rank 0 (`stop`), exit 2
  tool_config(argv, prefix)        launch/dry_run.py, estimate_memory.py: `--config PATH` with the
                                   `--section.key=value` overrides; `<prefix>: ...`, exit 2 (the tools'
                                   own flags are their ToolParser's: dry_run's parsed next, before the
                                   imports; estimate_memory's after)
  ToolParser(prefix=...)           every tool's argparse in launch/: a bad flag is one line
                                   `<prefix>: ...` (the prefix of the tool's other errors), exit 2, no
                                   usage lines first, as a config typo of the training jobs; evaluate.py
                                   and generate.py (no config) parse before the imports
  add_model_flags(parser)          their --model and --step
What needs torch or the files (devices, data, checkpoints' contents) is checked by `main`, after.
"""

import argparse
import os
import sys
import time

from parallel.layout import Layout
from runtime.cli import EXIT_USER_ERROR, fail, one_line
from runtime.config import JobConfig
from runtime.config_parser import load_config


def world() -> tuple[int, int]:
    """(world size, rank) as torchrun sets them (1, 0 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def job(argv: list[str], world_size: int, path_source: str = "bin") -> tuple[JobConfig, Layout]:
    """The training job's config and its layout for `world_size` (ConfigError, one line, otherwise)."""
    config = load_config(argv, path_source=path_source)
    return config, config.layout(world_size)


def stop(rank: int, message: str, code: int, every_rank: bool = False) -> int:
    """Rank 0 (or, `every_rank`, each rank) prints the one line; under torchrun the other ranks wait a
    moment before exiting, since torchrun ends every worker as soon as one exits and would otherwise
    often cut rank 0 off."""
    if rank == 0 or every_rank:
        print(one_line(message), file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(2)
    return code


def training_job(argv: list[str], path_source: str = "bin") -> None:
    """launch/pretrain.py and posttrain.py, before their imports: exit 2 on a config error, as `main` would."""
    if "--help" in argv or "-h" in argv:
        return
    world_size, rank = world()
    try:
        job(argv, world_size, path_source)
    except ValueError as e:
        sys.exit(stop(rank, f"config error: {e}", EXIT_USER_ERROR))


def tool_config(argv: list[str], prefix: str = "error", explain=None) -> None:
    """launch/dry_run.py and estimate_memory.py, before their imports: `--config PATH` with the
    `--section.key=value` overrides of `argv`; exit 2 with `prefix: message` on a config error (the message
    passed through the tool's `explain`, when it has one, as its `main` does)."""
    if "--help" in argv or "-h" in argv:
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    args, rest = parser.parse_known_args(argv)
    if args.config is None:  # required: the tool's argparse says so
        return
    overrides = [a for a in rest if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]]
    try:
        load_config(["--config", args.config, *overrides])
    except ValueError as e:
        fail(explain(str(e)) if explain else e, prefix)


class ToolParser(argparse.ArgumentParser):
    """argparse whose error (an unknown or malformed flag) is `<prefix>: message` in one line and exit
    status 2, the tool's own errors' form, instead of the usage lines and then the error."""

    def __init__(self, *args, prefix: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def error(self, message: str):
        fail(message, self.prefix)


def add_model_flags(parser) -> None:
    """--model and --step, as every tool that loads a model from any of the three places takes them."""
    parser.add_argument("--model", required=True, help="run dir, checkpoint dir or Hugging Face dir")
    parser.add_argument("--step", type=int, default=None, help="with a run dir: this checkpoint step (default: newest)")
