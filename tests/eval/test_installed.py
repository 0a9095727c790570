"""deepinfer.eval is part of the installed package: its commands run from any directory, not only from the
repository root."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python ARGS` in a directory outside the repository, with no PYTHONPATH: only installed packages import."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_tools_run_from_outside_the_repository(tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    r = _python(tmp_path, "-m", "deepinfer.eval.perplexity", "--help")
    assert r.returncode == 0, r.stderr
    assert "python -m deepinfer.eval.perplexity" in r.stdout and "--file" in r.stdout
    r = _python(tmp_path, "-m", "deepinfer.eval", "replay", "--help")
    assert r.returncode == 0, r.stderr
    assert "--keep" in r.stdout
