from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.loader.checkpoint import CheckpointError, CheckpointReader


def test_index_and_lazy_metadata(tiny_ckpt):
    r = CheckpointReader(tiny_ckpt)
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(r.names()) == set(index["weight_map"])
    assert len(r.files()) >= 2
    assert r.file_of("embed.weight") == index["weight_map"]["embed.weight"]
    assert r.shape("layers.0.attn.wq_a.weight") == (40, 96)
    assert r.dtype("layers.0.attn.wq_a.weight") == torch.float8_e4m3fn
    assert r.dtype("layers.0.attn.wq_a.scale") == torch.float8_e8m0fnu
    assert r.shape("layers.0.attn.wq_a.scale") == (2, 3)  # q_lora 40 in blocks of 32: ragged
    assert r.dtype("layers.3.ffn.experts.0.w1.weight") == torch.int8
    assert r.shape("layers.3.ffn.experts.0.w1.weight") == (64, 48)
    assert r.dtype("layers.0.ffn.gate.tid2eid") == torch.int32
    assert r.dtype("embed.weight") == torch.bfloat16
    assert r.dtype("hc_head_fn") == torch.float32
    assert r.get("norm.weight").shape == (96,)
    assert r.get("embed.weight", (slice(2, 4),)).shape == (2, 96)
    assert index["metadata"]["total_size"] > 0


def test_scan_without_index(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    save_file({"b": torch.ones(3, dtype=torch.int32)}, str(tmp_path / "y.safetensors"))
    r = CheckpointReader(tmp_path)
    assert sorted(r.names()) == ["a", "b"]
    assert r.file_of("b") == "y.safetensors"
    assert r.get("b").tolist() == [1, 1, 1]


def test_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        CheckpointReader(tmp_path)
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(CheckpointError, match="a is stored twice: in x.safetensors and y.safetensors"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "x.safetensors", "w": "gone-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone-00002.safetensors \\(holds e.g. w\\)"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))
    with pytest.raises(CheckpointError, match="tensor nope is not in the checkpoint"):
        CheckpointReader(tmp_path).get("nope")
