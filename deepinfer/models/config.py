"""Typed model configs parsed from a checkpoint's config.json.

Both spellings of a V4 config are accepted: DeepSeek's own keys (`compress_ratios`,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and the keys transformers'
`DeepseekV4Config.save_pretrained` writes (`layer_types` + `compress_rates`,
`mlp_layer_types`, `rope_parameters`, `partial_rotary_factor`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING, CSA, HCA = "sliding", "csa", "hca"
_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_DEFAULT_HF_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class ConfigError(ValueError):
    """A config.json that deepinfer cannot run; the message names the key."""


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


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
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n or len(self.layer_kinds) != n:
            raise ConfigError(f"compress_ratios/layer_types must have num_hidden_layers={n} entries")
        for i, (kind, ratio) in enumerate(zip(self.layer_kinds, self.compress_ratios)):
            if (kind == SLIDING) != (ratio == 0):
                raise ConfigError(f"layer {i}: kind {kind!r} does not match compress ratio {ratio}")
        if self.head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError("qk_rope_head_dim must be <= head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError("o_groups must divide num_attention_heads * head_dim")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (only sqrtsoftplus)")

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size is not None

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        n = _req(d, "num_hidden_layers")
        ratios, kinds = _layer_schedule(d, n)
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and not isinstance(v, (dict, list))}
        kw.update(
            num_hidden_layers=n,
            compress_ratios=ratios,
            layer_kinds=kinds,
            num_hash_layers=_num_hash_layers(d, n),
            qk_rope_head_dim=_rope_dim(d),
            rope_scaling=_yarn(d),
            quant=_weight_quant(d),
            dspark_target_layer_ids=tuple(d.get("dspark_target_layer_ids") or ()),
        )
        kw.update(_rope_thetas(d))
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        for key in ("bos_token_id", "eos_token_id"):
            if kw.get(key) is None:
                kw.pop(key, None)
        return cls(**kw)


def _req(d: dict, key: str):
    if key not in d:
        raise ConfigError(f"config.json is missing required key {key!r}")
    return d[key]


def _layer_schedule(d: dict, n: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if d.get("layer_types"):
        rates = {**_DEFAULT_HF_RATES, **(d.get("compress_rates") or {})}
        kinds, ratios = [], []
        for i, name in enumerate(d["layer_types"][:n]):
            if name not in _HF_LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] = {name!r} is not a DeepSeek-V4 layer type")
            kinds.append(_HF_LAYER_TYPES[name])
            ratios.append(0 if name == "sliding_attention" else int(rates[name]))
        if len(kinds) != n:
            raise ConfigError(f"layer_types has {len(kinds)} entries, num_hidden_layers is {n}")
        return tuple(ratios), tuple(kinds)
    ratios = d.get("compress_ratios")
    if ratios is None:
        raise ConfigError("config.json needs 'compress_ratios' (DeepSeek) or 'layer_types' (transformers)")
    if len(ratios) < n:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries, num_hidden_layers is {n}")
    # Entries past num_hidden_layers describe the MTP/DSpark stages (sliding only).
    trunk = tuple(int(r) for r in ratios[:n])
    # DeepSeek's reference ties the overlapped compressor + indexer to ratio 4.
    kinds = tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in trunk)
    return trunk, kinds


def _num_hash_layers(d: dict, n: int) -> int:
    mlp = d.get("mlp_layer_types")
    if mlp:
        hashed = [t == "hash_moe" for t in mlp[:n]]
        count = sum(hashed)
        if hashed != [True] * count + [False] * (n - count):
            raise ConfigError("mlp_layer_types: hash_moe layers must come first")
        return count
    return int(d.get("num_hash_layers", 3))


def _rope_dim(d: dict) -> int:
    if "qk_rope_head_dim" in d:
        return int(d["qk_rope_head_dim"])
    if d.get("partial_rotary_factor"):
        return int(round(d["head_dim"] * d["partial_rotary_factor"]))
    return 64


def _rope_thetas(d: dict) -> dict:
    rp = d.get("rope_parameters") or {}
    out = {}
    if isinstance(rp.get("main"), dict):
        out["rope_theta"] = float(rp["main"].get("rope_theta", d.get("rope_theta", 10000.0)))
    elif "rope_theta" in d:
        out["rope_theta"] = float(d["rope_theta"])
    if isinstance(rp.get("compress"), dict):
        out["compress_rope_theta"] = float(rp["compress"].get("rope_theta", 160000.0))
    elif "compress_rope_theta" in d:
        out["compress_rope_theta"] = float(d["compress_rope_theta"])
    return out


def _yarn(d: dict) -> YarnScaling | None:
    rp = d.get("rope_parameters") or {}
    src = rp.get("compress") if isinstance(rp.get("compress"), dict) else d.get("rope_scaling")
    if not src:
        return None
    kind = src.get("rope_type", src.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (only yarn)")
    orig = int(_req(src, "original_max_position_embeddings"))
    factor = src.get("factor") or d.get("max_position_embeddings", 1048576) / orig
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=orig,
        beta_fast=float(src.get("beta_fast") or 32),
        beta_slow=float(src.get("beta_slow") or 1),
    )


def _weight_quant(d: dict) -> WeightQuant:
    qc = d.get("quantization_config")
    expert_dtype = d.get("expert_dtype") or (qc or {}).get("expert_dtype")
    if not qc:
        return WeightQuant(block_size=None, expert_dtype=expert_dtype or "bf16")
    method = qc.get("quant_method")
    if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(
            f"quantization_config: quant_method={method!r} fmt={qc.get('fmt')!r} is not supported "
            "(deepinfer reads DeepSeek's fp8 e4m3 block format)"
        )
    block = qc.get("weight_block_size") or [128, 128]
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise ConfigError(f"expert_dtype {expert_dtype!r} is not supported (fp4, fp8)")
    return WeightQuant(
        block_size=(int(block[0]), int(block[1])),
        scale_fmt=qc.get("scale_fmt") or "float32",
        expert_dtype=expert_dtype or "fp8",
    )


def load_config_dict(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    with open(path) as f:
        return json.load(f)
