"""Checks of output paths that the command-line tools in launch/ and benchmarks/ share (no torch: the
tools that need none start fast).

`check_output_file` refuses an output that cannot be a file; given the tool's inputs, it also refuses
an output that IS one of them (the same file by inode, so through symlinks and hard links too, or the
same resolved path) or an existing file inside an input directory: no tool writes over what it reads.
`check_not_input` is that one guard; for an output DIRECTORY (an export, a run's checkpoints) it refuses
any overlap with an input: the output inside an input directory, or an input inside the output.
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


def check_not_input(name: str, path: str, inputs, directory: bool = False) -> None:
    """ValueError, starting with `name` (e.g. "--json out.json"), if writing `path` would write over one
    of `inputs` ((description, path) pairs; empty paths are skipped). A file `path`: the same file
    (os.path.samefile, which sees through symlinks and hard links; the same resolved path when either
    does not exist yet), or, for an input directory, an existing file anywhere under it. A `directory`
    (written into, files replaced or removed): the same directory as an input, inside one, or holding one."""
    for what, source in inputs:
        if not source:
            continue
        if directory and _inside(path, source):
            raise ValueError(f"{name} is inside {what}: give a directory outside the inputs")
        if directory and _inside(source, path):
            raise ValueError(f"{what} is inside {name}, which this command writes: writing it would destroy the "
                             f"input; give a directory outside the inputs")
        if not directory and _writes_over(path, source):
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
        return os.path.exists(path) and _inside(path, source)  # a new file there destroys nothing
    return same_file(path, source)


def _inside(path: str, directory: str) -> bool:
    """True if `path` is `directory` or lies under it (resolved paths: through symlinks)."""
    inner, outer = os.path.realpath(path), os.path.realpath(directory)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


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


def check_run_dir_apart(run_dir: str, inputs) -> None:
    """ValueError if what a training run writes into `run_dir` (checkpoints/, rotated by checkpoint.keep,
    and metrics.jsonl) overlaps one of `inputs` ((config key=path, path) pairs): e.g. posttrain.init_from
    = run.dir itself or one of its checkpoints, which the run would resume from and delete."""
    check_not_input(f"run.dir={run_dir} (its checkpoints/)", os.path.join(run_dir, "checkpoints"), inputs,
                    directory=True)
    check_not_input(f"run.dir={run_dir} (its metrics.jsonl)", os.path.join(run_dir, "metrics.jsonl"), inputs)


KIND_FILE = "kind"  # in a run dir: "pretraining" or "post-training", written when the run first starts


def run_kind(run_dir: str) -> str | None:
    """The kind of run `run_dir` holds: its `kind` file, else (a run dir from before that file) whether
    its metrics.jsonl records post-training losses; None for a new or empty run dir."""
    marker = os.path.join(run_dir, KIND_FILE)
    if os.path.isfile(marker):
        with open(marker) as f:
            return f.read().strip()
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics) or os.path.getsize(metrics) == 0:
        return None
    with open(metrics) as f:
        return "post-training" if '"rl_loss"' in f.readline() else "pretraining"


def check_run_kind(run_dir: str, kind: str) -> None:
    """ValueError unless `run_dir` is new or holds a run of `kind`: a post-training run would otherwise
    resume a pretraining checkpoint as its own and rotate the pretraining checkpoints out, or back."""
    held = run_kind(run_dir)
    if held is not None and held != kind:
        raise ValueError(f"run.dir={run_dir} holds a {held} run (its {KIND_FILE} file or metrics.jsonl) and this is "
                         f"{kind}: a run dir holds one kind of run; give a new run.dir (and the old one as "
                         f"posttrain.init_from to start from it)")


def record_run_kind(run_dir: str, kind: str) -> None:
    """Write `run_dir`'s `kind` file once (rank 0, under the run-dir lock)."""
    marker = os.path.join(run_dir, KIND_FILE)
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(kind + "\n")
