"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short hash of the checkout the benchmark runs from ("unknown" without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"
