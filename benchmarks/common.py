"""Helpers shared by the benchmark scripts.

A results file records the commit it measured, taken from git (`git_commit`) or from `--commit`
(a commit hash, checked for its form) and from nowhere else: free text never reaches the field.

A results file is never overwritten: a script checks its `--out` before measuring (`refuse_existing_out`) and
its default path when it picks it (`new_results_path`); `write_results` creates a file exclusively. A new run
gets a new name; the old file stays in git history.
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


def new_results_path(path: str | Path) -> Path:
    """`path` as a Path, for a results file that does not exist yet; FileExistsError naming it otherwise."""
    p = Path(path)
    if p.exists():
        raise FileExistsError(f"{p}: results file exists; a results file is never overwritten "
                              "(pass --out with a new name; the old file stays in git history)")
    return p


def refuse_existing_out(args: argparse.Namespace) -> None:
    """Right after parse_args: a run whose --out names an existing file stops before measuring anything."""
    if getattr(args, "out", None):
        new_results_path(args.out)


def write_results(path: str | Path, text: str) -> Path:
    """Creates the results file `path` holding `text`; never replaces one (FileExistsError naming it)."""
    p = new_results_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(p, "x") as f:
            f.write(text)
    except FileExistsError:
        new_results_path(p)  # appeared meanwhile: the same error
    return p


def recorded_commit(args: argparse.Namespace) -> str:
    """The commit a results file records: --commit if given, else git's."""
    return args.commit or git_commit()
