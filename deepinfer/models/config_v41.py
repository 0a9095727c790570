"""DeepSeek-V4.1 config (model_type deepseek_v41): nested text_config / vision_config.

Layer roles come from compress_ratios and the id lists (docs/models.md):
  swa     ratio 0: window attention only
  full    a KV source: compressor + index keys + indexer, publishes new compressed state
  reindex an index source only: recomputes the top-k over the latest Full layer's keys
  reuse   attends with the top-k and entries currently published
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from deepinfer.models.config import WeightQuant, _weight_quant
from deepinfer.models.config_keys import (ConfigError, YarnScaling, check_fields, check_fixed, check_rope_dim,
                                         positive, read_rope, read_rope_dim)

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


@dataclass(frozen=True)
class DeepseekV41Config:
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()        # trunk layers only (DSpark entries are dropped)
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int | None = None  # checked against the tokenizer's count at load
    num_nextn_predict_layers: int = 3
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    # what the confidence head reads: "residual" (the released drafts: the collapsed stream before the final
    # norm) or "normalized" (drafts trained with NeMo AutoModel: the final RMSNorm's output)
    dspark_confidence_input: str = "residual"
    image_token_id: int = 129264
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    quant: WeightQuant = field(default_factory=WeightQuant)
    vision: dict = field(default_factory=dict)
    model_type: str = "deepseek_v41"

    def __post_init__(self):
        check_fields(self, "text_config.")
        check_rope_dim(self, "text_config.")
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n:
            raise ConfigError(f"text_config.compress_ratios needs >= num_hidden_layers={n} entries")
        kv, idx = set(self.kv_source_layer_ids), set(self.index_source_layer_ids)
        if not kv <= idx:
            raise ConfigError("text_config.kv_source_layer_ids must be a subset of index_source_layer_ids")
        src_ratio = 0
        for i, r in enumerate(self.compress_ratios):
            if r == 0 and i in idx:
                raise ConfigError(f"text_config: SWA-only layer {i} cannot be a KV/index source")
            if i in kv:
                src_ratio = r
            elif r and r != src_ratio:
                raise ConfigError(f"text_config: compressed layer {i} (ratio {r}) has no preceding KV source "
                                  "with the same ratio")
        if self.candidate_source_layer_id >= 0 and self.candidate_source_layer_id not in kv:
            raise ConfigError("text_config.candidate_source_layer_id must be a KV source")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ConfigError("text_config.engram_num_embeddings needs one entry per engram_layer_ids entry")

    def role(self, layer: int) -> str:
        if self.compress_ratios[layer] == 0:
            return SWA
        if layer in self.kv_source_layer_ids:
            return FULL
        return REINDEX if layer in self.index_source_layer_ids else REUSE

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size is not None and self.num_nextn_predict_layers > 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV41Config":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("a deepseek_v41 config.json needs a nested 'text_config'")
        n = text.get("num_hidden_layers")
        if n is None:
            raise ConfigError("text_config is missing required key 'num_hidden_layers'")
        positive(n, "text_config.num_hidden_layers", int)
        check_fixed(d)
        check_fixed(text, "text_config.")
        ratios = text.get("compress_ratios") or []
        if len(ratios) < n:
            raise ConfigError(f"text_config.compress_ratios has {len(ratios)} entries, num_hidden_layers is {n}")
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in text.items() if k in known and not isinstance(v, (dict, list))}
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                    "engram_num_embeddings", "dspark_target_layer_ids"):
            kw[key] = tuple(text.get(key) or ())
        for key in ("image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            if d.get(key) is not None:
                kw[key] = d[key]
        if isinstance(kw.get("eos_token_id"), list):  # the first of several is the one generation stops on
            kw["eos_token_id"] = kw["eos_token_id"][0]
        merged = {**text, "quantization_config": d.get("quantization_config") or text.get("quantization_config"),
                  "expert_dtype": d.get("expert_dtype") or text.get("expert_dtype")}
        head_dim = positive(text.get("head_dim", cls.head_dim), "text_config.head_dim", int)
        rope_dim = read_rope_dim(text, head_dim, cls.qk_rope_head_dim, "text_config.")
        kw.update(compress_ratios=tuple(int(r) for r in ratios[:n]), qk_rope_head_dim=rope_dim,
                  quant=_weight_quant(merged), vision=dict(d.get("vision_config") or {}),
                  model_type="deepseek_v41")
        kw.update(read_rope(text, rope_dim, head_dim, "text_config."))
        kw.pop("torch_dtype", None)
        if kw.get("dspark_confidence_input", "residual") not in ("residual", "normalized"):
            raise ConfigError(f"text_config.dspark_confidence_input: {kw['dspark_confidence_input']!r} is not "
                              "'residual' or 'normalized'")
        return cls(**kw)
