"""Runs a kernel check under the Triton interpreter (TRITON_INTERPRET=1) in a fresh process: the
variable must be set before triton is imported. The code prints 'ok' when every check passed."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout: int = 300) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
