"""The hybrid decode-time state of a DeepSeek-V4 model, as device tensors.

Fixed-size state lives in per-request *slots* (window ring: W rows per slot; compressor
carry: S rows per slot; V4.1's input-token history: K per slot; each plus `ring_slack` rows,
which let a step's last positions be taken back, see state/forward_batch.py). Compressed
entries and indexer keys grow with the sequence and are
paged: one pool per ratio m, `num_blocks[m]` blocks of `block_size` entries, shared by all
layers of that ratio (a block id addresses the same rows in each of them). The engine's
block manager decides which slot and blocks a request owns; this module only holds tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.registry import model_classes
from deepinfer.state.kv_state import LayerCache

DEFAULT_BLOCK_SIZE = 64


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


def history_width(cfg) -> int:
    """Rows of the per-slot input-token ring (V4.1 Engram: one per token of the n-gram window)."""
    return cfg.engram_max_ngram_size if getattr(cfg, "engram_layer_ids", ()) else 0


def _check_slack(ring_slack) -> int:
    if not isinstance(ring_slack, int) or isinstance(ring_slack, bool) or ring_slack < 0:
        raise ValueError(f"ring_slack must be an int >= 0, got {ring_slack!r}")
    return ring_slack


def history_rows(cfg, ring_slack: int = 0) -> int:
    """Columns per slot of V4Cache.token_history: history_width + ring_slack, or 0 without Engram."""
    width = history_width(cfg)
    return width + ring_slack if width else 0


def _layer_caches(cfg, num_slots: int, num_blocks: dict[int, int], block_size: int,
                  kv_cache_dtype: str, device, ring_slack: int = 0) -> tuple[list[LayerCache], list[LayerCache]]:
    """The model class lays out its own cache (models/interface.py CausalLM.cache_layout)."""
    return model_classes(cfg.model_type)[1].cache_layout(cfg, num_slots, num_blocks, block_size, kv_cache_dtype,
                                                         device, ring_slack=ring_slack)


def cache_spec(cfg, kv_cache_dtype: str, block_size: int = DEFAULT_BLOCK_SIZE, ring_slack: int = 0) -> CacheSpec:
    """Measured from a one-slot, one-block-per-ratio allocation on the meta device (slot_bytes
    counts the rings with `ring_slack` rows more per slot)."""
    _check_slack(ring_slack)
    kinds = frozenset(model_classes(cfg.model_type)[1].compressed_kinds(cfg))
    ratios = tuple(sorted({m for m, _ in kinds}))
    layout = lambda blocks: _layer_caches(cfg, 1, blocks, block_size, kv_cache_dtype, "meta", ring_slack)  # noqa: E731
    base = sum(c.nbytes() for c in sum(layout(dict.fromkeys(ratios, 0)), []))
    per_block = {}
    for m in ratios:
        one = sum(c.nbytes() for c in sum(layout({**dict.fromkeys(ratios, 0), m: 1}), []))
        per_block[m] = one - base
    return CacheSpec(ratios, kinds, block_size, base + 8 * history_rows(cfg, ring_slack), per_block)


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
    # [num_slots, K + ring_slack] a ring of each request's last input tokens (-1 = image), or None
    # (state/forward_batch.py HistoryPlan)
    token_history: torch.Tensor | None = None
    # extra rows per slot of every ring (window, carries, token history); build_forward_batch must plan
    # the cache's steps with the same value
    ring_slack: int = 0

    def copy_state(self, src_slot: int, dst_slot: int, src_blocks: dict[int, list[int]],
                   dst_blocks: dict[int, list[int]]) -> None:
        """Duplicate a request's state into another slot and blocks (n > 1 forks after the
        shared prompt prefill). dst_blocks[m] must be at least as long as src_blocks[m]."""
        bs = self.block_size
        if self.token_history is not None:
            self.token_history[dst_slot] = self.token_history[src_slot]
        for cache in self.layers + self.mtp:
            for t in cache.per_slot():
                per = t.shape[0] // self.num_slots
                t[dst_slot * per:(dst_slot + 1) * per] = t[src_slot * per:(src_slot + 1) * per]
            src = src_blocks.get(cache.ratio, [])
            if not src:
                continue
            rows = lambda blocks: (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten()  # noqa: E731
            s_rows, d_rows = rows(src), rows(dst_blocks[cache.ratio][:len(src)])
            for t in cache.paged():
                t[d_rows.to(t.device)] = t[s_rows.to(t.device)]


def allocate_v4_cache(cfg, num_slots: int, num_blocks: dict[int, int], kv_cache_dtype: str,
                      device, block_size: int = DEFAULT_BLOCK_SIZE, scratch: bool = False,
                      ring_slack: int = 0) -> V4Cache:
    """`num_slots` / `num_blocks` for requests; with `scratch`, one more slot (index num_slots) and
    one more block per ratio (the last) are allocated for the padding rows of decode graphs.
    `ring_slack` rows more per slot in every ring (speculative decoding: a verify chunk of k drafts
    needs ring_slack >= k - 1, see state/forward_batch.py); 0 is the minimal layout."""
    _check_slack(ring_slack)
    extra = int(scratch)
    blocks = {m: n + extra for m, n in num_blocks.items()}
    layers, mtp = _layer_caches(cfg, num_slots + extra, blocks, block_size, kv_cache_dtype, device, ring_slack)
    kinds = model_classes(cfg.model_type)[1].compressed_kinds(cfg)
    h = history_rows(cfg, ring_slack)
    history = torch.full((num_slots + extra, h), -1, dtype=torch.long, device=device) if h else None
    cache = V4Cache(layers, mtp, num_slots + extra, blocks, block_size, set(kinds), token_history=history,
                    ring_slack=ring_slack)
    if scratch:
        cache.scratch_slot, cache.scratch_addr = num_slots, {m: n * block_size for m, n in num_blocks.items()}
    return cache
