"""torchrun with the workers' exit status: `python launch/torchrun.py [torchrun flags] launch/pretrain.py ...`.

Plain `torchrun` exits 1 whenever a worker fails and prints a ChildFailedError block after the worker's
own line, so a config error (status 2) or a divergence (3) looks like a crash to a script or a
scheduler. This runs the same launcher (torch.distributed.run, every torchrun flag) and, when workers
fail, exits with the status of the lowest rank that exited by itself (2, 3, 143; or 128+N when all
were killed by signal N), after the workers' one line, without the block (any other failure, a crash's
status 1 or a signal: one line per failed rank instead of the block, after the worker's own traceback);
128+N when the launcher itself gets signal N (SIGTERM from a scheduler: 143, as the workers that saved a checkpoint report). torch's own log lines (a worker "failed
(exitcode: 2)", the others being sent SIGTERM) are kept at warning level and above only for
failures that are not the project's (status 1 or a signal): those are the ones to debug.
"""

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

STATUSES = (2, 3, 143)  # runtime/errors.py: bad input, diverged, preempted: the worker printed the line


def exit_status(error: ChildFailedError) -> int:
    """The exit status of the lowest rank that exited by itself (torchrun then sends the others SIGTERM,
    so theirs would say "preempted"); if every worker died of a signal, 128 + the lowest rank's signal."""
    failures = sorted(error.failures.items())
    exited = [f.exitcode for _, f in failures if f.exitcode > 0]
    return exited[0] if exited else 128 - failures[0][1].exitcode


def failure_lines(error: ChildFailedError) -> list[str]:
    """One line per failed worker, lowest rank first, instead of torchrun's ChildFailedError block (the
    worker's own traceback is above it on stderr; with `torchrun --redirects`, in its log file)."""
    lines = []
    for rank, f in sorted(error.failures.items()):
        how = f"exit status {f.exitcode}" if f.exitcode > 0 else f"signal {f.signal_name()}"
        where = f"; its error file: {f.error_file}" if f.error_file and os.path.isfile(f.error_file) else ""
        lines.append(f"torchrun: rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed with {how}{where}")
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # see the module docstring
    try:
        run(args)
    except ChildFailedError as e:
        status = exit_status(e)
        if status not in STATUSES:
            print("\n".join(failure_lines(e)), file=sys.stderr)
        return status
    except SignalException as e:  # the launcher itself got SIGTERM (a scheduler's preemption): it passed the
        return 128 + int(e.sigval)  # signal on to the workers, which saved a checkpoint; 143 like theirs
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
