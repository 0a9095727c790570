"""DeepSeek-V4.1 (`deepseek_v41`) configurations for the random-checkpoint writer.

A preset is the top-level config.json dict (nested `text_config` / `vision_config`). The
writer replaces `engram_compressed_vocab_size` with the count computed from the tokenizer
it writes (`deepinfer.layers.engram_hash.compressed_token_map`)."""
from __future__ import annotations

from deepinfer.layers.engram_hash import EngramHashParams


_FP8_QUANT_V41 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                  "weight_block_size": [32, 32]}

# The released DeepSeek-V4.1-Flash text configuration (docs/models.md), every key.
_FLASH41_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "moe_intermediate_size": 2304,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "compress_rope_theta": 160000.0,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "dtype": "bfloat16",
    "pad_token_id": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

_FLASH41_VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
    "patch_size": 14, "rope_theta": 10000.0, "downsample_ratio": 3, "max_image_tokens": 1024,
    "min_pixels": 295936, "max_wh_ratio": None,
}


def _top(text: dict, vision: dict, image_token_id: int) -> dict:
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": image_token_id,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": dict(_FP8_QUANT_V41),
    }


# v41-oracle.md's minimal tiny config (every layer kind) with 16 index heads (no top-k ties):
# L0,L1 SWA (Engram at 1); L2 ratio-2 Full; L3 Reuse; L4 ratio-1 Full + candidate source + Engram;
# L5 Reuse; L6 Reindex; L7 Reuse; then 3 SWA-only DSpark stages.
_TINY41_TEXT = {
    **_FLASH41_TEXT,
    "vocab_size": 1024, "hidden_size": 128, "moe_intermediate_size": 64,
    "num_hidden_layers": 8, "num_attention_heads": 4, "head_dim": 64,
    "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 64},
    "max_position_embeddings": 1024,
    "n_routed_experts": 8, "num_experts_per_tok": 2,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 6],
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 6,
    "candidate_source_layer_id": 4, "candidate_topk_blocks": 3, "candidate_block_size": 4,
    "engram_layer_ids": [1, 4], "engram_num_embeddings": [4100, 4200],
    "engram_max_ngram_size": 3, "engram_vocab_size": 1000, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_compressed_vocab_size": None,
    "dspark_noise_token_id": 1023, "dspark_target_layer_ids": [5, 6, 7], "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
}

# A larger random model for demos: layers 2-4 ratio 2 (Full at 2, Reuse 3-4), 5-9 ratio 1
# (Full + candidate source at 5, Reindex at 7), Engram at 1 and 5.
_DEMO41_TEXT = {
    **_FLASH41_TEXT,
    "vocab_size": 4096, "hidden_size": 256, "moe_intermediate_size": 128,
    "num_hidden_layers": 10, "num_attention_heads": 4, "head_dim": 128,
    "qk_rope_head_dim": 32, "q_lora_rank": 128, "o_lora_rank": 64, "o_groups": 2,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 256},
    "max_position_embeddings": 4096,
    "n_routed_experts": 16, "num_experts_per_tok": 4,
    "sliding_window": 32,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 5], "index_source_layer_ids": [2, 5, 7],
    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 8,
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "engram_layer_ids": [1, 5], "engram_num_embeddings": [32200, 32700],
    "engram_max_ngram_size": 3, "engram_vocab_size": 4000, "engram_n_heads": 4, "engram_head_dim": 64,
    "engram_compressed_vocab_size": None,
    "dspark_noise_token_id": 4095, "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 8, "dspark_num_experts_per_tok": 2,
}

# A tiny vision tower for tiny41v: 2 blocks of width 64 (4 heads of 16), MLP 96; a 64-token
# image budget and min_pixels 10000 (a 50x30 image becomes 140x84 px = 10x6 patches = 4x2 tokens).
_TINY41_VISION = {
    **_FLASH41_VISION,
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
    "max_image_tokens": 64, "min_pixels": 10000,
}

PRESETS_V41: dict[str, dict] = {
    "tiny41": _top(_TINY41_TEXT, {"num_hidden_layers": 0}, 1022),
    "tiny41v": _top(_TINY41_TEXT, _TINY41_VISION, 1022),
    "demo41": _top(_DEMO41_TEXT, {"num_hidden_layers": 0}, 4094),
    "flash41": _top(_FLASH41_TEXT, _FLASH41_VISION, 129264),
}


def is_v41(config: dict) -> bool:
    return config.get("model_type") == "deepseek_v41" or "text_config" in config


# The V4.1 Flash slice of the benchmark sweep (benchmarks/flash_slice.py): one layer of every CSA2
# role, in this order: SWA; SWA + Engram; Full ratio-2 KV source; Reuse; Reindex; Full ratio-1
# candidate source; Reindex and Reuse under the candidates. No draft stages, no vision tower.
SLICE41_LAYERS = {
    "num_hidden_layers": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 4, 5, 6],
    "candidate_source_layer_id": 5,
    "engram_layer_ids": [1],
    "num_nextn_predict_layers": 0,
    "dspark_target_layer_ids": [],
}
# The slice's Engram table: released V4.1-Flash hashing (n-grams 2-4, 8 heads each, 256-wide FP8
# rows, 99092 compressed ids) with hash primes from 1e6 instead of 16e6, so the table has ~24 M
# rows (6.2 GB) instead of 384 M (98 GB): the same rows read per token, a smaller table.
SLICE41_ENGRAM_VOCAB = 1_000_000


def slice41_preset(base: str = "flash41", engram_vocab_size: int | None = SLICE41_ENGRAM_VOCAB) -> dict:
    """The slice's top-level config.json dict at the widths of PRESETS_V41[base] (every key other than
    SLICE41_LAYERS and the Engram table size is the base's). `engram_vocab_size` None keeps the base's
    hash primes; the table gets exactly the rows its hash heads address. A base without an
    engram_compressed_vocab_size (the tokenizer's count, filled in by the checkpoint writer) gets
    3/4 of its vocabulary."""
    top = PRESETS_V41[base]
    text = {**top["text_config"], **SLICE41_LAYERS}
    if engram_vocab_size is not None:
        text["engram_vocab_size"] = engram_vocab_size
    if text.get("engram_compressed_vocab_size") is None:
        text["engram_compressed_vocab_size"] = text["vocab_size"] * 3 // 4
    rows = EngramHashParams.build(text["engram_layer_ids"], [1 << 62] * len(text["engram_layer_ids"]),
                                  text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_vocab_size"],
                                  text["engram_compressed_vocab_size"]).rows_needed
    text["engram_num_embeddings"] = list(rows)
    return _top(text, {"num_hidden_layers": 0}, top["image_token_id"])
