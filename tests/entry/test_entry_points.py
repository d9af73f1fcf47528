"""Every entry point stops on a user error the same way (runtime/cli.py): one line, exit status 2,
nothing written; and launch/torchrun.py passes that status through torchrun (plain torchrun reports 1
and a ChildFailedError block)."""

import glob
import os
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# no user input: nothing for the helper to report
NO_INPUT = {"benchmarks/bf16_batch_dependence.py", "launch/torchrun.py"}


def test_every_entry_point_uses_the_shared_helper():
    """A script with a `main` reports user errors through runtime/cli.py (launch/precheck.py's `stop` does
    for pretrain.py and posttrain.py, which runs pretrain.main)."""
    scripts = [p for p in glob.glob(os.path.join(REPO, "launch", "*.py")) + glob.glob(os.path.join(REPO, "benchmarks", "*.py"))
               if "\ndef main(" in open(p).read()]
    missing = [os.path.relpath(p, REPO) for p in scripts if os.path.relpath(p, REPO) not in NO_INPUT
               and "runtime.cli import" not in open(p).read() and "from launch import pretrain" not in open(p).read()]
    assert len(scripts) > 15 and missing == []


def _failure(rank, exitcode):
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")


def test_torchrun_status_is_the_lowest_rank_that_exited_by_itself():
    from launch.torchrun import exit_status

    # rank 1 exited 2 first; torchrun then sent rank 0 SIGTERM (-15): the status is 2, not 143
    assert exit_status(ChildFailedError("pretrain.py", {0: _failure(0, -15), 1: _failure(1, 2)})) == 2
    assert exit_status(ChildFailedError("pretrain.py", {0: _failure(0, 3), 1: _failure(1, 2)})) == 3
    assert exit_status(ChildFailedError("pretrain.py", {0: _failure(0, -9), 1: _failure(1, -9)})) == 137


def test_config_error_under_torchrun_is_one_line_and_status_2(tmp_path):
    """One worker (two imports of torch: the agent's and the worker's); launch/posttrain.py stops through
    the same pretrain.main."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(REPO, "launch", "torchrun.py"), "--nproc_per_node=1",
           os.path.join(REPO, "launch", "pretrain.py"), "--training.stepz=1", f"--run.dir={tmp_path / 'run'}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [result.stderr.splitlines()[0]], result.stderr[-2000:]
    assert result.stderr.startswith("config error: training.stepz: unknown key")
    assert not (tmp_path / "run").exists()


def test_torchrun_wrapper_status_when_the_launcher_is_signalled(monkeypatch):
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    import launch.torchrun as wrapper

    def preempted(args):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    import logging

    logger = logging.getLogger("torch.distributed.elastic")
    monkeypatch.setattr(logger, "level", logger.level)  # main() quiets it for the process: undone after the test
    monkeypatch.setattr(wrapper, "run", preempted)
    assert wrapper.main(["--nproc_per_node=1", "launch/pretrain.py"]) == 143


def test_torchrun_wrapper_prints_one_line_per_failed_rank_for_a_crash(monkeypatch, capsys):
    """A crash (status 1) or a signal is not the project's one-line stop: the wrapper names each failed rank
    in one line (the worker's traceback is above it) instead of torchrun's ChildFailedError block."""
    import logging

    import launch.torchrun as wrapper

    def crashed(args):
        raise ChildFailedError("pretrain.py", {3: _failure(3, 1), 5: _failure(5, -9), 0: _failure(0, -15)})

    logger = logging.getLogger("torch.distributed.elastic")
    monkeypatch.setattr(logger, "level", logger.level)
    monkeypatch.setattr(wrapper, "run", crashed)
    assert wrapper.main(["--nproc_per_node=8", "launch/pretrain.py"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "torchrun: rank 0 (local rank 0, pid 1000) failed with signal SIGTERM",
        "torchrun: rank 3 (local rank 3, pid 1003) failed with exit status 1",
        "torchrun: rank 5 (local rank 5, pid 1005) failed with signal SIGKILL"]
