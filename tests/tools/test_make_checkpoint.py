from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch

from deepinfer.loader.checkpoint import CheckpointReader
from deepinfer.tools.make_checkpoint import PRESETS, main, random_weights, weight_specs, write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("mk") / "tiny", PRESETS["tiny"], seed=0)


def test_config_json(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg["compress_ratios"] == [0, 4, 16, 4, 16, 0, 0]
    assert cfg["num_hash_layers"] == 2 and cfg["qk_rope_head_dim"] == 16
    assert cfg["rope_scaling"] == {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                                   "beta_fast": 32, "beta_slow": 1}
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}
    assert cfg["expert_dtype"] == "fp4"
    assert (cfg["rope_theta"], cfg["compress_rope_theta"]) == (10000.0, 160000.0)


def test_shards_and_index(tiny):
    files = sorted(p.name for p in tiny.glob("*.safetensors"))
    assert len(files) >= 2
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    r = CheckpointReader(tiny)
    total = sum(math.prod(r.shape(k)) * r.dtype(k).itemsize for k in r.names())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"].values()) == set(files)


def test_storage_dtypes(tiny):
    r = CheckpointReader(tiny)
    names = set(r.names())
    fp8 = [n for n in names if n.endswith(".weight") and r.dtype(n) == torch.float8_e4m3fn]
    assert all(n[:-7] + ".scale" in names for n in fp8)
    want_fp8 = ["layers.1.attn.wq_a", "layers.1.attn.wq_b", "layers.1.attn.wkv", "layers.1.attn.wo_a",
                "layers.1.attn.wo_b", "layers.1.attn.indexer.wq_b", "layers.1.ffn.shared_experts.w1",
                "layers.1.ffn.shared_experts.w2", "layers.1.ffn.shared_experts.w3", "mtp.0.e_proj", "mtp.0.h_proj"]
    for stem in want_fp8:
        assert r.dtype(stem + ".weight") == torch.float8_e4m3fn, stem
        assert r.dtype(stem + ".scale") == torch.float8_e8m0fnu, stem
    assert r.dtype("layers.1.ffn.experts.3.w2.weight") == torch.int8
    assert r.shape("layers.1.ffn.experts.3.w2.weight") == (96, 32)
    assert r.shape("layers.1.ffn.experts.3.w2.scale") == (96, 2)
    assert r.dtype("layers.1.ffn.experts.3.w2.scale") == torch.float8_e8m0fnu
    for n in ["embed.weight", "head.weight", "norm.weight", "layers.1.attn_norm.weight", "layers.1.ffn.gate.weight",
              "layers.1.attn.compressor.wkv.weight", "layers.1.attn.compressor.wgate.weight",
              "layers.1.attn.indexer.weights_proj.weight", "layers.1.attn.q_norm.weight"]:
        assert r.dtype(n) == torch.bfloat16, n
    for n in ["hc_head_fn", "layers.1.hc_attn_fn", "layers.1.hc_ffn_scale", "layers.1.attn.attn_sink",
              "layers.1.attn.compressor.ape", "layers.3.ffn.gate.bias"]:
        assert r.dtype(n) == torch.float32, n
    assert r.dtype("layers.0.ffn.gate.tid2eid") == torch.int32
    # layout: compressor/indexer only where the ratio needs them, bias vs hash table
    assert "layers.0.attn.compressor.ape" not in names and "layers.5.attn.compressor.ape" not in names
    assert r.shape("layers.1.attn.compressor.ape") == (4, 128) and "layers.1.attn.indexer.wq_b.weight" in names
    assert r.shape("layers.2.attn.compressor.ape") == (16, 64) and "layers.2.attn.indexer.wq_b.weight" not in names
    assert "layers.1.ffn.gate.tid2eid" in names and "layers.1.ffn.gate.bias" not in names
    assert "layers.2.ffn.gate.bias" in names and "mtp.0.ffn.gate.bias" in names
    assert not any(n.startswith("mtp.1.") for n in names)


def test_random_values():
    w = dict(random_weights(PRESETS["tiny"], 7))
    for name, t in w.items():
        assert t.dtype == (torch.int32 if name.endswith("tid2eid") else torch.float32), name
        assert t.abs().sum() > 0, name
    tid = w["layers.1.ffn.gate.tid2eid"]
    assert tid.shape == (1024, 3) and int(tid.min()) >= 0 and int(tid.max()) < 8
    assert all(len(set(row)) == 3 for row in tid.tolist())
    s = w["layers.0.hc_attn_scale"]
    assert bool(((s >= 0.5) & (s <= 1.5)).all())
    assert abs(float(w["embed.weight"].std()) - 1) < 0.05
    assert abs(float(w["layers.0.attn.wq_a.weight"].std()) - 96 ** -0.5) < 0.02
    again = dict(random_weights(PRESETS["tiny"], 7))
    assert all(torch.equal(w[k], again[k]) for k in w)
    other = dict(random_weights(PRESETS["tiny"], 8))
    assert not torch.equal(w["embed.weight"], other["embed.weight"])


def test_dspark_layout():
    specs = {s.name: s for s in weight_specs(PRESETS["tiny-dspark"])}
    assert specs["mtp.0.main_proj.weight"].shape == (96, 288) and specs["mtp.0.main_proj.weight"].store == "fp8"
    assert "mtp.0.main_norm.weight" in specs and "mtp.1.main_proj.weight" not in specs
    # -0731's names as vLLM 0.34.0 loads them (V4.1's Markov head is markov_head.embed / head)
    assert specs["mtp.2.markov_head.markov_w1.weight"].shape == (1024, 16)
    assert specs["mtp.2.markov_head.markov_w2.weight"].shape == (1024, 16)
    assert specs["mtp.2.hc_head_fn"].shape == (4, 4 * 96) and specs["mtp.2.hc_head_base"].shape == (4,)
    assert specs["mtp.2.confidence_head.proj.weight"].shape == (1, 112)
    assert specs["mtp.2.confidence_head.proj.weight"].store == "fp32"
    assert "mtp.2.norm.weight" in specs and "mtp.1.norm.weight" not in specs
    for k in range(3):
        assert f"mtp.{k}.ffn.gate.bias" in specs and f"mtp.{k}.attn.wq_a.weight" in specs
        assert f"mtp.{k}.e_proj.weight" not in specs and (f"mtp.{k}.hc_head_fn" in specs) == (k == 2)
        assert not any(n.startswith(f"mtp.{k}.attn.compressor") for n in specs)


def test_flash_parameter_count():
    specs = weight_specs(PRESETS["flash"])
    trunk = sum(math.prod(s.shape) for s in specs if not s.name.startswith("mtp.") and "tid2eid" not in s.name)
    mtp = sum(math.prod(s.shape) for s in specs if s.name.startswith("mtp."))
    assert round(trunk / 1e9, 1) == 284.3 and round(mtp / 1e9, 1) == 6.6
    shapes = {s.name: s.shape for s in specs}
    assert shapes["layers.2.attn.compressor.ape"] == (4, 1024) and shapes["layers.3.attn.compressor.ape"] == (128, 512)
    assert shapes["layers.2.attn.indexer.compressor.ape"] == (4, 256)
    assert shapes["layers.0.attn.wo_a.weight"] == (8192, 4096) and shapes["layers.0.hc_attn_fn"] == (24, 16384)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unquantised(tmp_path, dtype):
    out = write_checkpoint(tmp_path / dtype, PRESETS["tiny"], dtype=dtype, tokenizer=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg
    r = CheckpointReader(out)
    assert not any(n.endswith(".scale") for n in r.names())
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert r.dtype("layers.1.attn.wq_a.weight") == want and r.dtype("layers.1.ffn.experts.0.w1.weight") == want
    assert r.dtype("layers.1.attn.attn_sink") == torch.float32


def test_cli(tmp_path, capsys):
    main(["--arch", "deepseek_v4", "--out", str(tmp_path / "c"), "--preset", "tiny", "--seed", "4",
          "--max-shard-mb", "0.25"])
    files = list((tmp_path / "c").glob("model-*.safetensors"))
    assert len(files) >= 8
    assert re.search(r"wrote tiny .* shards", capsys.readouterr().out)
    assert (tmp_path / "c" / "tokenizer.json").is_file()


def test_demo_preset_is_fast(tmp_path):
    t0 = time.perf_counter()
    out = write_checkpoint(tmp_path / "demo", PRESETS["demo"])
    assert time.perf_counter() - t0 < 20
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 4096 and cfg["quantization_config"]["weight_block_size"] == [64, 64]
    assert len(CheckpointReader(out).files()) >= 2
