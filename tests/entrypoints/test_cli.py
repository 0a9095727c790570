"""The command line as a new user meets it: instant --help, flags checked before the model loads,
one-line errors with exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", *args], env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_help_does_not_import_torch():
    code = ("import sys\nfrom deepinfer.entrypoints import cli\ntry:\n    cli.main(['generate', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\nassert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--max-tokens" in res.stdout


def _one_line_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer: error: "), res.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_a_model_that_cannot_be_found_is_one_line(tmp_path):
    _one_line_error(_cli("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi", "--device", "cpu"),
                    "not found", "nowhere")
    _one_line_error(_cli("generate", "--model", "no-such-org/no-such-model", "--prompt", "hi", "--device", "cpu"),
                    "not found", "no-such-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_cuda_without_a_cuda_device_is_one_line(tmp_path):
    _one_line_error(_cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cuda"),
                    "device", "cuda")


def test_sampling_flags_are_checked_before_the_model_is_looked_for(tmp_path):
    # the model does not exist: the error must be the flag's, found before any loading
    for flag, value, field in [("--top-p", "2", "top_p"), ("--temperature", "-1", "temperature"),
                               ("--max-tokens", "0", "max_tokens"), ("--n", "0", "n")]:
        _one_line_error(_cli("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi", flag, value),
                        field)
