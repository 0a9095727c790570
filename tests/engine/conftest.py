"""Tiny random checkpoints (fp32 tests on the CPU) shared by the engine tests."""
import pytest

from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = {**PRESETS["tiny"], "index_topk": 64}  # top-k >= entries: no indexer near-ties across chunkings


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", CFG, seed=11, dtype="fp8")


@pytest.fixture(scope="module")
def ckpt41(tmp_path_factory):
    """DeepSeek-V4.1 (Engram, CSA2 roles, DSpark stages): its windows come from the device history."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny41") / "ckpt", PRESETS["tiny41"], seed=5, dtype="fp8")


@pytest.fixture(scope="module")
def ckpt0731(tmp_path_factory):
    """DeepSeek-V4-Flash-0731's layout: V4 with three DSpark stages in place of the MTP layer."""
    return write_checkpoint(tmp_path_factory.mktemp("dspark") / "ckpt", {**PRESETS["tiny-dspark"], "index_topk": 64},
                            seed=11, dtype="fp8")
