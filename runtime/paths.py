"""Checks of output paths that the command-line tools in launch/ share (no torch: the tools that
need none start fast)."""

import os


def check_output_file(flag: str, path: str, example: str) -> None:
    """ValueError, naming `flag`, unless `path` can be written as a file: not a directory, in a directory
    that exists (`example`: the file name the hint suggests inside a directory)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file such as {os.path.join(path, example)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{flag} {path}: {parent} {what}")
