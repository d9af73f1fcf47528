"""One line and exit status 2 for a user's error, shared by every entry point (launch/, benchmarks/).

A user error (a bad flag, config key, input file or output path) is a ValueError (ConfigError is one)
raised before any output is written; `user_errors` turns it into one line on stderr, `error: ...`,
and exit status 2, the status argparse gives a bad flag. Anything else is a bug and keeps its
traceback. The training entry points (launch/pretrain.py, posttrain.py) add the run-dir lock and the
process group around this (runtime/errors.py lists their statuses).
"""

import functools
import sys

EXIT_USER_ERROR = 2


def one_line(message) -> str:
    """`message` on one line (a library's multi-line text joined with '; ')."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def fail(message) -> None:
    """Print `error: message` (one line) to stderr and exit with status 2."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def user_errors(main):
    """Decorator for a tool's `main`: a ValueError escaping it becomes `fail(its message)`."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ValueError as e:
            fail(e)

    return wrapped
