"""One line and exit status 2 for a user's error, shared by every entry point (launch/, benchmarks/).

A user error (a bad flag, config key, input file or output path) is a ValueError (ConfigError is one)
raised before any output is written; `user_errors` (a decorator for `main`) or `report` (for a `main`
that returns its status) turns it into one line on stderr, `error: ...`, and exit status 2, the
status argparse gives a bad flag. Anything else is a bug and keeps its traceback. The training entry
points (launch/pretrain.py, posttrain.py) print their stop lines through `one_line` and add the run-dir
lock (released on every way out) and the process group around this (runtime/errors.py lists their
statuses). Under torchrun, `launch/torchrun.py` passes the workers' status through (docs/errors.md).
"""

import functools
import sys

EXIT_USER_ERROR = 2


def one_line(message) -> str:
    """`message` on one line (a library's multi-line text joined with '; ')."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def report(message, prefix: str = "error") -> int:
    """Print `prefix: message` (one line) to stderr; returns 2, for a `main` that returns its status."""
    print(f"{prefix}: {one_line(message)}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def fail(message, prefix: str = "error") -> None:
    """`report`, then exit with status 2."""
    raise SystemExit(report(message, prefix))


def os_error_message(e: OSError, default_path: str = "") -> str:
    """`path: reason` of a failed read or write (a full disk names no file: then `default_path`)."""
    return f"{e.filename or default_path}: {e.strerror or e}"


def user_errors(main):
    """Decorator for a tool's `main`: a ValueError (or an OSError: a file that cannot be read or written)
    escaping it becomes `fail(its message)`: one line, exit status 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ValueError as e:
            fail(e)
        except OSError as e:
            fail(os_error_message(e))

    return wrapped
