"""Checkpoints the eval tests share (written once a session), and a tool's command run in-process."""
import json

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


@pytest.fixture
def command(capsys):
    """command(main, argv): runs a tool's main, which must return 0; the JSON object it printed last."""
    def call(main, argv: list[str]) -> dict:
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return call
