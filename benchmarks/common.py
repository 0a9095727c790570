"""Helpers shared by the benchmark scripts.

A results file records the commit it measured, taken from git (`git_commit`) or from `--commit`
(a commit hash, checked for its form) and from nowhere else: free text never reaches the field.
"""
from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

COMMIT_FORM = re.compile(r"[0-9a-f]{7,40}(-dirty)?")


def git_commit(cwd: str | Path | None = None) -> str:
    """Short hash of HEAD of the checkout at `cwd` (default: this script's) with "-dirty" when
    tracked files differ from it, or "unknown" without git. A copied working tree whose .git is
    older than its files reads as that older commit: pass the real one with --commit then."""
    here = Path(cwd) if cwd is not None else Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def commit_hash(value: str) -> str:
    """argparse type of --commit: 7 to 40 lowercase hex digits (as git prints them), optionally "-dirty"."""
    if not COMMIT_FORM.fullmatch(value):
        raise argparse.ArgumentTypeError(f"--commit: {value!r} is not a commit hash "
                                         "(7-40 lowercase hex digits, optionally -dirty)")
    return value


def add_commit_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--commit", type=commit_hash, default=None,
                    help="commit recorded in the results (default: git HEAD, -dirty when tracked files differ)")


def recorded_commit(args: argparse.Namespace) -> str:
    """The commit a results file records: --commit if given, else git's."""
    return args.commit or git_commit()
