"""config.json keys that change the math: every RoPE form the writers produce (DeepSeek's
`rope_scaling`, transformers' nested `rope_parameters`, the flat `rope_parameters` NeMo AutoModel
and transformers 5 write) is read, and any value deepinfer does not implement is refused by name."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.model_loader import load_model
from deepinfer.models.config import ConfigError, DeepseekV4Config
from deepinfer.models.config_v41 import DeepseekV41Config
from deepinfer.tools.make_checkpoint import PRESETS, checkpoint_config, write_checkpoint
from nemo_oracle import nemo_v41_config, nemo_v41_logits, nemo_v41_model
from test_deepseek_v41 import _close, _ids, _run

TINY = PRESETS["tiny"]
TINY41 = PRESETS["tiny41"]


def _flat_v4(cfg: dict) -> dict:
    """`cfg` with its rope_scaling moved into a flat rope_parameters carrying the main theta."""
    out = copy.deepcopy(cfg)
    scaling = out.pop("rope_scaling")
    kind = scaling.pop("type", None) or scaling.pop("rope_type")
    out["rope_parameters"] = {"rope_type": kind, **scaling, "rope_theta": out["rope_theta"]}
    return out


def _nemo_written(cfg: dict, where: Path) -> dict:
    """The config.json NeMo AutoModel's DeepseekV41Config.save_pretrained writes for `cfg`."""
    cfg = copy.deepcopy(cfg)
    cfg["text_config"]["engram_compressed_vocab_size"] = cfg["text_config"]["engram_compressed_vocab_size"] or 500
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(cfg))
    nemo_v41_config(where).save_pretrained(where / "nemo")
    return json.loads((where / "nemo" / "config.json").read_text())


def test_v4_flat_rope_parameters_read_like_rope_scaling():
    want = DeepseekV4Config.from_dict(TINY)
    assert want.rope_scaling is not None
    assert DeepseekV4Config.from_dict(_flat_v4(TINY)) == want
    hf = checkpoint_config(TINY, "bfloat16", layout="hf")
    hf["rope_parameters"] = _flat_v4(TINY)["rope_parameters"]
    flat_hf = DeepseekV4Config.from_dict(hf)
    assert (flat_hf.rope_scaling, flat_hf.rope_theta, flat_hf.compress_rope_theta) == \
        (want.rope_scaling, want.rope_theta, want.compress_rope_theta)


def test_v4_config_written_by_transformers_reads_like_the_original(tmp_path):
    from transformers import DeepseekV4Config as HFConfig
    hf = checkpoint_config(TINY, "bfloat16", layout="hf")
    hf["rope_parameters"] = _flat_v4(TINY)["rope_parameters"]
    HFConfig(**{k: v for k, v in hf.items() if k != "model_type"}).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    got = DeepseekV4Config.from_dict(written)
    want = DeepseekV4Config.from_dict(TINY)
    assert (got.rope_scaling, got.rope_theta, got.compress_rope_theta, got.qk_rope_head_dim) == \
        (want.rope_scaling, want.rope_theta, want.compress_rope_theta, want.qk_rope_head_dim)


def test_v41_config_as_nemo_writes_it_reads_like_the_original(tmp_path):
    written = _nemo_written(TINY41, tmp_path)
    text = written["text_config"]
    assert "rope_scaling" not in text and text["rope_parameters"]["rope_type"] == "yarn"
    orig = copy.deepcopy(TINY41)
    orig["text_config"]["engram_compressed_vocab_size"] = text["engram_compressed_vocab_size"]
    want = DeepseekV41Config.from_dict(orig)
    got = DeepseekV41Config.from_dict(written)
    assert want.rope_scaling is not None
    assert dataclasses.replace(got, vision=want.vision) == want


def test_v41_flat_rope_checkpoint_matches_nemo(tmp_path):
    """A V4.1 checkpoint whose config.json is the one NeMo writes (flat rope_parameters, no
    rope_scaling): deepinfer's logits equal NeMo's, so the compressed layers carry YaRN."""
    ckpt = write_checkpoint(tmp_path / "ckpt", TINY41, seed=0, dtype="fp8")
    written = _nemo_written(json.loads((ckpt / "config.json").read_text()), tmp_path / "nemo-config")
    (ckpt / "config.json").write_text(json.dumps(written))
    ours = load_model(str(ckpt), dtype=torch.float32)[0]
    nemo = nemo_v41_model(ckpt)[0]
    ids = _ids(0, 1, 40)
    with torch.inference_mode():
        ref = nemo_v41_logits(nemo, ids, exact=True)
    _close(_run(ours, ids, [40], "float32"), ref, 1e-4)


# (change to the config dict, the key the error must name). Applied to V4's top level and to
# V4.1's text_config.
_YARN = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
         "beta_slow": 1, "rope_theta": 10000.0}
_MATH = [
    ({"rope_parameters": {**_YARN, "rope_type": "linear"}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {**_YARN, "rope_type": "deepseek_yarn"}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {**_YARN, "mscale": 1.0}}, "rope_parameters.mscale"),
    ({"rope_parameters": {**_YARN, "attention_factor": 1.2}}, "rope_parameters.attention_factor"),
    ({"rope_parameters": {**_YARN, "truncate": False}}, "rope_parameters.truncate"),
    ({"rope_parameters": {k: v for k, v in _YARN.items() if k != "factor"}}, "rope_parameters.factor"),
    ({"rope_parameters": {**_YARN, "partial_rotary_factor": 0.5}}, "rope_parameters.partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "factor": 4}}, "rope_parameters.factor"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", **{k: v for k, v in _YARN.items() if k != "rope_type"}},
                          "compress": {"rope_type": "default", "rope_theta": 160000.0}}},
     "rope_parameters.main"),
    ({"rope_parameters": {**_YARN, "rope_theta": 50000.0}}, "rope_theta"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                       "low_freq_factor": 1.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"type": "yarn", "rope_type": "default", "factor": 16,
                       "original_max_position_embeddings": 64}}, "rope_scaling"),
    ({"rope_parameters": {**_YARN, "factor": 8}}, "rope_parameters"),  # disagrees with rope_scaling
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"n_group": 8, "topk_group": 4}, "n_group"),
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"qk_nope_head_dim": 16}, "qk_nope_head_dim"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"swiglu_limit": None}, "swiglu_limit"),
    ({"hidden_size": "96"}, "hidden_size"),
    ({"rms_norm_eps": True}, "rms_norm_eps"),
]
_V4_ONLY = [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 16}}, "compress_rates"),
    ({"compress_rate_hca": 32}, "compress_rate_hca"),
    ({"num_hash_layers": 2, "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 3}, "mlp_layer_types"),
]
_QUANT = [
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme"),
    ({"scale_fmt": "e5m2"}, "quantization_config.scale_fmt"),
    ({"modules_to_not_convert": ["head"]}, "quantization_config.modules_to_not_convert"),
    ({"weight_block_size": [32]}, "quantization_config.weight_block_size"),
]


@pytest.mark.parametrize("change, key", _MATH + _V4_ONLY, ids=lambda v: None if isinstance(v, dict) else v)
def test_v4_refuses_math_it_does_not_implement(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DeepseekV4Config.from_dict({**TINY, **change})


@pytest.mark.parametrize("change, key", _MATH, ids=lambda v: None if isinstance(v, dict) else v)
def test_v41_refuses_math_it_does_not_implement(change, key):
    cfg = copy.deepcopy(TINY41)
    cfg["text_config"].update(copy.deepcopy(change))
    with pytest.raises(ConfigError, match=r"text_config\." + key.replace(".", r"\.")):
        DeepseekV41Config.from_dict(cfg)


@pytest.mark.parametrize("change, key", _QUANT, ids=lambda v: None if isinstance(v, dict) else v)
@pytest.mark.parametrize("preset", ["tiny", "tiny41"])
def test_unsupported_quantization_keys_refused(preset, change, key):
    cfg = copy.deepcopy(PRESETS[preset])
    cfg["quantization_config"].update(change)
    parse = DeepseekV41Config.from_dict if preset == "tiny41" else DeepseekV4Config.from_dict
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse(cfg)


def test_v41_top_level_tied_embeddings_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY41, "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match="tie_word_embeddings") as ei:
        read_model_config(tmp_path)
    assert "config.json" in str(ei.value)


@pytest.mark.parametrize("preset", ["tiny", "tiny-dspark", "demo", "flash", "tiny41", "demo41", "flash41"])
def test_presets_still_parse(preset):
    parse = DeepseekV41Config.from_dict if preset.endswith("41") else DeepseekV4Config.from_dict
    assert parse(PRESETS[preset]).rope_scaling is not None


def test_a_list_of_eos_ids_stops_on_the_first():
    assert DeepseekV4Config.from_dict({**TINY, "eos_token_id": [7, 9]}).eos_token_id == 7
    assert DeepseekV41Config.from_dict({**TINY41, "eos_token_id": [7, 9]}).eos_token_id == 7


def test_v41_dspark_confidence_input_is_read_or_refused():
    cfg = copy.deepcopy(TINY41)
    assert DeepseekV41Config.from_dict(cfg).dspark_confidence_input == "residual"
    cfg["text_config"]["dspark_confidence_input"] = "normalized"
    assert DeepseekV41Config.from_dict(cfg).dspark_confidence_input == "normalized"
    cfg["text_config"]["dspark_confidence_input"] = "pre_norm"
    with pytest.raises(ConfigError, match=r"text_config\.dspark_confidence_input"):
        DeepseekV41Config.from_dict(cfg)
