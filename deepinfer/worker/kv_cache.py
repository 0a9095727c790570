"""Allocation of the hybrid decode-time state of a DeepSeek-V4 model.

Static layout for now: each of `num_slots` requests owns a window ring of W rows, a
carry of S rows per compressor, and `entry_cap[ratio] = ceil(max_len / ratio)` entry
rows per compressed layer (address = slot * cap + w).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.kv_state import CarryState, EntryStore, IndexKeyStore, LayerCache
from deepinfer.models.config import CSA, SLIDING, DeepseekV4Config

# kv_cache_dtype -> (entry/window format, indexer-key format)
KV_FORMATS = {
    "fp8": ("fp8", "fp4"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float32": ("float32", "float32"),
}


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """"auto" = the format DeepSeek-V4 was trained with (QAT): fp8 nope dims, fp4 indexer keys."""
    if kv_cache_dtype == "auto":
        return "fp8"
    if kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of auto, {', '.join(KV_FORMATS)}")
    return kv_cache_dtype


@dataclass
class V4Cache:
    layers: list[LayerCache]
    mtp: list[LayerCache]
    num_slots: int
    max_len: int
    entry_cap: dict[int, int]
    compress_kinds: set[tuple[int, bool]]

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers + self.mtp)


def allocate_v4_cache(cfg: DeepseekV4Config, num_slots: int, max_len: int, kv_cache_dtype: str,
                      device: torch.device | str) -> V4Cache:
    entry_fmt, key_fmt = KV_FORMATS[resolve_kv_cache_dtype(kv_cache_dtype)]
    W, r = cfg.sliding_window, cfg.qk_rope_head_dim
    ring = lambda: EntryStore(num_slots * W, cfg.head_dim, r, entry_fmt, device)  # noqa: E731
    caps, kinds, layers = {}, set(), []
    for kind, m in zip(cfg.layer_kinds, cfg.compress_ratios):
        cache = LayerCache(ring())
        if kind != SLIDING:
            overlap = kind == CSA
            caps[m] = -(-max_len // m)
            kinds.add((m, overlap))
            span = 2 * m if overlap else m
            cache.entries = EntryStore(num_slots * caps[m], cfg.head_dim, r, entry_fmt, device)
            cache.carry["main"] = CarryState.empty(num_slots * span, (2 if overlap else 1) * cfg.head_dim, device)
        if kind == CSA:
            cache.index_keys = IndexKeyStore(num_slots * caps[m], cfg.index_head_dim, key_fmt, device)
            cache.carry["indexer"] = CarryState.empty(num_slots * 2 * m, 2 * cfg.index_head_dim, device)
        layers.append(cache)
    mtp = [LayerCache(ring()) for _ in range(cfg.num_nextn_predict_layers)]
    return V4Cache(layers, mtp, num_slots, max_len, caps, kinds)
