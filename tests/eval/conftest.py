"""Checkpoints the eval tests share (written once a session)."""
import pytest

from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint


@pytest.fixture(scope="session")
def tiny41(tmp_path_factory):
    """The tiny DeepSeek-V4.1 preset with its DSpark draft stages (window 16, draft block 5), FP8 weights."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny41") / "ckpt", PRESETS["tiny41"], seed=7, dtype="fp8")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny DeepSeek-V4 preset, FP8 weights."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", PRESETS["tiny"], seed=3, dtype="fp8")
