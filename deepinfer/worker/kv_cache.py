"""The hybrid decode-time state of a DeepSeek-V4 model, as device tensors.

Fixed-size state lives in per-request *slots* (window ring: W rows per slot; compressor
carry: S rows per slot). Compressed entries and indexer keys grow with the sequence and are
paged: one pool per ratio m, `num_blocks[m]` blocks of `block_size` entries, shared by all
layers of that ratio (a block id addresses the same rows in each of them). The engine's
block manager decides which slot and blocks a request owns; this module only holds tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.state.kv_state import CarryState, EntryStore, FormatStore, IndexKeyStore, LayerCache
from deepinfer.models.config import CSA, SLIDING
from deepinfer.models.config_v41 import FULL, DeepseekV41Config

# kv_cache_dtype -> (entry/window format, indexer-key format)
KV_FORMATS = {
    "fp8": ("fp8", "fp4"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float32": ("float32", "float32"),
}
DEFAULT_BLOCK_SIZE = 64


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """"auto" = the format DeepSeek-V4 was trained with (QAT): fp8 nope dims, fp4 indexer keys."""
    if kv_cache_dtype == "auto":
        return "fp8"
    if kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of auto, {', '.join(KV_FORMATS)}")
    return kv_cache_dtype


def default_cache_memory(device: str, fraction: float = 0.9) -> int:
    """Bytes for the cache pools when none are given: a fraction of the GPU's free memory
    (measured after the weights are loaded), or 2 GiB of host memory on the CPU."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * fraction)
    return 2 << 30


@dataclass(frozen=True)
class CacheSpec:
    """Sizes the engine needs to split a memory budget into slots and blocks."""

    ratios: tuple[int, ...]            # compressor ratios, each with its own block pool
    compress_kinds: frozenset          # {(ratio, overlapped)}
    block_size: int
    slot_bytes: int                    # ring + carry of every layer, one request
    block_bytes: dict[int, int]        # one block of ratio m across all its layers


# V4.1: kv_cache_dtype -> (window, compressed entries, index keys); "auto"/"fp8" = the reference formats
V41_FORMATS = {
    "fp8": ("fp8", "nvfp4", "mxfp4"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "float32": ("float32", "float32", "float32"),
}


def _layer_caches_v41(cfg: DeepseekV41Config, num_slots: int, num_blocks: dict[int, int], block_size: int,
                      kv_cache_dtype: str, device) -> tuple[list[LayerCache], list[LayerCache]]:
    win_fmt, entry_fmt, key_fmt = V41_FORMATS[resolve_kv_cache_dtype(kv_cache_dtype)]
    ring = lambda: FormatStore(num_slots * cfg.sliding_window, cfg.head_dim, win_fmt, device)  # noqa: E731
    layers = []
    for i, m in enumerate(cfg.compress_ratios):
        cache = LayerCache(ring(), ratio=m)
        if cfg.role(i) == FULL:
            rows = num_blocks[m] * block_size
            cache.entries = FormatStore(rows, cfg.head_dim, entry_fmt, device)
            cache.index_keys = FormatStore(rows, cfg.index_head_dim, key_fmt, device)
            if m > 1:  # the open group: up to m - 1 tokens' fp32 projections
                cache.carry["main"] = CarryState.empty(num_slots * m, cfg.head_dim, device)
        layers.append(cache)
    return layers, [LayerCache(ring()) for _ in range(cfg.num_nextn_predict_layers if cfg.has_dspark else 0)]


def _compressed(cfg) -> list[tuple[int, bool]]:
    """(ratio, overlapped) of every layer that owns compressed entries."""
    if isinstance(cfg, DeepseekV41Config):
        return [(m, False) for i, m in enumerate(cfg.compress_ratios) if cfg.role(i) == FULL]
    return [(m, k == CSA) for k, m in zip(cfg.layer_kinds, cfg.compress_ratios) if k != SLIDING]


def _layer_caches(cfg, num_slots: int, num_blocks: dict[int, int], block_size: int,
                  kv_cache_dtype: str, device) -> tuple[list[LayerCache], list[LayerCache]]:
    if isinstance(cfg, DeepseekV41Config):
        return _layer_caches_v41(cfg, num_slots, num_blocks, block_size, kv_cache_dtype, device)
    entry_fmt, key_fmt = KV_FORMATS[resolve_kv_cache_dtype(kv_cache_dtype)]
    W, r = cfg.sliding_window, cfg.qk_rope_head_dim
    ring = lambda: EntryStore(num_slots * W, cfg.head_dim, r, entry_fmt, device)  # noqa: E731
    layers = []
    for kind, m in zip(cfg.layer_kinds, cfg.compress_ratios):
        cache = LayerCache(ring(), ratio=m)
        if kind != SLIDING:
            overlap, rows = kind == CSA, num_blocks[m] * block_size
            span = 2 * m if overlap else m
            cache.entries = EntryStore(rows, cfg.head_dim, r, entry_fmt, device)
            cache.carry["main"] = CarryState.empty(num_slots * span, (2 if overlap else 1) * cfg.head_dim, device)
        if kind == CSA:
            cache.index_keys = IndexKeyStore(num_blocks[m] * block_size, cfg.index_head_dim, key_fmt, device)
            cache.carry["indexer"] = CarryState.empty(num_slots * 2 * m, 2 * cfg.index_head_dim, device)
        layers.append(cache)
    return layers, [LayerCache(ring()) for _ in range(cfg.num_nextn_predict_layers)]


def history_width(cfg) -> int:
    """Tokens of input history kept per slot (V4.1 Engram: the n-gram window minus the token itself)."""
    return cfg.engram_max_ngram_size - 1 if getattr(cfg, "engram_layer_ids", ()) else 0


def cache_spec(cfg, kv_cache_dtype: str, block_size: int = DEFAULT_BLOCK_SIZE) -> CacheSpec:
    """Measured from a one-slot, one-block-per-ratio allocation on the meta device."""
    kinds = frozenset(_compressed(cfg))
    ratios = tuple(sorted({m for m, _ in kinds}))
    base = sum(c.nbytes() for c in sum(_layer_caches(cfg, 1, dict.fromkeys(ratios, 0), block_size,
                                                     kv_cache_dtype, "meta"), []))
    per_block = {}
    for m in ratios:
        one = sum(c.nbytes() for c in sum(_layer_caches(cfg, 1, {**dict.fromkeys(ratios, 0), m: 1}, block_size,
                                                        kv_cache_dtype, "meta"), []))
        per_block[m] = one - base
    return CacheSpec(ratios, kinds, block_size, base + 8 * history_width(cfg), per_block)


@dataclass
class V4Cache:
    layers: list[LayerCache]
    mtp: list[LayerCache]
    num_slots: int
    num_blocks: dict[int, int]
    block_size: int
    compress_kinds: set[tuple[int, bool]]
    scratch_slot: int | None = None                 # a slot and an entry row per ratio no request owns
    scratch_addr: dict[int, int] | None = None      # (padding rows of captured decode graphs write there)
    # [num_slots, H] each request's last H input tokens (-1 = none / image), or None (state/forward_batch.py)
    token_history: torch.Tensor | None = None

    def copy_state(self, src_slot: int, dst_slot: int, src_blocks: dict[int, list[int]],
                   dst_blocks: dict[int, list[int]]) -> None:
        """Duplicate a request's state into another slot and blocks (n > 1 forks after the
        shared prompt prefill). dst_blocks[m] must be at least as long as src_blocks[m]."""
        bs = self.block_size
        for cache in self.layers + self.mtp:
            for t in cache.per_slot():
                per = t.shape[0] // self.num_slots
                t[dst_slot * per:(dst_slot + 1) * per] = t[src_slot * per:(src_slot + 1) * per]
        if self.token_history is not None:
            self.token_history[dst_slot] = self.token_history[src_slot]
        for cache in self.layers + self.mtp:
            src = src_blocks.get(cache.ratio, [])
            if not src:
                continue
            rows = lambda blocks: (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten()  # noqa: E731
            s_rows, d_rows = rows(src), rows(dst_blocks[cache.ratio][:len(src)])
            for t in cache.paged():
                t[d_rows.to(t.device)] = t[s_rows.to(t.device)]


def allocate_v4_cache(cfg, num_slots: int, num_blocks: dict[int, int], kv_cache_dtype: str,
                      device, block_size: int = DEFAULT_BLOCK_SIZE, scratch: bool = False) -> V4Cache:
    """`num_slots` / `num_blocks` for requests; with `scratch`, one more slot (index num_slots) and
    one more block per ratio (the last) are allocated for the padding rows of decode graphs."""
    extra = int(scratch)
    blocks = {m: n + extra for m, n in num_blocks.items()}
    layers, mtp = _layer_caches(cfg, num_slots + extra, blocks, block_size, kv_cache_dtype, device)
    spec = cache_spec(cfg, kv_cache_dtype, block_size)
    h = history_width(cfg)
    history = torch.full((num_slots + extra, h), -1, dtype=torch.long, device=device) if h else None
    cache = V4Cache(layers, mtp, num_slots + extra, blocks, block_size, set(spec.compress_kinds), token_history=history)
    if scratch:
        cache.scratch_slot, cache.scratch_addr = num_slots, {m: n * block_size for m, n in num_blocks.items()}
    return cache
