"""How config.json keys that change the math are read (DeepSeek-V4 and V4.1 alike).

Rule: every key the model's math depends on is either read into the typed config or checked
against the one value deepinfer implements (`FIXED_VALUES`); any other value, an unknown RoPE
type and any key inside a RoPE dict that is not listed here is a ConfigError naming the key.
Keys no math depends on are not read: metadata (architectures, model_type, dtype / torch_dtype,
transformers_version, use_cache, id2label, ...), init and training settings (initializer_range,
attention_dropout, router_aux_loss_coef, router_jitter_noise, output_router_logits).

RoPE: sliding-window-only layers (MTP / DSpark stages included) rotate with `rope_theta` and no
YaRN; layers with a compressor rotate with `compress_rope_theta` and the YaRN settings. Forms read:
  rope_scaling = {type | rope_type, factor, original_max_position_embeddings, beta_fast, beta_slow}
      (DeepSeek's own config.json);
  rope_parameters = {rope_type, rope_theta, <the yarn keys>}, flat (transformers 5 and NeMo
      AutoModel): its rope_theta is the sliding layers' theta, its YaRN the compressed layers';
  rope_parameters = {"main": {...}, "compress": {...}} (transformers' DeepseekV4Config): main
      is the sliding layers' rope (plain only), compress the compressed layers' (theta + YaRN).
rope_type is "default" or "yarn". YaRN interpolates frequencies only: `attention_factor` (the
attention temperature) must be 1 and `truncate` true. Where two keys give the same setting
(rope_theta and rope_parameters.rope_theta, rope_scaling and rope_parameters, ...) they must agree.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from deepinfer.layers.rotary import YarnScaling
from deepinfer.models.interface import ConfigError


# Math keys deepinfer implements at one value only (an absent key means that value).
FIXED_VALUES: dict[str, tuple] = {
    "hidden_act": ("silu",),                # SwiGLU experts
    "num_key_value_heads": (1,),            # one shared K = V head
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "tie_word_embeddings": (False,),        # head.weight is its own tensor
    "rope_interleave": (True,),             # RoPE rotates channel pairs (2j, 2j+1)
    "scoring_func": ("sqrtsoftplus",),
    "topk_method": ("noaux_tc",),           # top-k of score + bias, the bias only selects
    "norm_topk_prob": (True,),              # the selected weights are renormalised
    "n_shared_experts": (1,),
    "n_group": (None, 1),                   # no group-limited routing
    "topk_group": (None, 1),
    "kv_lora_rank": (None,),                # KV is one projection, no low-rank up-projection
    "first_k_dense_replace": (None, 0),     # every layer is MoE
    "moe_layer_freq": (None, 1),
}

_ROPE_TYPES = ("default", "yarn")
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
              "truncate"}
_YARN_FIXED = {"attention_factor": (1,), "truncate": (True,)}


def _same(value: Any, accepted: Any) -> bool:
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def check_fixed(d: dict[str, Any], prefix: str = "", table: dict[str, tuple] = FIXED_VALUES) -> None:
    for key, accepted in table.items():
        if key in d and not any(_same(d[key], a) for a in accepted):
            raise ConfigError(f"{prefix}{key} = {d[key]!r} is not supported (deepinfer implements "
                              f"{' or '.join(repr(a) for a in accepted)})")


_SCALARS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_fields(obj: Any, prefix: str = "") -> None:
    """A config dataclass's int / float / bool / str fields hold that type (`X | None` fields may
    be None) and its fields named in FIXED_VALUES hold an accepted value."""
    check_fixed({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, prefix)
    for f in dataclasses.fields(obj):
        base, optional = str(f.type).removesuffix(" | None"), str(f.type).endswith(" | None")
        value = getattr(obj, f.name)
        if base not in _SCALARS or (optional and value is None):
            continue
        if not isinstance(value, _SCALARS[base]) or (base != "bool" and isinstance(value, bool)):
            raise ConfigError(f"{prefix}{f.name} must be {'an' if base == 'int' else 'a'} {base}, got {value!r}")


def positive(value: Any, where: str, kind: type = float) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0 or (kind is int and not isinstance(value, int)):
        raise ConfigError(f"{where} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def read_rope_dim(d: dict[str, Any], head_dim: int, default: int, prefix: str = "") -> int:
    """qk_rope_head_dim, or head_dim * partial_rotary_factor (transformers); both must agree."""
    dim, factor = d.get("qk_rope_head_dim"), d.get("partial_rotary_factor")
    if dim is not None:
        dim = positive(dim, prefix + "qk_rope_head_dim", int)
    else:
        dim = default if factor is None else round(head_dim * positive(factor, prefix + "partial_rotary_factor"))
    _check_rotary_factor(factor, prefix + "partial_rotary_factor", dim, head_dim)
    for key, want in (("qk_nope_head_dim", head_dim - dim), ("v_head_dim", head_dim)):
        if d.get(key) is not None and d[key] != want:
            raise ConfigError(f"{prefix}{key} = {d[key]!r} does not match head_dim {head_dim} with rope dim {dim} "
                              f"(expected {want})")
    return dim


def check_rope_dim(cfg: Any, prefix: str = "") -> None:
    """RoPE turns channel pairs of the last qk_rope_head_dim channels of attention and index heads."""
    dim, limit = cfg.qk_rope_head_dim, min(cfg.head_dim, cfg.index_head_dim)
    if dim % 2 or dim > limit:
        raise ConfigError(f"{prefix}qk_rope_head_dim {dim} must be even and <= head_dim / index_head_dim ({limit})")


def _check_rotary_factor(factor: Any, where: str, rope_dim: Any, head_dim: Any) -> None:
    if factor is not None and round(head_dim * positive(factor, where)) != rope_dim:
        raise ConfigError(f"{where} = {factor!r} gives {round(head_dim * factor)} rotary dims, "
                          f"qk_rope_head_dim is {rope_dim}")


@dataclass(frozen=True)
class _Rope:
    """What one RoPE dict states: its theta (None if it has none) and its YaRN (None = plain)."""

    theta: float | None
    yarn: YarnScaling | None


def _one_rope(src: Any, where: str, rope_dim: int, head_dim: int) -> _Rope:
    if not isinstance(src, dict):
        raise ConfigError(f"{where} must be an object, got {src!r}")
    kinds = {src[k] for k in ("rope_type", "type") if k in src}
    if len(kinds) > 1:
        raise ConfigError(f"{where}: type and rope_type disagree ({' vs '.join(sorted(map(repr, kinds)))})")
    kind = kinds.pop() if kinds else "default"
    if kind not in _ROPE_TYPES:
        raise ConfigError(f"{where}.rope_type {kind!r} is not supported (default or yarn)")
    allowed = _ROPE_KEYS | (_YARN_KEYS if kind == "yarn" else set())
    for key in src:
        if key not in allowed:
            raise ConfigError(f"{where}.{key} is not understood with rope_type {kind!r}")
    _check_rotary_factor(src.get("partial_rotary_factor"), f"{where}.partial_rotary_factor", rope_dim, head_dim)
    theta = None if src.get("rope_theta") is None else positive(src["rope_theta"], f"{where}.rope_theta")
    if kind == "default":
        return _Rope(theta, None)
    check_fixed(src, f"{where}.", _YARN_FIXED)
    for key in ("factor", "original_max_position_embeddings"):
        if key not in src:
            raise ConfigError(f"{where}.{key} is required for rope_type 'yarn'")
    return _Rope(theta, YarnScaling(
        factor=positive(src["factor"], f"{where}.factor"),
        original_max_position_embeddings=positive(src["original_max_position_embeddings"],
                                                   f"{where}.original_max_position_embeddings", int),
        beta_fast=positive(src.get("beta_fast", 32.0), f"{where}.beta_fast"),
        beta_slow=positive(src.get("beta_slow", 1.0), f"{where}.beta_slow"),
    ))


def read_rope(d: dict[str, Any], rope_dim: int, head_dim: int, prefix: str = "") -> dict[str, Any]:
    """{rope_theta, compress_rope_theta, rope_scaling} as far as `d` states them, from every form."""
    found: dict[str, list[tuple[str, Any]]] = {"rope_theta": [], "compress_rope_theta": [], "rope_scaling": []}
    for key in ("rope_theta", "compress_rope_theta"):
        if d.get(key) is not None:
            found[key].append((key, positive(d[key], prefix + key)))

    def add(field: str, source: str, value: Any) -> None:
        found[field].append((source, value))

    params = d.get("rope_parameters")
    if params and isinstance(params, dict) and ("main" in params or "compress" in params):
        for key in params:
            if key not in ("main", "compress"):
                raise ConfigError(f"{prefix}rope_parameters.{key} is not understood next to main / compress")
        main = _one_rope(params.get("main", {}), f"{prefix}rope_parameters.main", rope_dim, head_dim)
        if main.yarn is not None:
            raise ConfigError(f"{prefix}rope_parameters.main: YaRN on the sliding-window layers is not supported")
        compress = _one_rope(params.get("compress", {}), f"{prefix}rope_parameters.compress", rope_dim, head_dim)
        if main.theta is not None:
            add("rope_theta", "rope_parameters.main.rope_theta", main.theta)
        if compress.theta is not None:
            add("compress_rope_theta", "rope_parameters.compress.rope_theta", compress.theta)
        add("rope_scaling", "rope_parameters.compress", compress.yarn)
    elif params:
        flat = _one_rope(params, f"{prefix}rope_parameters", rope_dim, head_dim)
        if flat.theta is not None:
            add("rope_theta", "rope_parameters.rope_theta", flat.theta)
        add("rope_scaling", "rope_parameters", flat.yarn)
    if d.get("rope_scaling"):
        scaling = _one_rope(d["rope_scaling"], f"{prefix}rope_scaling", rope_dim, head_dim)
        if scaling.theta is not None:
            add("rope_theta", "rope_scaling.rope_theta", scaling.theta)
        add("rope_scaling", "rope_scaling", scaling.yarn)

    out = {}
    for field, values in found.items():
        for (src_a, a), (src_b, b) in zip(values, values[1:]):
            if a != b:
                raise ConfigError(f"{prefix}{src_a} ({a}) and {prefix}{src_b} ({b}) disagree")
        if values:
            out[field] = values[0][1]
    return out
