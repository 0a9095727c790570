"""A decode-time cache with a fixed layout, for code that drives a model's forward directly
(model tests, benchmarks) without the engine's block manager: slot s owns a fixed range of
blocks of every ratio, enough for `max_len` tokens."""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.worker.kv_cache import V4Cache, allocate_v4_cache, cache_spec


@dataclass
class StaticV4Cache(V4Cache):
    def static_tables(self, slot: int) -> dict[int, list[int]]:
        """Block tables of slot `slot`: blocks [s*B/S, (s+1)*B/S) of each ratio, for S slots and
        B blocks per ratio not counting the scratch ones."""
        scratch = self.scratch_slot is not None
        slots = self.num_slots - scratch
        return {m: list(range(slot * (n - scratch) // slots, (slot + 1) * (n - scratch) // slots))
                for m, n in self.num_blocks.items()}


def static_v4_cache(cfg, num_slots: int, max_len: int, kv_cache_dtype: str, device,
                    block_size: int = 16, scratch: bool = False) -> StaticV4Cache:
    """Every slot owns enough blocks for `max_len` tokens. With `scratch`, one more slot and one
    more block per ratio are set aside for the padding rows of decode graphs (see V4Cache)."""
    ratios = cache_spec(cfg, kv_cache_dtype, block_size).ratios
    blocks = {m: num_slots * -(-(max_len // m) // block_size) for m in ratios}
    cache = allocate_v4_cache(cfg, num_slots, blocks, kv_cache_dtype, device, block_size, scratch)
    return StaticV4Cache(**vars(cache))
