"""Random DeepSeek-V4.1 checkpoints in the released layout (docs/models.md).

Reached through `deepinfer.tools.make_checkpoint` (`--arch deepseek_v41`, or
`write_checkpoint` / `weight_specs` with a V4.1 config). Shapes are derived here from the
config alone. Storage: FP8 e4m3 + E8M0 scales over 32x32 blocks for the dense projections,
FP4 routed experts (+ per-row x 32-column scales), FP8 Engram tables with per-row x 32-column
scales, fp32 for mHC, sinks, compressor, router biases, head and confidence head, bf16 else.
With a vision_config of >= 1 layer it also writes `vision.*`, `aligner.*` and `image_start` /
`image_end` / `image_newline` (plain bf16, RMSNorm weights fp32; docs/models.md).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from deepinfer.layers.engram_hash import compressed_token_map
from deepinfer.tools.checkpoint_writer import (DTYPES, FP8_QUANT, WeightSpec, attention_specs, dspark_head_specs,
                                               encode_tensor, expert_specs, open_writer, random_tensors)
from deepinfer.tools.tiny_tokenizer import build_tokenizer, write_tokenizer

S = WeightSpec


def _ratios(t: dict) -> list[int]:
    n = t["num_hidden_layers"] + t.get("num_nextn_predict_layers", 0)
    r = list(t.get("compress_ratios") or [])
    return r + [0] * (n - len(r))


def _block_specs_v41(t: dict, p: str, layer: int | None, n_experts: int) -> list[WeightSpec]:
    """One block. `layer` None = a DSpark stage (no compressor / indexer / Engram)."""
    d, h, dh = t["hidden_size"], t["num_attention_heads"], t["head_dim"]
    ql, g, ol = t["q_lora_rank"], t["o_groups"], t["o_lora_rank"]
    hc, f = t["hc_mult"], t["moe_intermediate_size"]
    mix = (2 + hc) * hc
    out: list[WeightSpec] = [S(f"{p}attn_norm.weight", (d,), "norm", "bf16"),
                             S(f"{p}ffn_norm.weight", (d,), "norm", "bf16")]
    for site in ("attn", "ffn"):
        out += [S(f"{p}hc_{site}_fn", (mix, hc * d), "hc_fn", "fp32"),
                S(f"{p}hc_{site}_base", (mix,), "hc_base", "fp32"),
                S(f"{p}hc_{site}_scale", (3,), "hc_scale", "fp32")]
    if layer is not None and layer in t.get("engram_layer_ids", []):
        e = t["engram_layer_ids"].index(layer)
        heads = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
        ed = t["engram_head_dim"]
        out += [S(f"{p}engram.embed.weight", (t["engram_num_embeddings"][e], ed), "embed", "fp8_rows"),
                S(f"{p}engram.wkv.weight", ((hc + 1) * d, heads * ed), "linear", "fp8"),
                S(f"{p}engram.q_weight", (hc, d), "norm", "bf16"),
                S(f"{p}engram.k_weight", (hc, d), "norm", "bf16")]
    out += attention_specs(p, d, ql, h, dh, g, ol)
    if layer is not None:
        ratio = _ratios(t)[layer]
        ih, idim = t["index_n_heads"], t["index_head_dim"]
        if ratio and layer in t.get("kv_source_layer_ids", []):
            out += [S(f"{p}attn.compressor.wkv.weight", (dh, d), "linear", "fp32")]
            if ratio > 1:
                out += [S(f"{p}attn.compressor.wgate.weight", (dh, d), "linear", "fp32")]
            out += [S(f"{p}attn.compressor.norm.weight", (dh,), "norm", "bf16"),
                    S(f"{p}attn.indexer.wk.weight", (idim, dh), "linear", "bf16"),
                    S(f"{p}attn.indexer.k_norm.weight", (idim,), "norm", "bf16")]
        if ratio and layer in t.get("index_source_layer_ids", []):
            out += [S(f"{p}attn.indexer.wq_b.weight", (ih * idim, ql), "linear", "fp8"),
                    S(f"{p}attn.indexer.weights_proj.weight", (ih, d), "linear", "bf16")]
    out += [S(f"{p}ffn.gate.weight", (n_experts, d), "linear", "bf16"),
            S(f"{p}ffn.gate.bias", (n_experts,), "bias", "fp32"),
            S(f"{p}ffn.gate.bias_vl", (n_experts,), "bias", "fp32")]
    return out + expert_specs(p, n_experts, f, f, d)


def _vision_specs_v41(config: dict) -> list[WeightSpec]:
    """The vision tower, aligner and image delimiters (docs/models.md), when vision_config has layers.
    Released storage: plain bf16 (never FP8), fp32 RMSNorm weights."""
    vc = config.get("vision_config") or {}
    n = int(vc.get("num_hidden_layers", 0) or 0)
    if n <= 0:
        return []
    d = config["text_config"]["hidden_size"]
    w, inter, p = vc["hidden_size"], vc["intermediate_size"], vc.get("patch_size", 14)
    r = vc.get("downsample_ratio", 3)
    out = [S("vision.patch_embed.proj.weight", (w, 3 * p * p), "linear", "bf16"),
           S("vision.patch_embed.proj.bias", (w,), "bias", "bf16")]
    for i in range(n):
        b = f"vision.blocks.{i}."
        out += [S(f"{b}norm1.weight", (w,), "norm", "fp32"),
                S(f"{b}attn.wqkv.weight", (3 * w, w), "linear", "bf16"),
                S(f"{b}attn.wqkv.bias", (3 * w,), "bias", "bf16"),
                S(f"{b}attn.wo.weight", (w, w), "linear", "bf16"),
                S(f"{b}attn.wo.bias", (w,), "bias", "bf16"),
                S(f"{b}norm2.weight", (w,), "norm", "fp32"),
                S(f"{b}mlp.w1.weight", (2 * inter, w), "linear", "bf16"),
                S(f"{b}mlp.w2.weight", (w, inter), "linear", "bf16")]
    out += [S("vision.norm.weight", (w,), "norm", "fp32"),
            S("aligner.w1.weight", (d, w * r * r), "linear", "bf16"),
            S("aligner.w1.bias", (d,), "bias", "bf16"),
            S("aligner.w2.weight", (d, d), "linear", "bf16"),
            S("aligner.w2.bias", (d,), "bias", "bf16"),
            S("image_start", (d,), "embed", "bf16"),
            S("image_end", (d,), "embed", "bf16"),
            S("image_newline", (d,), "embed", "bf16")]
    return out


def weight_specs_v41(config: dict) -> list[WeightSpec]:
    """Every tensor of a V4.1 checkpoint (DeepSeek names, logical shapes); config is the
    top-level dict with a nested text_config."""
    t = config["text_config"]
    v, d, n = t["vocab_size"], t["hidden_size"], t["num_hidden_layers"]
    out = [S("embed.weight", (v, d), "embed", "bf16")]
    for i in range(n):
        out += _block_specs_v41(t, f"layers.{i}.", i, t["n_routed_experts"])
    out += [S("norm.weight", (d,), "norm", "bf16"), S("head.weight", (v, d), "head", "fp32")]
    out += _vision_specs_v41(config)
    n_mtp = t.get("num_nextn_predict_layers", 0)
    for k in range(n_mtp):
        p = f"mtp.{k}."
        out += _block_specs_v41(t, p, None, t.get("dspark_n_routed_experts", t["n_routed_experts"]))
        out += dspark_head_specs(t, k, n_mtp)
    return out


def checkpoint_config_v41(config: dict, dtype: str = "fp8", compressed_vocab: int | None = None) -> dict:
    """The config.json of a V4.1 checkpoint (nested text_config; quantization_config and
    expert_dtype "fp4" only for dtype fp8)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    out = copy.deepcopy(config)
    t = out["text_config"]
    t.setdefault("model_type", "deepseek_v41_text")
    t["compress_ratios"] = _ratios(t)
    if compressed_vocab is not None:
        t["engram_compressed_vocab_size"] = int(compressed_vocab)
    v = t["vocab_size"]
    for key, value in (("dspark_noise_token_id", t.get("dspark_noise_token_id")),
                       ("image_token_id", out.get("image_token_id"))):
        if value is not None and not 0 <= value < v:
            raise ValueError(f"{key}={value} is outside the vocabulary ({v})")
    if dtype == "fp8":
        qc = out.setdefault("quantization_config", {})
        for k, val in {**FP8_QUANT, "weight_block_size": [32, 32]}.items():
            qc.setdefault(k, val)
        out["expert_dtype"] = "fp4"
        out["dtype"] = t["dtype"] = "bfloat16"
    else:
        out.pop("quantization_config", None)
        out.pop("expert_dtype", None)
        out["dtype"] = t["dtype"] = dtype
    return out


def write_checkpoint_v41(out_dir: str | Path, config: dict, *, seed: int = 0, dtype: str = "fp8",
                         max_shard_bytes: int | None = None, tokenizer: bool = True, weights: bool = True) -> Path:
    """config.json, sharded safetensors + index and (tokenizer=True) tokenizer files.
    engram_compressed_vocab_size is computed from the writer's tokenizer either way."""
    t = config["text_config"]
    tok = build_tokenizer(t["vocab_size"])
    _, n_comp = compressed_token_map(tok)
    cfg = checkpoint_config_v41(config, dtype, n_comp)
    specs = weight_specs_v41(config) if weights else []
    by_name = {s.name: s for s in specs}
    out, writer = open_writer(out_dir, specs, dtype, max_shard_bytes)
    for name, w in random_tensors(config, seed, specs):
        for n, value in encode_tensor(by_name[name], w, cfg, dtype):
            writer.add(n, value)
    if weights:
        writer.finish()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(out, t["vocab_size"], model_max_length=t.get("max_position_embeddings", 1 << 20),
                        tokenizer=tok)
    return out
