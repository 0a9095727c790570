"""The trained demo checkpoint shipped in the package: checked against its SHA-256 before use, and
trained (its perplexity on Python the training never saw is far below a random model's)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deepinfer.tools import demo

ROOT = Path(__file__).resolve().parents[2]


def test_every_shipped_file_is_checksummed_and_matches():
    shipped = {p.name for p in demo.DEMO_DIR.iterdir()} - {"training.json"}
    assert shipped == set(demo.DEMO_SHA256)
    assert demo.resolve_demo("demo") == str(demo.DEMO_DIR)
    assert demo.resolve_demo("/some/dir") is None


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_damaged_demo_file_is_refused_by_name(tmp_path, damage):
    copy = tmp_path / "demo41"
    shutil.copytree(demo.DEMO_DIR, copy)
    victim = copy / "tokenizer_config.json"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_text(victim.read_text() + " ")
    with pytest.raises((FileNotFoundError, ValueError), match="tokenizer_config.json"):
        demo.demo_checkpoint(copy)


def _perplexity(model: str) -> float:
    """deepinfer.eval.perplexity, reduced: the first 256 tokens of a file of this repository, one window, fp32."""
    from deepinfer.eval.perplexity import run

    result = run(["--model", model, "--file", str(ROOT / "deepinfer" / "sampling_params.py"), "--max-tokens", "256",
                  "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(64 << 20)])
    assert result["tokens"] == 256
    return result["perplexity"]


def test_the_demo_checkpoints_are_known_by_path(tmp_path, monkeypatch):
    """The server's thinking default asks this of the model directory, whatever name it was served under."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo.is_demo_dir(demo.DEMO_DIR) and demo.is_demo_dir(str(demo.DEMO_DIR) + "/")
    assert demo.is_demo_dir(demo.default_cache_dir() / demo.RANDOM_DEMO_DIRNAME)
    assert not demo.is_demo_dir(tmp_path) and not demo.is_demo_dir(demo.DEMO_DIR.parent)


def test_the_demo_is_trained_and_the_random_demo_is_not(tmp_path, monkeypatch):
    """Python the training never saw (this repository, not the standard library): 54 for the trained demo
    when shipped, 6633 for the random one (vocabulary 4096)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    trained, random = _perplexity("demo"), _perplexity("demo-random")
    assert trained < 200 < 4096 < random, (trained, random)


def test_the_demo_draft_is_trained_and_calibrated(tmp_path, capsys):
    """deepinfer.eval.dspark on the shipped demo, reduced: 4 prompts of the standard library's ast.py (one of
    the files held out of the training data) x 32 greedy tokens, fp32. The drafts are accepted far more often than a
    random draft's (1.017 tokens a block on the random demo); measured when shipped (Python 3.11.7): mean
    acceptance length 1.89. The checkpoint's calibration is applied."""
    import ast

    from deepinfer.eval.dspark import run

    result = run(["--model", "demo", "--file", ast.__file__, "--prompt-len",
                  "64", "--max-prompts", "4", "--max-tokens", "32", "--device", "cpu",
                  "--kv-cache-memory", str(64 << 20), "--max-model-len", "512"])
    assert result["mean_acceptance_length"] > 1.3, result
    assert len(result["temperatures"]) == 5 and len(result["ece_calibrated_per_position"]) == 5
