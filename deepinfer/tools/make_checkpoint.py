"""Write a random DeepSeek-V4 / V4.1 checkpoint in the hub's format (config.json, sharded
safetensors + index, tokenizer) for tests and demos.

    python -m deepinfer.tools.make_checkpoint --arch deepseek_v4 --preset tiny --out DIR
    python -m deepinfer.tools.make_checkpoint --arch deepseek_v41 --preset tiny41 --out DIR

Tensor names, shapes and storage dtypes follow DeepSeek's original layout; shapes are
derived here from the config on their own (never from deepinfer's model code).
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Iterator

import torch

from deepinfer.loader.names import split_expert_name, to_hf_name
from deepinfer.tools.checkpoint_writer import (DTYPES, FP8_QUANT, ShardWriter, WeightSpec, attention_specs,
                                               dspark_head_specs, encode_tensor, expert_specs, open_writer,
                                               random_tensors)
from deepinfer.tools.make_checkpoint_v41 import weight_specs_v41, write_checkpoint_v41
from deepinfer.tools.presets_v41 import PRESETS_V41, is_v41
from deepinfer.tools.tiny_tokenizer import write_tokenizer

LAYOUTS = ("deepseek", "hf")

_TINY = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 40,
    "o_groups": 2,
    "o_lora_rank": 24,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 16, 4, 16, 0, 0],
    "num_hash_layers": 2,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "expert_dtype": "fp4",
    "quantization_config": {**FP8_QUANT, "weight_block_size": [32, 32]},
}

_TINY_DSPARK = {
    **_TINY,
    "compress_ratios": [0, 4, 16, 4, 16, 0, 0, 0, 0],
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 1000,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 16,
}

_DEMO = {
    **_TINY,
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "compress_ratios": [0, 0, 4, 16, 4, 16, 4, 0, 0],
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "sliding_window": 32,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 8,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "max_position_embeddings": 4096,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {**FP8_QUANT, "weight_block_size": [64, 64]},
}

_FLASH = {
    **_TINY,
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
    "num_hash_layers": 3,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {**FP8_QUANT, "weight_block_size": [128, 128]},
}

PRESETS: dict[str, dict] = {"tiny": _TINY, "tiny-dspark": _TINY_DSPARK, "demo": _DEMO, "flash": _FLASH,
                            **PRESETS_V41}
ARCHS = ("deepseek_v4", "deepseek_v41")


def _block_specs(c: dict, p: str, ratio: int, hashed: bool, *, compressor: bool = True) -> list[WeightSpec]:
    d, h, dh = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    ql, g, ol = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    hc = c["hc_mult"]
    e, f = c["n_routed_experts"], c["moe_intermediate_size"]
    fs = f * c.get("n_shared_experts", 1)
    mix = (2 + hc) * hc
    S = WeightSpec
    out = []
    for site in ("attn", "ffn"):
        out += [S(f"{p}hc_{site}_fn", (mix, hc * d), "hc_fn", "fp32"),
                S(f"{p}hc_{site}_base", (mix,), "hc_base", "fp32"),
                S(f"{p}hc_{site}_scale", (3,), "hc_scale", "fp32")]
    out += [
        S(f"{p}attn_norm.weight", (d,), "norm", "bf16"),
        S(f"{p}ffn_norm.weight", (d,), "norm", "bf16"),
    ] + attention_specs(p, d, ql, h, dh, g, ol)
    if ratio and compressor:
        # ratio 4 (CSA) uses overlapping windows: two halves per entry, and an indexer.
        coff = 2 if ratio == 4 else 1
        out += _compressor_specs(f"{p}attn.compressor.", d, dh, ratio, coff)
        if ratio == 4:
            ih, idim = c["index_n_heads"], c["index_head_dim"]
            out += [S(f"{p}attn.indexer.wq_b.weight", (ih * idim, ql), "linear", "fp8"),
                    S(f"{p}attn.indexer.weights_proj.weight", (ih, d), "linear", "bf16")]
            out += _compressor_specs(f"{p}attn.indexer.compressor.", d, idim, ratio, coff)
    out.append(S(f"{p}ffn.gate.weight", (e, d), "linear", "bf16"))
    if hashed:
        out.append(S(f"{p}ffn.gate.tid2eid", (c["vocab_size"], c["num_experts_per_tok"]), "tid2eid", "int32"))
    else:
        out.append(S(f"{p}ffn.gate.bias", (e,), "bias", "fp32"))
    return out + expert_specs(p, e, f, fs, d)


def _compressor_specs(p: str, d: int, dim: int, ratio: int, coff: int) -> list[WeightSpec]:
    S = WeightSpec
    return [S(f"{p}wkv.weight", (coff * dim, d), "linear", "bf16"),
            S(f"{p}wgate.weight", (coff * dim, d), "linear", "bf16"),
            S(f"{p}ape", (ratio, coff * dim), "ape", "fp32"),
            S(f"{p}norm.weight", (dim,), "norm", "bf16")]


def _hc_head_specs(c: dict, p: str) -> list[WeightSpec]:
    d, hc = c["hidden_size"], c["hc_mult"]
    return [WeightSpec(f"{p}hc_head_fn", (hc, hc * d), "hc_fn", "fp32"),
            WeightSpec(f"{p}hc_head_base", (hc,), "hc_base", "fp32"),
            WeightSpec(f"{p}hc_head_scale", (1,), "hc_scale", "fp32")]


def weight_specs(config: dict) -> list[WeightSpec]:
    """Every tensor of the checkpoint, DeepSeek names, logical (unquantised) shapes."""
    if is_v41(config):
        return weight_specs_v41(config)
    c = config
    v, d = c["vocab_size"], c["hidden_size"]
    n = c["num_hidden_layers"]
    ratios = list(c.get("compress_ratios") or [])
    ratios += [0] * (n + c.get("num_nextn_predict_layers", 0) - len(ratios))
    n_hash = c.get("num_hash_layers", 3)
    S = WeightSpec
    out = [S("embed.weight", (v, d), "embed", "bf16")]
    for i in range(n):
        out += _block_specs(c, f"layers.{i}.", ratios[i], i < n_hash)
    out += [S("norm.weight", (d,), "norm", "bf16"), S("head.weight", (v, d), "head", "bf16")]
    out += _hc_head_specs(c, "")
    n_mtp = c.get("num_nextn_predict_layers", 0)
    dspark = c.get("dspark_block_size") is not None
    for k in range(n_mtp):
        p = f"mtp.{k}."
        if dspark:
            out += _block_specs(c, p, ratios[n + k], False, compressor=False)
            # -0731's names, as vLLM 0.34.0 loads them: markov_head.markov_w1/w2, the last stage's hc_head
            out += dspark_head_specs(c, k, n_mtp, ("markov_w1", "markov_w2"))
            out += _hc_head_specs(c, p) if k == n_mtp - 1 else []
        else:
            out += _block_specs(c, p, ratios[n + k], False)
            out += [S(f"{p}e_proj.weight", (d, d), "linear", "fp8"),
                    S(f"{p}h_proj.weight", (d, d), "linear", "fp8"),
                    S(f"{p}enorm.weight", (d,), "norm", "bf16"),
                    S(f"{p}hnorm.weight", (d,), "norm", "bf16"),
                    S(f"{p}norm.weight", (d,), "norm", "bf16")]
            out += _hc_head_specs(c, p)
    return out


def random_weights(config: dict, seed: int = 0, specs: list[WeightSpec] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(DeepSeek name, float32 tensor) for every weight of `config` (or of `specs`): see random_tensors."""
    return random_tensors(config, seed, weight_specs(config) if specs is None else specs)


def checkpoint_config(config: dict, dtype: str = "fp8", layout: str = "deepseek") -> dict:
    """The config.json written next to the weights."""
    out = copy.deepcopy(config)
    if dtype == "fp8":
        qc = out.setdefault("quantization_config", {**FP8_QUANT, "weight_block_size": [128, 128]})
        for k, v in FP8_QUANT.items():
            qc.setdefault(k, v)
        out.setdefault("expert_dtype", "fp4")
        out["torch_dtype"] = "bfloat16"
    else:
        out.pop("quantization_config", None)
        out.pop("expert_dtype", None)
        out["torch_dtype"] = dtype
    n = out["num_hidden_layers"]
    ratios = list(out.get("compress_ratios") or [])
    out["compress_ratios"] = ratios + [0] * (n + out.get("num_nextn_predict_layers", 0) - len(ratios))
    return _to_hf_config(out) if layout == "hf" else out


def _to_hf_config(c: dict) -> dict:
    n = c["num_hidden_layers"]
    ratios = c.pop("compress_ratios")[:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"transformers layout supports one HCA ratio, config has {hca}")
    n_hash = c.pop("num_hash_layers", 3)
    rope = c.pop("qk_rope_head_dim")
    yarn = c.pop("rope_scaling", None)
    prf = rope / c["head_dim"]
    compress = {"rope_type": "default", "rope_theta": c["compress_rope_theta"], "partial_rotary_factor": prf}
    if yarn:
        compress = {"rope_type": "yarn", "factor": float(yarn["factor"]),
                    "original_max_position_embeddings": yarn["original_max_position_embeddings"],
                    "beta_fast": float(yarn.get("beta_fast", 32)), "beta_slow": float(yarn.get("beta_slow", 1)),
                    "attention_factor": 1.0, "rope_theta": c["compress_rope_theta"],
                    "partial_rotary_factor": prf}
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    c.update(
        layer_types=[kinds.get(r, "heavily_compressed_attention") for r in ratios],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
        mlp_layer_types=["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash),
        partial_rotary_factor=prf,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": c["rope_theta"],
                                  "partial_rotary_factor": prf},
                         "compress": compress},
        dtype=c.pop("torch_dtype"),
    )
    return c


def write_checkpoint(out_dir: str | Path, config: dict, *, seed: int = 0, dtype: str = "fp8",
                     max_shard_bytes: int | None = None, layout: str = "deepseek",
                     tokenizer: bool = True, weights: bool = True) -> Path:
    """Write config.json, sharded safetensors + index and a tokenizer; returns out_dir.

    max_shard_bytes defaults to a third of the model, so every checkpoint has >= 2 shards
    (capped at 4 GiB). weights=False writes config.json and the tokenizer only: what
    LLM(..., load_format="dummy") needs, e.g. for a released model at its full size."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    if is_v41(config):
        if layout != "deepseek":
            raise ValueError("DeepSeek-V4.1 checkpoints are written in DeepSeek's layout only")
        return write_checkpoint_v41(out_dir, config, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                    tokenizer=tokenizer, weights=weights)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if layout == "hf" and dtype == "fp8":
        raise ValueError("the transformers layout is written unquantised: use dtype bfloat16 or float32")
    cfg = checkpoint_config(config, dtype, layout)
    specs = weight_specs(config) if weights else []
    out, writer = open_writer(out_dir, specs, dtype, max_shard_bytes)
    fused: dict[str, dict[str, torch.Tensor]] = {}
    n_exp = config["n_routed_experts"]
    by_name = {s.name: s for s in specs}
    for name, t in random_weights(config, seed) if weights else ():
        if layout == "hf":
            split = split_expert_name(name)
            if split is not None and not name.startswith("mtp."):
                _add_fused(writer, fused, split, t, n_exp, dtype)
                continue
            for n, v in encode_tensor(by_name[name], t, cfg, dtype):
                writer.add(to_hf_name(n), v)
        else:
            for n, v in encode_tensor(by_name[name], t, cfg, dtype):
                writer.add(n, v)
    if weights:
        writer.finish()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(out, config["vocab_size"], model_max_length=config.get("max_position_embeddings", 1 << 20))
    return out


def _add_fused(writer: ShardWriter, fused: dict, split: tuple, t: torch.Tensor, n_exp: int, dtype: str) -> None:
    """Collect one layer's experts, then write transformers' fused gate_up_proj / down_proj."""
    stem, e, proj, _ = split
    parts = fused.setdefault(stem, {})
    parts[f"{proj}.{e}"] = t.to(torch.float32 if dtype == "float32" else torch.bfloat16)
    if len(parts) < 3 * n_exp:
        return
    del fused[stem]
    hf = to_hf_name(stem.replace(".ffn.experts", ".ffn.gate.weight"))[: -len("gate.weight")] + "experts"
    writer.add(f"{hf}.gate_up_proj",
               torch.stack([torch.cat([parts[f"w1.{i}"], parts[f"w3.{i}"]]) for i in range(n_exp)]))
    writer.add(f"{hf}.down_proj", torch.stack([parts[f"w2.{i}"] for i in range(n_exp)]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.tools.make_checkpoint", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="deepseek_v4", choices=list(ARCHS))
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="default: tiny (deepseek_v4) / tiny41 (deepseek_v41)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="fp8", choices=DTYPES)
    ap.add_argument("--layout", default="deepseek", choices=LAYOUTS)
    ap.add_argument("--max-shard-mb", type=float, default=None, help="default: a third of the model")
    ap.add_argument("--config-only", action="store_true",
                    help="config.json and tokenizer, no weights (for LLM(..., load_format='dummy'))")
    args = ap.parse_args(argv)
    if args.preset is None:
        args.preset = "tiny41" if args.arch == "deepseek_v41" else "tiny"
    if is_v41(PRESETS[args.preset]) != (args.arch == "deepseek_v41"):
        ap.error(f"preset {args.preset!r} is not a {args.arch} preset")
    max_bytes = int(args.max_shard_mb * 2**20) if args.max_shard_mb else None
    path = write_checkpoint(args.out, PRESETS[args.preset], seed=args.seed, dtype=args.dtype,
                            max_shard_bytes=max_bytes, layout=args.layout, weights=not args.config_only)
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    print(f"wrote {args.preset} ({args.dtype}, {args.layout} layout) to {path}: {len(files)} shards")


if __name__ == "__main__":
    main()
