"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short hash of the checkout the benchmark runs from ("unknown" without git), with "-dirty" when
    tracked files differ from it (e.g. a copied working tree whose .git is older than its files: pass
    the real commit explicitly then)."""
    try:
        here = Path(__file__).parent
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"
