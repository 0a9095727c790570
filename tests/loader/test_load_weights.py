from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.formats.quant import dequant_fp8_blocks, quant_fp4, quant_fp8_blocks
from deepinfer.loader.checkpoint import CheckpointReader
from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.model_loader import load_model
from deepinfer.loader.names import split_expert_name
from deepinfer.loader.weights import CheckpointError, load_weights
from deepinfer.models.config import DeepseekV4Config
from deepinfer.tools.make_checkpoint import PRESETS, random_weights, weight_specs, write_checkpoint


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(ckpt, fn):
    """Apply fn(dict of tensors, file name) to every shard of a copied checkpoint, fix the index."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    new_map = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / f), "pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        tensors = fn(tensors, f)
        save_file(tensors, str(ckpt / f))
        new_map.update({k: f for k in tensors})
    index["weight_map"] = new_map
    index_path.write_text(json.dumps(index))


def test_dense_load_matches_writer(tiny_ckpt, tiny_config, toy, expected):
    reader = CheckpointReader(tiny_ckpt)
    assert len(reader.files()) >= 2
    assert (tiny_ckpt / "model.safetensors.index.json").is_file()
    cfg = read_model_config(tiny_ckpt)
    model = toy(tiny_config)
    load_weights(model, tiny_ckpt, config=cfg)
    want = expected(tiny_config, seed=3)
    sd = model.state_dict()
    assert set(sd) == set(want)
    for k, v in want.items():
        assert sd[k].dtype == v.dtype, k
        assert torch.equal(sd[k], v), k
    # hash table is a set of distinct experts per token
    t = sd["layers.0.ffn.gate.tid2eid"]
    assert t.shape == (1024, 3) and all(len(set(r.tolist())) == 3 for r in t[:50])


def test_dense_bfloat16_model(tiny_ckpt, tiny_config, toy, expected):
    model = toy(tiny_config, dtype=torch.bfloat16)
    load_weights(model, tiny_ckpt, config=read_model_config(tiny_ckpt))
    want = expected(tiny_config, seed=3, dtype=torch.bfloat16)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_quantized_load_is_raw(tiny_ckpt, tiny_config, toy):
    model = toy(tiny_config, quantized=True)
    load_weights(model, tiny_ckpt, config=read_model_config(tiny_ckpt))
    sd = model.state_dict()
    block = tuple(tiny_config["quantization_config"]["weight_block_size"])
    specs = {s.name: s for s in weight_specs(tiny_config)}
    for name, t in random_weights(tiny_config, 3):
        split = split_expert_name(name)
        if split is not None:
            stem, e, proj, _ = split
            w, s = quant_fp4(t, 32)
            assert torch.equal(sd[f"{stem}.{proj}"][e], w), name
            assert torch.equal(sd[f"{stem}.{proj}_scale"][e], s.view(torch.uint8)), name
        elif specs[name].store == "fp8":
            w, s = quant_fp8_blocks(t, block)
            assert torch.equal(sd[name].view(torch.uint8), w.view(torch.uint8)), name
            assert torch.equal(sd[name[:-7] + ".scale"].view(torch.uint8), s.view(torch.uint8)), name


def test_float32_scales(tmp_path, toy, expected):
    config = json.loads(json.dumps(PRESETS["tiny"]))
    config["quantization_config"]["scale_fmt"] = "float32"
    config["expert_dtype"] = "fp8"
    ckpt = write_checkpoint(tmp_path / "c", config, seed=5, tokenizer=False)
    r = CheckpointReader(ckpt)
    assert r.dtype("layers.0.attn.wq_a.scale") == torch.float32
    assert r.dtype("layers.0.ffn.experts.0.w1.weight") == torch.float8_e4m3fn
    model = toy(config)
    load_weights(model, ckpt, config=read_model_config(ckpt))
    # fp8 experts: the same block recipe as every other FP8 linear
    block = tuple(config["quantization_config"]["weight_block_size"])
    want = expected(config, seed=5)
    t = dict(random_weights(config, 5))["layers.2.ffn.experts.1.w2.weight"]
    assert torch.equal(model.state_dict()["layers.2.ffn.experts.w2"][1],
                       dequant_fp8_blocks(*quant_fp8_blocks(t, block), block))
    assert torch.equal(model.state_dict()["layers.0.attn.wq_a.weight"], want["layers.0.attn.wq_a.weight"])


def test_scale_in_other_shard(tiny_ckpt, tiny_config, tmp_path, toy, expected):
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    moved = {}

    def take_scale(tensors, f):
        if "layers.1.attn.wq_b.scale" in tensors:
            moved["layers.1.attn.wq_b.scale"] = tensors.pop("layers.1.attn.wq_b.scale")
        return tensors

    _rewrite(ckpt, take_scale)
    save_file(moved, str(ckpt / "extra.safetensors"))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.1.attn.wq_b.scale"] = "extra.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    reader = CheckpointReader(ckpt)
    assert reader.file_of("layers.1.attn.wq_b.scale") != reader.file_of("layers.1.attn.wq_b.weight")
    model = toy(tiny_config)
    load_weights(model, reader, config=read_model_config(ckpt))
    want = expected(tiny_config, seed=3)
    assert torch.equal(model.state_dict()["layers.1.attn.wq_b.weight"], want["layers.1.attn.wq_b.weight"])


def _load_error(ckpt, model, config=None) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_weights(model, ckpt, config=config or read_model_config(ckpt))
    return str(ei.value)


def test_error_missing_tensor(tiny_ckpt, tiny_config, tmp_path, toy):
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    _rewrite(ckpt, lambda t, f: {k: v for k, v in t.items()
                                 if k not in ("layers.2.attn.kv_norm.weight", "layers.3.ffn.experts.5.w2.weight",
                                              "layers.3.ffn.experts.5.w2.scale")})
    msg = _load_error(ckpt, toy(tiny_config))
    assert "layers.2.attn.kv_norm.weight" in msg
    assert "layers.3.ffn.experts.w2 (experts [5])" in msg


def test_error_draft_layer_partly_missing(tiny_ckpt, tmp_path):
    """Only a draft that is wholly absent is left out; a partial one is a broken checkpoint."""
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    _rewrite(ckpt, lambda t, f: {k: v for k, v in t.items() if not k.startswith("mtp.0.e_proj.")})
    with pytest.raises(CheckpointError, match=r"model tensors not found .*mtp\.0\.e_proj\.weight"):
        load_model(str(ckpt), dtype=torch.float32)


def test_error_unexpected_tensor(tiny_ckpt, tiny_config, tmp_path, toy):
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    files = []

    def add(t, f):
        if not files:
            files.append(f)
            t["layers.0.attn.bogus.weight"] = torch.zeros(3)
        return t

    _rewrite(ckpt, add)
    msg = _load_error(ckpt, toy(tiny_config))
    assert "layers.0.attn.bogus.weight" in msg and files[0] in msg


def test_error_wrong_shape(tiny_ckpt, tiny_config, tmp_path, toy):
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    where = []

    def shrink(t, f):
        if "layers.4.attn.attn_sink" in t:
            t["layers.4.attn.attn_sink"] = torch.zeros(5)
            where.append(f)
        return t

    _rewrite(ckpt, shrink)
    msg = _load_error(ckpt, toy(tiny_config))
    assert "layers.4.attn.attn_sink" in msg and where[0] in msg
    assert "[5]" in msg and "[4]" in msg


def test_error_bad_quant_dtype(tiny_ckpt, tiny_config, tmp_path, toy):
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    where = []

    def to_bf16(t, f):
        if "layers.0.attn.wkv.weight" in t:
            t["layers.0.attn.wkv.weight"] = t["layers.0.attn.wkv.weight"].to(torch.bfloat16)
            where.append(f)
        return t

    _rewrite(ckpt, to_bf16)
    msg = _load_error(ckpt, toy(tiny_config))
    assert "layers.0.attn.wkv.weight" in msg and where[0] in msg and "bfloat16" in msg


def test_error_missing_shard(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt, tmp_path / "c")
    (ckpt / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00004.safetensors"):
        CheckpointReader(ckpt)


def test_dspark_unmapped_mtp(tmp_path, toy):
    config = PRESETS["tiny-dspark"]
    ckpt = write_checkpoint(tmp_path / "d", config, seed=1, tokenizer=False)
    cfg = read_model_config(ckpt)
    assert cfg.has_dspark
    # a model without the draft stages: every mtp.* tensor is kept aside, raw
    trunk = {**config, "num_nextn_predict_layers": 0}
    model = toy(trunk)
    load_weights(model, ckpt, config=cfg)
    kept = model.unmapped_tensors
    assert "mtp.0.main_proj.weight" in kept and "mtp.0.main_proj.scale" in kept
    assert kept["mtp.2.confidence_head.proj.weight"].shape == (1, 96 + 16)
    assert all(k.startswith("mtp.") for k in kept)
    # without DSpark the same tensors are an error
    plain = {k: v for k, v in trunk.items() if not k.startswith("dspark_")}
    with pytest.raises(CheckpointError, match=r"no model tensor: mtp\.0\..* in model-0000"):
        load_weights(toy(trunk), ckpt, config=DeepseekV4Config.from_dict(plain))


def test_dspark_full_model(tmp_path, toy, expected):
    config = PRESETS["tiny-dspark"]
    ckpt = write_checkpoint(tmp_path / "d", config, seed=1, tokenizer=False)
    model = toy(config)
    load_weights(model, ckpt, config=read_model_config(ckpt))
    assert not getattr(model, "unmapped_tensors", {})
    want = expected(config, seed=1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_error_quantized_model_unquantised_checkpoint(tmp_path, tiny_config, toy):
    ckpt = write_checkpoint(tmp_path / "bf16", tiny_config, dtype="bfloat16", tokenizer=False)
    msg = _load_error(ckpt, toy(tiny_config, quantized=True), config=DeepseekV4Config.from_dict(tiny_config))
    assert "model keeps layers.0.attn.wq_a.weight quantised" in msg
    assert "layers.0.attn.wq_a.weight in model-0000" in msg


def test_error_fp8_without_block_size(tiny_ckpt, tiny_config, toy):
    plain = {k: v for k, v in tiny_config.items() if k not in ("quantization_config", "expert_dtype")}
    msg = _load_error(tiny_ckpt, toy(tiny_config), config=DeepseekV4Config.from_dict(plain))
    assert "has no quantization_config.weight_block_size" in msg and "layers.0.attn.wq_a.weight" in msg
