"""Run the commands of a docs/*.md code block as a user would type them, in-process: `python launch/X.py
ARGS` calls launch.X.main(ARGS), `torchrun --nproc_per_node N launch/X.py ARGS` runs it on N forked
torchrun-style ranks (tests/helpers/multirank.py). $VARIABLES expand from os.environ; relative paths resolve
against the current directory."""

import importlib
import os
import re
import shlex

from multirank import run_ranks

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def doc_blocks(name: str, language: str = "bash") -> list[str]:
    """The ```language blocks of docs/`name`, in order."""
    with open(os.path.join(REPO, "docs", name), encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), flags=re.S)


def commands(block: str) -> list[str]:
    """The command lines of a bash block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _call(rank, world_size, module, args):
    return module.main(args)


def run_command(line: str, timeout: float = 300) -> list[int]:
    """Exit status per process of one command line (one entry for `python`, N for torchrun)."""
    argv = shlex.split(os.path.expandvars(line))
    if argv[0] == "torchrun":
        assert argv[1] == "--nproc_per_node", argv
        world, script, args = int(argv[2]), argv[3], argv[4:]
    else:
        assert argv[0] == "python", argv
        world, script, args = None, argv[1], argv[2:]
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    if world is None:
        return [module.main(args)]
    return run_ranks(_call, world, module, args, as_torchrun=True, timeout=timeout)
