from __future__ import annotations

import json

import pytest

from deepinfer.loader.model_config import read_model_config
from deepinfer.models.config import ConfigError, DeepseekV4Config
from deepinfer.tools.make_checkpoint import PRESETS, checkpoint_config


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_unknown_model_type(tmp_path):
    d = _write(tmp_path, {**PRESETS["tiny"], "model_type": "llama"})
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported") as ei:
        read_model_config(d)
    assert "config.json" in str(ei.value)


@pytest.mark.parametrize("qc", [
    {"quant_method": "awq", "bits": 4},
    {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
])
def test_unsupported_quantization(tmp_path, qc):
    with pytest.raises(ConfigError, match="quantization_config"):
        read_model_config(_write(tmp_path, {**PRESETS["tiny"], "quantization_config": qc}))


def test_presets_parse():
    tiny = DeepseekV4Config.from_dict(PRESETS["tiny"])
    assert tiny.quant.block_size == (32, 32) and tiny.quant.expert_dtype == "fp4"
    assert tiny.compress_ratios == (0, 4, 16, 4, 16, 0) and tiny.num_hash_layers == 2
    flash = DeepseekV4Config.from_dict(PRESETS["flash"])
    assert flash.layer_kinds.count("csa") == 21 and flash.layer_kinds.count("hca") == 20
    assert DeepseekV4Config.from_dict(PRESETS["tiny-dspark"]).has_dspark
    hf = DeepseekV4Config.from_dict(checkpoint_config(PRESETS["tiny"], "bfloat16", layout="hf"))
    assert hf.compress_ratios == tiny.compress_ratios and hf.qk_rope_head_dim == 16
    assert hf.rope_scaling == tiny.rope_scaling and hf.quant.block_size is None
