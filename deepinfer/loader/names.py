"""Checkpoint tensor names -> DeepSeek's original names.

Layouts understood:
* "deepseek": what the hub ships (`embed.weight`, `layers.N.attn.wq_a.weight`, ...).
* "hf": transformers module names (`model.layers.N.self_attn.q_a_proj.weight`, fused
  `mlp.experts.gate_up_proj [E, 2F, D]` = w1 rows then w3 rows, `down_proj [E, D, F]`).
* what transformers' `save_pretrained` writes for DeepseekV4ForCausalLM: it reverses its
  own renames but keeps the `model.` prefix, leaves `model.embed_tokens.weight` and
  `model.hc_head.hc_*` unreversed, writes `head.weight`, and writes the main attention
  kv_norm as `model.layers.N.attn.norm.weight`. It writes no `mtp.*` tensors.
Every name is mapped on its own, so a checkpoint mixing these spellings still loads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

_TOP = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# transformers module path under `layers.N.` -> DeepSeek path; the longest match wins.
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj": "attn.wq_a",
    "self_attn.q_a_norm": "attn.q_norm",
    "self_attn.q_b_proj": "attn.wq_b",
    "self_attn.kv_proj": "attn.wkv",
    "self_attn.kv_norm": "attn.kv_norm",
    "self_attn.o_a_proj": "attn.wo_a",
    "self_attn.o_b_proj": "attn.wo_b",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj": "attn.compressor.wkv",
    "self_attn.compressor.gate_proj": "attn.compressor.wgate",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm": "attn.compressor.norm",
    "self_attn.compressor.indexer.kv_proj": "attn.indexer.compressor.wkv",
    "self_attn.compressor.indexer.gate_proj": "attn.indexer.compressor.wgate",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm": "attn.indexer.compressor.norm",
    "self_attn.compressor.indexer.q_b_proj": "attn.indexer.wq_b",
    "self_attn.compressor.indexer.scorer.weights_proj": "attn.indexer.weights_proj",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj": "ffn.shared_experts.w1",
    "mlp.shared_experts.up_proj": "ffn.shared_experts.w3",
    "mlp.shared_experts.down_proj": "ffn.shared_experts.w2",
    # save_pretrained's reversal turns self_attn.kv_norm into attn.norm
    "attn.norm": "attn.kv_norm",
}
_BLOCK_KEYS = sorted(_BLOCK, key=len, reverse=True)
_BLOCK_RE = re.compile(r"^((?:mtp\.\d+\.)?layers\.\d+\.|mtp\.\d+\.)(.+)$")
_FUSED_RE = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_RE = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


# The draft layers (MTP, or DSpark's stages) in every layout: transformers and NeMo AutoModel
# export the trunk without them.
DRAFT_PREFIX = "mtp."


@dataclass(frozen=True)
class WeightRef:
    """DeepSeek tensor `name` is `source[index]` in the checkpoint (index None = whole)."""

    name: str
    source: str
    index: tuple | None = None


def detect_layout(names: Iterable[str]) -> str:
    """"hf" if any name uses transformers spelling (a `model.`/`lm_head.` prefix), else "deepseek"."""
    for n in names:
        if n.startswith(("model.", "lm_head.")):
            return "hf"
    return "deepseek"


def to_deepseek_name(name: str) -> str:
    """One non-fused checkpoint name in DeepSeek spelling (unknown names pass through)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_RE.match(name)
    if not m:
        return name
    prefix, rest = m.groups()
    for key in _BLOCK_KEYS:
        if rest == key or rest.startswith(key + "."):
            return prefix + _BLOCK[key] + rest[len(key):]
    return prefix + rest


def is_draft_name(name: str) -> bool:
    """Whether a checkpoint tensor (any layout) belongs to the draft layers."""
    return to_deepseek_name(name).startswith(DRAFT_PREFIX)


def split_expert_name(name: str) -> tuple[str, int, str, str] | None:
    """`...ffn.experts.E.w1.weight` -> ("...ffn.experts", E, "w1", "weight")."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    return m.group(1), int(m.group(2)), m.group(3), m.group(4)


def plan_names(names: Iterable[str], shape_of: Callable[[str], tuple[int, ...]]) -> list[WeightRef]:
    """Every checkpoint tensor as DeepSeek-named refs; fused expert tensors become one
    ref per expert and projection (`shape_of` gives E and F without loading)."""
    refs: list[WeightRef] = []
    for src in names:
        base = src[len("model."):] if src.startswith("model.") else src
        m = _FUSED_RE.match(base)
        if not m:
            refs.append(WeightRef(to_deepseek_name(src), src))
            continue
        prefix, kind = m.groups()
        stem = f"{prefix}.ffn.experts"
        shape = shape_of(src)
        if kind == "gate_up_proj":
            n_exp, two_f = shape[0], shape[1]
            f = two_f // 2
            for e in range(n_exp):
                refs.append(WeightRef(f"{stem}.{e}.w1.weight", src, (e, slice(0, f))))
                refs.append(WeightRef(f"{stem}.{e}.w3.weight", src, (e, slice(f, two_f))))
        else:
            for e in range(shape[0]):
                refs.append(WeightRef(f"{stem}.{e}.w2.weight", src, (e,)))
    return refs


_TOP_TO_HF = {v: k for k, v in _TOP.items()}
_BLOCK_TO_HF = {v: k for k, v in _BLOCK.items() if k != "attn.norm"}
_BLOCK_TO_HF_KEYS = sorted(_BLOCK_TO_HF, key=len, reverse=True)


def to_hf_name(name: str) -> str:
    """DeepSeek name -> transformers module name (trunk only; `mtp.*` keeps DeepSeek's
    spelling, which transformers skips on load). Not for per-expert routed weights."""
    if name.startswith("mtp."):
        return name
    if name == "head.weight":
        return "lm_head.weight"
    if name in _TOP_TO_HF:
        return "model." + _TOP_TO_HF[name]
    m = _BLOCK_RE.match(name)
    if m:
        prefix, rest = m.groups()
        for key in _BLOCK_TO_HF_KEYS:
            if rest == key or rest.startswith(key + "."):
                return "model." + prefix + _BLOCK_TO_HF[key] + rest[len(key):]
    return "model." + name
