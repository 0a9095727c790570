"""transformers' DeepseekV4ForCausalLM layouts: module names, and what save_pretrained writes; what
NeMo AutoModel's DeepSeek-V4.1 backbone export writes."""
from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.loader.checkpoint import CheckpointError, CheckpointReader
from deepinfer.loader.model_loader import load_model
from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.names import WeightRef, detect_layout, plan_names, to_deepseek_name, to_hf_name
from deepinfer.loader.weights import load_weights
from deepinfer.tools.make_checkpoint import PRESETS, checkpoint_config, random_weights, weight_specs, write_checkpoint

transformers = pytest.importorskip("transformers")

HF_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "model.layers.3.input_layernorm.weight": "layers.3.attn_norm.weight",
    "model.layers.3.post_attention_layernorm.weight": "layers.3.ffn_norm.weight",
    "model.layers.3.attn_hc.fn": "layers.3.hc_attn_fn",
    "model.layers.3.ffn_hc.scale": "layers.3.hc_ffn_scale",
    "model.layers.3.self_attn.q_a_proj.weight": "layers.3.attn.wq_a.weight",
    "model.layers.3.self_attn.q_a_norm.weight": "layers.3.attn.q_norm.weight",
    "model.layers.3.self_attn.q_b_proj.weight": "layers.3.attn.wq_b.weight",
    "model.layers.3.self_attn.kv_proj.weight": "layers.3.attn.wkv.weight",
    "model.layers.3.self_attn.kv_norm.weight": "layers.3.attn.kv_norm.weight",
    "model.layers.3.self_attn.o_a_proj.weight": "layers.3.attn.wo_a.weight",
    "model.layers.3.self_attn.o_b_proj.weight": "layers.3.attn.wo_b.weight",
    "model.layers.3.self_attn.sinks": "layers.3.attn.attn_sink",
    "model.layers.3.self_attn.compressor.kv_proj.weight": "layers.3.attn.compressor.wkv.weight",
    "model.layers.3.self_attn.compressor.gate_proj.weight": "layers.3.attn.compressor.wgate.weight",
    "model.layers.3.self_attn.compressor.position_bias": "layers.3.attn.compressor.ape",
    "model.layers.3.self_attn.compressor.kv_norm.weight": "layers.3.attn.compressor.norm.weight",
    "model.layers.3.self_attn.compressor.indexer.kv_proj.weight": "layers.3.attn.indexer.compressor.wkv.weight",
    "model.layers.3.self_attn.compressor.indexer.gate_proj.weight": "layers.3.attn.indexer.compressor.wgate.weight",
    "model.layers.3.self_attn.compressor.indexer.position_bias": "layers.3.attn.indexer.compressor.ape",
    "model.layers.3.self_attn.compressor.indexer.kv_norm.weight": "layers.3.attn.indexer.compressor.norm.weight",
    "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight": "layers.3.attn.indexer.wq_b.weight",
    "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight": "layers.3.attn.indexer.weights_proj.weight",
    "model.layers.3.mlp.gate.weight": "layers.3.ffn.gate.weight",
    "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
    "model.layers.0.mlp.gate.tid2eid": "layers.0.ffn.gate.tid2eid",
    "model.layers.3.mlp.shared_experts.gate_proj.weight": "layers.3.ffn.shared_experts.w1.weight",
    "model.layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
    "model.layers.3.mlp.shared_experts.down_proj.weight": "layers.3.ffn.shared_experts.w2.weight",
    # what save_pretrained writes (its reversal of the renames is partial)
    "head.weight": "head.weight",
    "model.layers.3.attn.norm.weight": "layers.3.attn.kv_norm.weight",
    "model.layers.3.attn.wq_a.weight": "layers.3.attn.wq_a.weight",
    "model.layers.3.ffn.experts.7.w2.weight": "layers.3.ffn.experts.7.w2.weight",
    # DeepSeek names are fixed points
    "layers.3.attn.kv_norm.weight": "layers.3.attn.kv_norm.weight",
    "layers.3.attn.compressor.norm.weight": "layers.3.attn.compressor.norm.weight",
    "mtp.0.e_proj.scale": "mtp.0.e_proj.scale",
    "mtp.0.attn_norm.weight": "mtp.0.attn_norm.weight",
}


@pytest.mark.parametrize("hf,ds", HF_NAMES.items())
def test_rename(hf, ds):
    assert to_deepseek_name(hf) == ds


def test_to_hf_roundtrip():
    for hf, ds in HF_NAMES.items():
        if hf.startswith(("model.layers.3.self_attn", "model.layers.3.mlp", "model.hc", "model.embed")):
            assert to_hf_name(ds) == hf


def test_fused_experts_split():
    shapes = {"model.layers.1.mlp.experts.gate_up_proj": (3, 10, 7), "model.layers.1.mlp.experts.down_proj": (3, 7, 5)}
    refs = plan_names(shapes, shapes.__getitem__)
    assert WeightRef("layers.1.ffn.experts.2.w1.weight", "model.layers.1.mlp.experts.gate_up_proj",
                     (2, slice(0, 5))) in refs
    assert WeightRef("layers.1.ffn.experts.0.w3.weight", "model.layers.1.mlp.experts.gate_up_proj",
                     (0, slice(5, 10))) in refs
    assert WeightRef("layers.1.ffn.experts.1.w2.weight", "model.layers.1.mlp.experts.down_proj", (1,)) in refs
    assert len(refs) == 9
    assert detect_layout(shapes) == "hf" and detect_layout(["embed.weight"]) == "deepseek"


def _hf_model(config: dict):
    cfg = transformers.DeepseekV4Config(**checkpoint_config(config, "float32", layout="hf"))
    torch.manual_seed(0)
    return transformers.DeepseekV4ForCausalLM(cfg).eval()


def test_save_pretrained_layout_loads(tmp_path, toy):
    """Every tensor transformers' save_pretrained writes maps onto a DeepSeek name, and
    our loader reproduces the transformers model's weights."""
    config = {**PRESETS["tiny"], "num_nextn_predict_layers": 0}
    hf = _hf_model(config)
    with torch.no_grad():  # non-trivial values for the tensors transformers zero-inits
        for name, t in hf.state_dict().items():
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, 8, t.shape))
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape))
    hf.save_pretrained(tmp_path / "hf")
    reader = CheckpointReader(tmp_path / "hf")
    names = reader.names()
    ours = {s.name for s in weight_specs(config)}
    mapped = {r.name for r in plan_names(names, reader.shape)}
    assert mapped == ours
    # kv_norm is written as attn.norm by transformers' reversed renames
    assert "model.layers.0.attn.norm.weight" in names and "head.weight" in names

    model = toy(config)
    load_weights(model, reader, config=read_model_config(tmp_path / "hf"))
    sd, ref = model.state_dict(), hf.state_dict()
    f = config["moe_intermediate_size"]
    for name, t in ref.items():
        if name.endswith("experts.gate_up_proj"):
            stem = to_deepseek_name(name.replace("experts.gate_up_proj", "gate.weight"))[: -len("gate.weight")]
            assert torch.equal(sd[stem + "experts.w1"], t[:, :f]) and torch.equal(sd[stem + "experts.w3"], t[:, f:])
        elif name.endswith("experts.down_proj"):
            stem = to_deepseek_name(name.replace("experts.down_proj", "gate.weight"))[: -len("gate.weight")]
            assert torch.equal(sd[stem + "experts.w2"], t)
        else:
            assert torch.equal(sd[to_deepseek_name(name)], t.to(sd[to_deepseek_name(name)].dtype)), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_written_hf_layout_loads_in_both(tmp_path, toy, dtype):
    config = PRESETS["tiny"]
    ckpt = write_checkpoint(tmp_path / "c", config, seed=2, dtype=dtype, layout="hf", tokenizer=False)
    cfg_json = json.loads((ckpt / "config.json").read_text())
    assert "layer_types" in cfg_json and "quantization_config" not in cfg_json
    reader = CheckpointReader(ckpt)
    assert detect_layout(reader.names()) == "hf"
    assert "model.layers.1.mlp.experts.gate_up_proj" in reader.names()
    assert any(n.startswith("mtp.0.") for n in reader.names())

    model = toy(config, dtype=torch.float32)
    load_weights(model, reader, config=read_model_config(ckpt))
    sd = model.state_dict()
    store = torch.float32 if dtype == "float32" else torch.bfloat16
    specs = {s.name: s for s in weight_specs(config)}
    rw = dict(random_weights(config, 2))
    assert torch.equal(sd["layers.4.ffn.experts.w3"][6], rw["layers.4.ffn.experts.6.w3.weight"].to(store).float())
    assert torch.equal(sd["mtp.0.ffn.experts.w1"][2], rw["mtp.0.ffn.experts.2.w1.weight"].to(store).float())
    assert torch.equal(sd["layers.1.attn.wq_b.weight"], rw["layers.1.attn.wq_b.weight"].to(store).float())
    assert specs["layers.1.attn.attn_sink"].store == "fp32"
    assert torch.equal(sd["layers.1.attn.attn_sink"], rw["layers.1.attn.attn_sink"])

    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, output_loading_info=True,
                                                                  dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    for name, t in hf.state_dict().items():
        if "experts." in name:
            continue
        ds = to_deepseek_name(name)
        assert torch.equal(sd[ds], t.to(sd[ds].dtype)), name
    f = config["moe_intermediate_size"]
    gu = hf.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(gu[:, :f], sd["layers.2.ffn.experts.w1"]) and torch.equal(gu[:, f:], sd["layers.2.ffn.experts.w3"])


@pytest.fixture(scope="module")
def saved_without_mtp(tmp_path_factory):
    """(a checkpoint in DeepSeek's layout with mtp.0 and transformers' config keys, what transformers'
    save_pretrained writes after loading it, the transformers model). transformers has no MTP module:
    it drops mtp.* on load and writes the trunk only, while config.json keeps num_nextn_predict_layers 1."""
    root = tmp_path_factory.mktemp("no_mtp")
    src = write_checkpoint(root / "src", PRESETS["tiny"], seed=5, dtype="float32", tokenizer=False)
    (src / "config.json").write_text(json.dumps(checkpoint_config(PRESETS["tiny"], "float32", layout="hf")))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf.save_pretrained(root / "saved")
    return src, root / "saved", hf


def _draft_notes(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("deepinfer") and "mtp." in r.getMessage()]


def test_save_pretrained_without_mtp_loads_the_trunk_and_generates(saved_without_mtp, caplog):
    src, saved, hf = saved_without_mtp
    assert not any(".mtp." in n or n.startswith("mtp.") for n in CheckpointReader(saved).names())
    assert json.loads((saved / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM(str(saved), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
                  skip_tokenizer_init=True)
    assert len(_draft_notes(caplog)) == 1, [r.getMessage() for r in caplog.records]
    model = llm.model
    assert model.mtp is None and model.config.num_nextn_predict_layers == 0
    with pytest.raises(RuntimeError, match="no MTP draft layer"):
        model.mtp_logits(torch.zeros(1, 4, 96), torch.zeros(1, dtype=torch.long), None, None)

    # the trunk is exactly the one deepinfer loads from the checkpoint transformers read (with mtp.0)
    full = load_model(str(src), dtype=torch.float32)[0]
    assert full.mtp is not None
    want = {k: v for k, v in full.state_dict().items() if not k.startswith("mtp.")}
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    prompt = [0] + torch.randint(3, 1024, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=1), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 8
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    assert tokens == ref.argmax(-1).tolist()
    ours = torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)])
    assert torch.allclose(ours, ref[torch.arange(8), tokens], atol=1e-4)


def test_save_pretrained_missing_trunk_tensor_is_still_an_error(saved_without_mtp, tmp_path, caplog):
    """Only the draft layer may be absent: a missing trunk tensor names itself, and nothing about mtp.*."""
    _, saved, _ = saved_without_mtp
    broken = shutil.copytree(saved, tmp_path / "broken")
    (shard,) = broken.glob("*.safetensors")
    tensors = load_file(str(shard))
    del tensors["model.layers.2.attn.norm.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="deepinfer"), pytest.raises(CheckpointError) as ei:
        load_model(str(broken), dtype=torch.float32)
    msg = str(ei.value)
    assert "model tensors not found" in msg and "layers.2.attn.kv_norm.weight" in msg
    assert "mtp." not in msg and not _draft_notes(caplog)


def test_nemo_export_without_dspark_loads_the_trunk(tmp_path, caplog):
    """NeMo AutoModel's V4.1 backbone adapter exports the released names without the DSpark stages
    (mtp.0..2) while text_config keeps them: the trunk loads and the draft is left out."""
    pytest.importorskip("nemo_automodel")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from nemo_oracle import nemo_v41_model

    from deepinfer.models.dspark_v41 import draft_block

    src = write_checkpoint(tmp_path / "src", PRESETS["tiny41"], seed=5, dtype="float32")
    nemo, _ = nemo_v41_model(src)
    export = tmp_path / "export"
    export.mkdir()
    save_file({k: v.contiguous() for k, v in nemo.state_dict_adapter.to_hf(nemo.state_dict()).items()},
              str(export / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, export / f.name)
    assert not any(n.startswith("mtp.") for n in CheckpointReader(export).names())
    assert json.loads((export / "config.json").read_text())["text_config"]["num_nextn_predict_layers"] == 3

    with caplog.at_level(logging.INFO, logger="deepinfer"):
        model = load_model(str(export), dtype=torch.float32)[0]
    assert len(_draft_notes(caplog)) == 1
    assert model.mtp is None and not model.config.has_dspark
    with pytest.raises(RuntimeError, match="no DSpark draft stages"):
        draft_block(model, torch.zeros(1, 2, 384), torch.zeros(1, 2, dtype=torch.long),
                    torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                    torch.ones(1, dtype=torch.long))
    full = load_model(str(src), dtype=torch.float32)[0]
    assert full.mtp is not None
    want = {k: v for k, v in full.state_dict().items() if not k.startswith("mtp.")}
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
