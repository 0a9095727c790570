"""The DeepSeek-V4.1 random-checkpoint writer, checked against NeMo AutoModel's loader."""
from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from deepinfer.layers.engram_hash import compressed_token_map
from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks
from deepinfer.loader.checkpoint import CheckpointReader
from deepinfer.tools.make_checkpoint import PRESETS, main, random_weights, weight_specs, write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

# every text_config key of the released configuration (docs/models.md)
TEXT_KEYS = """vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads
num_key_value_heads head_dim qk_rope_head_dim q_lora_rank o_lora_rank o_groups hidden_act swiglu_limit
rms_norm_eps attention_bias attention_dropout initializer_range use_cache max_position_embeddings rope_theta
rope_scaling compress_rope_theta n_routed_experts n_shared_experts num_experts_per_tok scoring_func
topk_method norm_topk_prob routed_scaling_factor sliding_window compress_ratios kv_source_layer_ids
index_source_layer_ids index_n_heads index_head_dim index_topk candidate_source_layer_id
candidate_topk_blocks candidate_block_size hc_mult hc_sinkhorn_iters hc_eps engram_layer_ids
engram_num_embeddings engram_max_ngram_size engram_vocab_size engram_n_heads engram_head_dim
engram_pad_token_id engram_compressed_vocab_size num_nextn_predict_layers dspark_block_size
dspark_noise_token_id dspark_target_layer_ids dspark_markov_rank dspark_n_routed_experts
dspark_num_experts_per_tok dtype pad_token_id bos_token_id eos_token_id""".split()


@pytest.fixture(scope="module")
def tiny41(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v41") / "tiny41", PRESETS["tiny41"], seed=0)


@pytest.fixture(scope="module")
def nemo(tiny41):
    pytest.importorskip("nemo_automodel")
    from nemo_oracle import nemo_v41_model
    return nemo_v41_model(tiny41)


def test_config_json(tiny41):
    cfg = json.loads((tiny41 / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"] and cfg["model_type"] == "deepseek_v41"
    t = cfg["text_config"]
    assert t["model_type"] == "deepseek_v41_text"
    assert not set(TEXT_KEYS) - set(t)
    assert cfg["vision_config"] == {"num_hidden_layers": 0}
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}
    assert cfg["expert_dtype"] == "fp4"
    assert t["index_n_heads"] == 16 and t["vocab_size"] == 1024
    assert t["compress_ratios"] == [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0]
    assert t["dspark_noise_token_id"] < 1024 and cfg["image_token_id"] < 1024
    tok = Tokenizer.from_file(str(tiny41 / "tokenizer.json"))
    assert t["engram_compressed_vocab_size"] == compressed_token_map(tok)[1]
    assert 0 < t["engram_compressed_vocab_size"] < 1024


def test_tensor_census(tiny41):
    r = CheckpointReader(tiny41)
    names = set(r.names())
    specs = weight_specs(json.loads((tiny41 / "config.json").read_text()))
    logical = {s.name for s in specs}
    scales = {n for n in names if n.endswith(".scale")}
    assert names - scales == logical
    assert all(n[: -len(".scale")] + ".weight" in names for n in scales)
    dtypes = Counter(str(r.dtype(n)).replace("torch.", "") for n in names)
    # 8 layers x 8 experts + 3 draft stages x 4 experts, 3 projections each
    n_expert = 3 * (8 * 8 + 3 * 4)
    assert dtypes["int8"] == n_expert
    assert dtypes["float8_e8m0fnu"] == len(scales) == dtypes["int8"] + dtypes["float8_e4m3fn"]
    assert dtypes["float32"] > 0 and dtypes["bfloat16"] > 0
    assert sum(dtypes.values()) == len(names)
    f8, e8m0, f32, bf16 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float32, torch.bfloat16
    want = {
        "embed.weight": (bf16, (1024, 128)), "head.weight": (f32, (1024, 128)), "norm.weight": (bf16, (128,)),
        "layers.2.attn.wq_a.weight": (f8, (64, 128)), "layers.2.attn.wq_a.scale": (e8m0, (2, 4)),
        "layers.2.attn.wq_b.weight": (f8, (256, 64)), "layers.2.attn.wo_a.weight": (f8, (64, 128)),
        "layers.2.attn.wo_b.weight": (f8, (128, 64)), "layers.2.attn.attn_sink": (f32, (4,)),
        "layers.2.attn.compressor.wkv.weight": (f32, (64, 128)),
        "layers.2.attn.compressor.wgate.weight": (f32, (64, 128)),
        "layers.2.attn.compressor.norm.weight": (bf16, (64,)),
        "layers.2.attn.indexer.wq_b.weight": (f8, (512, 64)), "layers.2.attn.indexer.wq_b.scale": (e8m0, (16, 2)),
        "layers.2.attn.indexer.weights_proj.weight": (bf16, (16, 128)),
        "layers.2.attn.indexer.wk.weight": (bf16, (32, 64)), "layers.2.attn.indexer.k_norm.weight": (bf16, (32,)),
        "layers.2.hc_attn_fn": (f32, (24, 512)), "layers.2.hc_ffn_base": (f32, (24,)),
        "layers.2.hc_ffn_scale": (f32, (3,)),
        "layers.2.ffn.gate.weight": (bf16, (8, 128)), "layers.2.ffn.gate.bias": (f32, (8,)),
        "layers.2.ffn.gate.bias_vl": (f32, (8,)),
        "layers.2.ffn.experts.5.w1.weight": (torch.int8, (64, 64)), "layers.2.ffn.experts.5.w1.scale": (e8m0, (64, 4)),
        "layers.2.ffn.experts.5.w2.weight": (torch.int8, (128, 32)), "layers.2.ffn.experts.5.w2.scale": (e8m0, (128, 2)),
        "layers.2.ffn.shared_experts.w2.weight": (f8, (128, 64)),
        "layers.4.engram.embed.weight": (f8, (4200, 32)), "layers.4.engram.embed.scale": (e8m0, (4200, 1)),
        "layers.1.engram.embed.weight": (f8, (4100, 32)),
        "layers.4.engram.wkv.weight": (f8, (640, 128)), "layers.4.engram.wkv.scale": (e8m0, (20, 4)),
        "layers.4.engram.q_weight": (bf16, (4, 128)), "layers.4.engram.k_weight": (bf16, (4, 128)),
        "mtp.0.main_proj.weight": (f8, (128, 384)), "mtp.0.main_proj.scale": (e8m0, (4, 12)),
        "mtp.0.main_norm.weight": (bf16, (128,)), "mtp.1.ffn.gate.bias_vl": (f32, (4,)),
        "mtp.1.ffn.experts.3.w3.weight": (torch.int8, (64, 64)),
        "mtp.2.norm.weight": (bf16, (128,)), "mtp.2.markov_head.embed.weight": (bf16, (1024, 16)),
        "mtp.2.markov_head.head.weight": (bf16, (1024, 16)),
        "mtp.2.confidence_head.proj.weight": (f32, (1, 144)),
    }
    for n, (dt, shape) in want.items():
        assert (r.dtype(n), tuple(r.shape(n))) == (dt, shape), n
    # layout: compressor / indexer keys only on sources, Engram only on its layers, no vision
    assert "layers.4.attn.compressor.wgate.weight" not in names          # ratio 1: no gate
    assert "layers.6.attn.indexer.wq_b.weight" in names and "layers.6.attn.indexer.wk.weight" not in names
    assert not any(n.startswith(("layers.3.attn.indexer", "layers.3.attn.compressor", "layers.0.attn.comp"))
                   for n in names)
    assert not any(".engram." in n for n in names if not n.startswith(("layers.1.", "layers.4.")))
    assert not any(n.startswith("mtp.") and (".compressor." in n or ".indexer." in n or ".engram." in n)
                   for n in names)
    assert "mtp.1.main_proj.weight" not in names and "mtp.1.norm.weight" not in names
    assert not any(n.startswith(("layers.8.", "vision.", "aligner.", "image_")) for n in names)


def test_random_values():
    w = dict(random_weights(PRESETS["tiny41"], 3))
    s = w["layers.0.hc_attn_scale"]
    assert bool(((s >= 0.5) & (s <= 1.5)).all())
    assert abs(float(w["layers.1.engram.embed.weight"].std()) - 1) < 0.05
    assert abs(float(w["layers.2.attn.compressor.wkv.weight"].std()) - 128 ** -0.5) < 0.01
    assert abs(float(w["layers.2.ffn.gate.bias_vl"].abs().mean())) < 0.3
    again = dict(random_weights(PRESETS["tiny41"], 3))
    assert all(torch.equal(w[k], again[k]) for k in w)


def test_nemo_loads_strict_and_dequantises_like_us(tiny41, nemo):
    model, _ = nemo
    r = CheckpointReader(tiny41)
    p = dict(model.named_parameters())
    emb = dequant_fp8_blocks(r.get("layers.1.engram.embed.weight"), r.get("layers.1.engram.embed.scale"), (1, 32))
    assert torch.equal(p["model.layers.1.engram.embed.weight"][:4100], emb)
    wq = dequant_fp8_blocks(r.get("layers.2.attn.wq_a.weight"), r.get("layers.2.attn.wq_a.scale"), (32, 32))
    assert torch.equal(p["model.layers.2.attn.wq_a.weight"], wq)
    w1 = dequant_fp4(r.get("layers.2.ffn.experts.5.w1.weight"), r.get("layers.2.ffn.experts.5.w1.scale"))
    # NeMo stacks experts as gate_and_up_projs [E, D, 2F] (w1 rows then w3, transposed)
    assert torch.equal(p["model.layers.2.ffn.experts.gate_and_up_projs"][5, :, :64], w1.t())
    assert torch.equal(p["lm_head.weight"], r.get("head.weight"))


def test_nemo_logits_finite_and_prefix_consistent(nemo):
    from nemo_oracle import nemo_v41_logits
    model, _ = nemo
    ids = torch.randint(3, 1024, (2, 48), generator=torch.Generator().manual_seed(0))
    for exact in (True, False):
        full = nemo_v41_logits(model, ids, exact=exact)
        assert full.shape == (2, 48, 1024) and bool(full.isfinite().all())
        assert float(full.std()) > 0.1
        # causal: a prefix's logits are the full run's. Only without the cache round trips: with them a
        # value that lands within float noise of an FP8 rounding tie may round either way across shapes
        for n in (5, 20, 33) if exact else ():
            part = nemo_v41_logits(model, ids[:, :n], exact=exact)
            assert (part - full[:, :n]).abs().max() < 1e-4, (exact, n)
    # the cache round trips change the logits, and exact=True turns them off
    assert (nemo_v41_logits(model, ids) - nemo_v41_logits(model, ids, exact=True)).abs().max() > 1e-3


def test_nemo_dspark_draft_loads(tiny41, nemo):
    from nemo_oracle import nemo_dspark_block, nemo_dspark_features, nemo_dspark_model
    model, _ = nemo
    draft = nemo_dspark_model(tiny41, model)
    ids = torch.randint(3, 1024, (2, 30), generator=torch.Generator().manual_seed(1))
    feats = nemo_dspark_features(model, ids)
    assert feats.shape == (2, 30, 3 * 128)
    blk = nemo_dspark_block(draft, feats, ids, anchor=20)
    assert blk.tokens.shape == (2, 5) and bool(blk.logits.isfinite().all())
    assert bool(((blk.confidence_raw > 0) & (blk.confidence_raw < 1)).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unquantised(tmp_path, dtype):
    out = write_checkpoint(tmp_path / dtype, PRESETS["tiny41"], dtype=dtype, tokenizer=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg
    assert cfg["dtype"] == cfg["text_config"]["dtype"] == dtype
    r = CheckpointReader(out)
    assert not any(n.endswith(".scale") for n in r.names())
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert r.dtype("layers.1.engram.embed.weight") == want and r.dtype("layers.2.ffn.experts.0.w1.weight") == want
    assert r.dtype("layers.2.attn.compressor.wkv.weight") == torch.float32


def test_cli(tmp_path, capsys):
    main(["--arch", "deepseek_v41", "--out", str(tmp_path / "c"), "--seed", "2", "--max-shard-mb", "0.5"])
    assert "wrote tiny41" in capsys.readouterr().out
    assert len(list((tmp_path / "c").glob("model-*.safetensors"))) >= 4
    with pytest.raises(SystemExit):
        main(["--arch", "deepseek_v41", "--preset", "tiny", "--out", str(tmp_path / "d")])


def test_demo41_writes_fast(tmp_path):
    t0 = time.perf_counter()
    out = write_checkpoint(tmp_path / "demo41", PRESETS["demo41"])
    assert time.perf_counter() - t0 < 20
    cfg = json.loads((out / "config.json").read_text())
    t = cfg["text_config"]
    assert t["vocab_size"] == 4096 and t["num_hidden_layers"] == 10 and t["hidden_size"] == 256
    assert len(CheckpointReader(out).files()) >= 2
    pytest.importorskip("nemo_automodel")
    from nemo_oracle import nemo_v41_config
    assert nemo_v41_config(out).text_config.engram_compressed_vocab_size == t["engram_compressed_vocab_size"]


def test_flash41_shapes_and_parameter_count():
    specs = weight_specs(PRESETS["flash41"])
    shapes = {s.name: s.shape for s in specs}
    assert shapes["layers.0.attn.wo_a.weight"] == (8192, 4096) and shapes["layers.0.attn.wq_b.weight"] == (32768, 1280)
    assert shapes["layers.0.hc_attn_fn"] == (24, 20480)
    assert shapes["layers.2.attn.compressor.wgate.weight"] == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in shapes and "layers.8.attn.indexer.wk.weight" in shapes
    assert shapes["layers.24.attn.indexer.wq_b.weight"] == (4096, 1280)
    assert shapes["layers.24.attn.indexer.weights_proj.weight"] == (32, 5120)
    assert "layers.24.attn.indexer.wk.weight" not in shapes and "layers.3.attn.indexer.wq_b.weight" not in shapes
    assert shapes["layers.14.engram.embed.weight"] == (384016682, 256)
    assert shapes["layers.14.engram.wkv.weight"] == (25600, 6144)
    assert shapes["layers.39.ffn.experts.383.w1.weight"] == (2304, 5120)
    assert shapes["mtp.0.main_proj.weight"] == (5120, 15360) and shapes["mtp.2.confidence_head.proj.weight"] == (1, 5376)
    assert shapes["mtp.1.ffn.gate.weight"] == (128, 5120) and "mtp.1.ffn.experts.128.w1.weight" not in shapes
    is_vision = lambda n: n.startswith(("vision.", "aligner.", "image_"))  # noqa: E731
    trunk = sum(math.prod(s.shape) for s in specs if not s.name.startswith("mtp.") and not is_vision(s.name))
    engram = sum(math.prod(s.shape) for s in specs if ".engram.embed." in s.name)
    mtp = sum(math.prod(s.shape) for s in specs if s.name.startswith("mtp."))
    vision = sum(math.prod(s.shape) for s in specs if is_vision(s.name))
    assert round(engram / 1e9, 1) == 196.6
    assert round((trunk - engram) / 1e9, 1) == 551.9 and round(mtp / 1e9, 2) == 14.23
    # 32-block ViT (0.41 B) + aligner + 3 delimiters, docs/models.md
    assert round(vision / 1e9, 3) == 0.485 and shapes["aligner.w1.weight"] == (5120, 9216)
    assert shapes["vision.blocks.31.mlp.w1.weight"] == (5632, 1024) and shapes["image_newline"] == (5120,)
    # the same count on the meta device, one tensor per spec
    meta = sum(torch.empty(s.shape, device="meta").numel() for s in specs)
    assert meta == trunk + mtp + vision


def test_v41_writer_does_not_import_the_v4_writer():
    """make_checkpoint dispatches to make_checkpoint_v41, never the other way round (both build on
    checkpoint_writer)."""
    import subprocess

    code = ("import sys, deepinfer.tools.make_checkpoint_v41; "
            "assert 'deepinfer.tools.make_checkpoint' not in sys.modules, "
            "'make_checkpoint_v41 imports make_checkpoint'")
    subprocess.run([sys.executable, "-c", code], check=True)
