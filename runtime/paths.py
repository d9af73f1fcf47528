"""Checks of output paths that the command-line tools in launch/ and benchmarks/ share (no torch: the
tools that need none start fast).

`check_output_file` refuses an output that cannot be a file; given the tool's inputs, it also refuses
an output that IS one of them (the same file by inode, so through symlinks and hard links too, or the
same resolved path) or an existing file inside an input directory: no tool writes over what it reads.
"""

import os


def check_output_file(flag: str, path: str, example: str, inputs=()) -> None:
    """ValueError, naming `flag`, unless `path` can be written as a file: not a directory, in a directory
    that exists (`example`: the file name the hint suggests inside a directory), and not one of `inputs`
    ((description, path) pairs: files, or directories whose files the tool reads; see `check_not_input`)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file such as {os.path.join(path, example)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{flag} {path}: {parent} {what}")
    check_not_input(f"{flag} {path}", path, inputs)


def check_not_input(name: str, path: str, inputs) -> None:
    """ValueError, starting with `name` (e.g. "--json out.json"), if writing the file `path` would write
    over one of `inputs` ((description, path) pairs; empty paths are skipped): the same file
    (os.path.samefile, which sees through symlinks and hard links; the same resolved path when either
    does not exist yet), or, for an input directory, an existing file anywhere under it."""
    for what, source in inputs:
        if source and _writes_over(path, source):
            raise ValueError(f"{name} is also {what}; writing it would destroy the input")


def check_distinct_outputs(outputs) -> None:
    """ValueError if two of `outputs` ((flag, path) pairs; empty paths skipped) name the same file:
    the second write would replace the first."""
    given = [(flag, path) for flag, path in outputs if path]
    for i, (flag, path) in enumerate(given):
        for other_flag, other in given[:i]:
            if same_file(path, other):
                raise ValueError(f"{flag} {path} and {other_flag} {other} are the same file; give two files")


def same_file(a: str, b: str) -> bool:
    """True if `a` and `b` are one file: by inode when both exist, else by resolved path."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _writes_over(path: str, source: str) -> bool:
    if os.path.isdir(source):
        if not os.path.exists(path):
            return False  # a new file inside an input directory destroys nothing
        return os.path.realpath(path).startswith(os.path.realpath(source).rstrip(os.sep) + os.sep)
    return same_file(path, source)


EXAMPLES = {"--json": "result.json", "--plot": "curves.png", "--out": "out.jsonl"}


def check_outputs(outputs, inputs=()) -> None:
    """`check_output_file` for each (flag, path) of `outputs` (empty paths skipped) against `inputs`,
    and no two outputs the same file: what every tool with output flags calls before any work."""
    for flag, path in outputs:
        if path:
            check_output_file(flag, path, EXAMPLES.get(flag, "output"), inputs)
    check_distinct_outputs(outputs)


def config_inputs(config_path: str | None, config) -> list[tuple[str, str]]:
    """What a tool that loads a job config reads: the --config file and the checkpoint directories it
    names (model.init_from, whose config.json load_config reads; posttrain.init_from)."""
    posttrain = getattr(config, "posttrain", None)
    model_dir, posttrain_dir = config.model_init_from, getattr(posttrain, "init_from", "")
    return [("the --config file", config_path or ""), (f"a file of model.init_from={model_dir}", model_dir),
            (f"a file of posttrain.init_from={posttrain_dir}", posttrain_dir)]
