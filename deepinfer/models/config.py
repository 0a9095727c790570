"""Typed model configs parsed from a checkpoint's config.json.

Both spellings of a V4 config are accepted: DeepSeek's own keys (`compress_ratios`,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and the keys transformers'
`DeepseekV4Config.save_pretrained` writes (`layer_types` + `compress_rates` or the legacy
`compress_rate_csa` / `compress_rate_hca`, `mlp_layer_types`, `rope_parameters`,
`partial_rotary_factor`); where both spellings are present they must agree. Which math keys are
read or refused, and the RoPE forms: `deepinfer.models.config_keys`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.models.config_keys import (ConfigError, YarnScaling, check_fields, check_fixed, check_rope_dim,
                                         positive, read_rope, read_rope_dim)

SLIDING, CSA, HCA = "sliding", "csa", "hca"
_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_DEFAULT_HF_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class WeightQuant:
    """How the checkpoint stores weights (quantization_config + expert_dtype)."""

    block_size: tuple[int, int] | None = None  # FP8 block [out, in]; None = unquantised
    scale_fmt: str = "ue8m0"  # "ue8m0" (E8M0 bytes) or "float32"
    expert_dtype: str = "fp8"  # "fp4" | "fp8" | "bf16"


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # One entry per trunk layer: 0 = sliding only, else the compressor ratio.
    compress_ratios: tuple[int, ...] = ()
    # One entry per trunk layer: SLIDING / CSA (overlapped compressor + indexer) / HCA.
    layer_kinds: tuple[str, ...] = ()
    num_hash_layers: int = 3
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    quant: WeightQuant = field(default_factory=WeightQuant)
    # -0731 DSpark draft (replaces the MTP head when dspark_block_size is set).
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    model_type: str = "deepseek_v4"

    def __post_init__(self):
        check_fields(self)
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n or len(self.layer_kinds) != n:
            raise ConfigError(f"compress_ratios/layer_types must have num_hidden_layers={n} entries")
        for i, (kind, ratio) in enumerate(zip(self.layer_kinds, self.compress_ratios)):
            if (kind == SLIDING) != (ratio == 0):
                raise ConfigError(f"layer {i}: kind {kind!r} does not match compress ratio {ratio}")
        check_rope_dim(self)
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError("o_groups must divide num_attention_heads * head_dim")

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size is not None

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        n = positive(_req(d, "num_hidden_layers"), "num_hidden_layers", int)
        check_fixed(d)
        ratios, kinds = _layer_schedule(d, n)
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and not isinstance(v, (dict, list))}
        head_dim = positive(d.get("head_dim", cls.head_dim), "head_dim", int)
        rope_dim = read_rope_dim(d, head_dim, cls.qk_rope_head_dim)
        kw.update(
            num_hidden_layers=n,
            compress_ratios=ratios,
            layer_kinds=kinds,
            num_hash_layers=_num_hash_layers(d, n),
            qk_rope_head_dim=rope_dim,
            quant=_weight_quant(d),
            dspark_target_layer_ids=tuple(d.get("dspark_target_layer_ids") or ()),
        )
        kw.update(read_rope(d, rope_dim, head_dim))
        if isinstance(d.get("eos_token_id"), list) and d["eos_token_id"]:  # (a list is left out of kw above)
            kw["eos_token_id"] = d["eos_token_id"][0]
        for key in ("bos_token_id", "eos_token_id"):
            if kw.get(key) is None:
                kw.pop(key, None)
        return cls(**kw)


def _req(d: dict, key: str):
    if key not in d:
        raise ConfigError(f"config.json is missing required key {key!r}")
    return d[key]


def _layer_schedule(d: dict, n: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    rates, rate_keys = _hf_rates(d)
    by_types = _schedule_from_layer_types(d["layer_types"], n, rates) if d.get("layer_types") else None
    by_ratios = _schedule_from_ratios(d["compress_ratios"], n) if d.get("compress_ratios") is not None else None
    if by_types is None and by_ratios is None:
        raise ConfigError("config.json needs 'compress_ratios' (DeepSeek) or 'layer_types' (transformers)")
    if by_types is not None and by_ratios is not None and by_types != by_ratios:
        raise ConfigError("layer_types / compress_rates and compress_ratios describe different layer schedules")
    if by_types is None and rate_keys:
        # transformers reads compress_ratios as layer kinds and takes each kind's ratio from compress_rates.
        hf_name = {CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}
        if any(r != rates[hf_name[k]] for r, k in zip(*by_ratios) if r):
            raise ConfigError(f"{' / '.join(rate_keys)} ({rates}) disagree with compress_ratios {by_ratios[0]}")
    return by_types or by_ratios


def _hf_rates(d: dict) -> tuple[dict[str, int], list[str]]:
    """(ratio per transformers layer type, the keys that set them): compress_rates, then the legacy
    compress_rate_csa / compress_rate_hca, which override it as in transformers."""
    given, keys = dict(d.get("compress_rates") or {}), ["compress_rates"] if d.get("compress_rates") else []
    for name, key in (("compressed_sparse_attention", "compress_rate_csa"),
                      ("heavily_compressed_attention", "compress_rate_hca")):
        if d.get(key) is not None:
            given[name] = d[key]
            keys.append(key)
    for name, rate in given.items():
        if name not in _DEFAULT_HF_RATES:
            raise ConfigError(f"compress_rates.{name} is not a compressed DeepSeek-V4 layer type")
        positive(rate, f"compress_rates.{name}", int)
    return {**_DEFAULT_HF_RATES, **given}, keys


def _schedule_from_layer_types(names: list, n: int, rates: dict[str, int]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    kinds, ratios = [], []
    for i, name in enumerate(names[:n]):
        if name not in _HF_LAYER_TYPES:
            raise ConfigError(f"layer_types[{i}] = {name!r} is not a DeepSeek-V4 layer type")
        kinds.append(_HF_LAYER_TYPES[name])
        ratios.append(0 if name == "sliding_attention" else rates[name])
    if len(kinds) != n:
        raise ConfigError(f"layer_types has {len(kinds)} entries, num_hidden_layers is {n}")
    return tuple(ratios), tuple(kinds)


def _schedule_from_ratios(ratios: list, n: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if len(ratios) < n:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries, num_hidden_layers is {n}")
    # Entries past num_hidden_layers describe the MTP/DSpark stages (sliding only).
    trunk = tuple(int(r) for r in ratios[:n])
    # DeepSeek's reference ties the overlapped compressor + indexer to ratio 4.
    kinds = tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in trunk)
    return trunk, kinds


def _num_hash_layers(d: dict, n: int) -> int:
    mlp = d.get("mlp_layer_types")
    if not mlp:
        return int(d.get("num_hash_layers", 3))
    hashed = [t == "hash_moe" for t in mlp[:n]]
    count = sum(hashed)
    if hashed != [True] * count + [False] * (n - count):
        raise ConfigError("mlp_layer_types: hash_moe layers must come first")
    if d.get("num_hash_layers") is not None and d["num_hash_layers"] != count:
        raise ConfigError(f"mlp_layer_types ({count} hash_moe layers) and num_hash_layers "
                          f"({d['num_hash_layers']}) disagree")
    return count


_QUANT_KEYS = {"quant_method", "fmt", "scale_fmt", "weight_block_size", "activation_scheme", "expert_dtype",
               "modules_to_not_convert"}


def _weight_quant(d: dict) -> WeightQuant:
    """DeepSeek's FP8 e4m3 block format with dynamic activation scales, every tensor it names quantised."""
    qc = d.get("quantization_config")
    expert_dtype = d.get("expert_dtype") or (qc or {}).get("expert_dtype")
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise ConfigError(f"expert_dtype {expert_dtype!r} is not supported (fp4, fp8, bf16)")
    if not qc:
        return WeightQuant(block_size=None, expert_dtype=expert_dtype or "bf16")
    if d.get("expert_dtype") and qc.get("expert_dtype") and d["expert_dtype"] != qc["expert_dtype"]:
        raise ConfigError(f"expert_dtype {d['expert_dtype']!r} and quantization_config.expert_dtype "
                          f"{qc['expert_dtype']!r} disagree")
    for key in qc:
        if key not in _QUANT_KEYS:
            raise ConfigError(f"quantization_config.{key} is not understood")
    method = qc.get("quant_method")
    if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(
            f"quantization_config: quant_method={method!r} fmt={qc.get('fmt')!r} is not supported "
            "(deepinfer reads DeepSeek's fp8 e4m3 block format)"
        )
    if qc.get("modules_to_not_convert"):
        raise ConfigError("quantization_config.modules_to_not_convert is not supported (every FP8 tensor of the "
                          "layout is quantised)")
    check_fixed(qc, "quantization_config.", {"activation_scheme": (None, "dynamic"),
                                             "scale_fmt": (None, "ue8m0", "float32")})
    block = qc.get("weight_block_size") or [128, 128]
    if not isinstance(block, list) or len(block) != 2:
        raise ConfigError(f"quantization_config.weight_block_size must be [out, in], got {block!r}")
    return WeightQuant(
        block_size=tuple(positive(b, "quantization_config.weight_block_size", int) for b in block),
        scale_fmt=qc.get("scale_fmt") or "float32",
        expert_dtype=expert_dtype or "fp8",
    )


def load_config_dict(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    with open(path) as f:
        return json.load(f)
