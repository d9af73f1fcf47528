"""Conditions a run stops on that the user must act on, raised identically on every rank.

The entry point prints the one-line message (rank 0) and exits with `exit_code`:
  2    bad input or run dir (config, data, checkpoints, lock, disk full): fix it, then relaunch;
  3    the run diverged (too many non-finite steps in a row or in all, or none finite; runtime/guards.py):
       change the config or data, then relaunch;
  4    a collective timed out or a peer rank died (runtime/comm.py; one line per rank): relaunch, or
       read run.dir/comm_traces if it repeats;
  143  preempted (SIGTERM): a checkpoint was saved; relaunch the same command to continue.
"""


class RunError(Exception):
    exit_code = 2


class Diverged(RunError):
    exit_code = 3


class Preempted(RunError):
    exit_code = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM
