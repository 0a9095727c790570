"""The writer's checkpoints load into deepinfer's own DeepseekV4ForCausalLM (contract check)."""
from __future__ import annotations

import pytest
import torch

from deepinfer.loader import load_weights, read_model_config
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

models = pytest.importorskip("deepinfer.models.deepseek_v4")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    return {
        "tiny": write_checkpoint(root / "tiny", PRESETS["tiny"], seed=1, tokenizer=False),
        "tiny-dspark": write_checkpoint(root / "dspark", PRESETS["tiny-dspark"], seed=1, tokenizer=False),
        "hf": write_checkpoint(root / "hf", PRESETS["tiny"], seed=1, dtype="bfloat16", layout="hf",
                               tokenizer=False),
    }


@pytest.mark.parametrize("which,quantized", [("tiny", False), ("tiny", True), ("tiny-dspark", False),
                                             ("tiny-dspark", True), ("hf", False)])
def test_loads(ckpts, which, quantized):
    path = ckpts[which]
    cfg = read_model_config(path)
    model = models.DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16 if quantized else torch.float32,
                                         quantized=quantized)
    load_weights(model, path, config=cfg)
    assert not getattr(model, "unmapped_tensors", None)
    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.element_size() > 1:
            assert torch.isfinite(t).all(), name
