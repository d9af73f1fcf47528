"""Checks of output paths that the command-line tools in launch/ and benchmarks/ share (no torch: the
tools that need none start fast).

`check_output_file` refuses an output that cannot be a file; given the tool's inputs, it also refuses
an output that IS one of them (the same file by inode, so through symlinks and hard links too, or the
same resolved path) or an existing file inside an input directory: no tool writes over what it reads.
`check_not_input` is that one guard; for an output DIRECTORY (an export, a run's checkpoints) it refuses
any overlap with an input: the output inside an input directory, or an input inside the output.

No tool writes into a run directory (one that holds a run's `kind` file, or its `.lock` beside
checkpoints/ or metrics.jsonl) or a checkpoint (one that holds a `COMPLETE` marker) either:
`check_not_in_run`, which `check_output_file` runs for every file output and `check_output_dir` for
output directories (an export, a benchmark's scratch folder, a new run.dir). A run rewrites what is in
its directory, and `checkpoint.keep` rotates a checkpoint out: a file written there would be lost with it.
"""

import os

from runtime.checkpoint.dirs import MARKER


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
    check_not_in_run(f"{flag} {path}", parent)


def check_output_dir(flag: str, path: str, inputs=(), own_run: str | None = None) -> None:
    """ValueError, naming `flag`, if writing into the directory `path` would write over one of `inputs`
    (`check_not_input`) or into a run directory or a checkpoint (`check_not_in_run`; `own_run`: the run
    dir this output belongs to, which may hold it outside its checkpoints)."""
    check_not_input(f"{flag} {path}", path, inputs, directory=True)
    check_not_in_run(f"{flag} {path}", path, own_run)


def _run_evidence(directory: str) -> str | None:
    """What shows `directory` is a run dir: its `kind` file, or (a run dir from before that file) its run
    lock `.lock` beside checkpoints/ or metrics.jsonl; None for any other directory."""
    if os.path.isfile(os.path.join(directory, KIND_FILE)):
        return f"a run's {KIND_FILE} file"
    if os.path.isfile(os.path.join(directory, ".lock")):
        found = [f for f in ("checkpoints", "metrics.jsonl") if os.path.exists(os.path.join(directory, f))]
        if found:
            return f"a run's .lock and {found[0]}"
    return None


def check_not_in_run(name: str, directory: str, own_run: str | None = None) -> None:
    """ValueError, starting with `name`, if `directory` (where an output goes) is, or lies inside, a run
    directory (`_run_evidence`) or a checkpoint (it holds a COMPLETE marker).
    `own_run`: a run dir that may hold the output (a run's own profile traces), but not in its checkpoints."""
    here = os.path.realpath(directory)
    own = os.path.realpath(own_run) if own_run else None
    while True:
        if os.path.isfile(os.path.join(here, MARKER)):
            raise ValueError(f"{name} is inside the checkpoint {here} (it holds a {MARKER} marker): checkpoint.keep "
                             f"deletes the whole checkpoint, with what else is in it, when its run rotates it out; "
                             f"write outside run and checkpoint directories")
        held = _run_evidence(here)
        if held is not None and here != own:
            raise ValueError(f"{name} is inside the run directory {here} (it holds {held}): a run rewrites its "
                             f"directory and rotates its checkpoints out; write outside run and checkpoint directories")
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


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
    check_not_in_run(f"run.dir={run_dir}", os.path.dirname(os.path.abspath(run_dir)))  # not nested in another run


def check_profile_dir(run_dir: str, profile_dir: str) -> None:
    """ValueError unless the run's traces (run.dir/profile.dir) stay out of its checkpoints/ (rotated out
    with them) and out of any other run dir or checkpoint."""
    path = os.path.join(run_dir, profile_dir)
    if _inside(path, os.path.join(run_dir, "checkpoints")):
        raise ValueError(f"profile.dir={profile_dir} is inside run.dir={run_dir}'s checkpoints/, which checkpoint.keep "
                         f"rotates out: give a folder of run.dir outside checkpoints/")
    check_not_in_run(f"profile.dir={profile_dir}", path, own_run=run_dir)


KIND_FILE = "kind"  # in a run dir: "pretraining" or "post-training", written when the run's first step starts


def job_kind(config) -> str:
    """The kind of run a job config makes: "post-training" for rollout data, else "pretraining"."""
    return "post-training" if config.data.source == "rollouts" else "pretraining"


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
