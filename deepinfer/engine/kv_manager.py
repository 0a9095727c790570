"""CPU-side owner of the hybrid cache's capacity: request slots and per-ratio entry blocks.

A running request holds one slot (its window ring + compressor carry rows) and, for each
compressor ratio m, enough blocks for the entries its computed tokens have closed:
ceil((tokens // m) / block_size). Invariant: for every pool, free + held == total.

The block tables are also kept as arrays with a row per slot (`tables[m][slot]`: the slot's request's
ratio-m blocks in order, zeros after the first `table_len[m][slot]`; a free slot's row is all zeros),
updated in place as blocks are granted and freed, so a decode step's tables are one fancy index
(Scheduler.schedule_ahead's DecodeRows) instead of a walk over the requests' lists.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from deepinfer.engine.request import Request

TABLE_WIDTH = 16  # initial columns of the table arrays (doubled as a request needs more blocks)


class KVCacheManager:
    def __init__(self, num_slots: int, num_blocks: dict[int, int], block_size: int):
        self.num_slots, self.num_blocks, self.block_size = num_slots, dict(num_blocks), block_size
        self.free_slots: deque[int] = deque(range(num_slots))
        self.free_blocks: dict[int, deque[int]] = {m: deque(range(n)) for m, n in num_blocks.items()}
        self.tables: dict[int, np.ndarray] = {m: np.zeros((num_slots, TABLE_WIDTH), dtype=np.int64)
                                              for m in num_blocks}
        self.table_len: dict[int, np.ndarray] = {m: np.zeros(num_slots, dtype=np.int64) for m in num_blocks}

    def blocks_for(self, num_tokens: int) -> dict[int, int]:
        return {m: -(-(num_tokens // m) // self.block_size) for m in self.num_blocks}

    def fits_alone(self, num_tokens: int) -> bool:
        """Could a single request of this many tokens ever be held (with the cache otherwise empty)?"""
        return self.num_slots > 0 and all(n <= self.num_blocks[m] for m, n in self.blocks_for(num_tokens).items())

    def max_model_len(self, requested: int | None, model_max: int, budget: str) -> int:
        """The requested length (one request of it must fit), or the longest up to `model_max` that fits.
        `budget` says what the cache was sized from, for the errors ("16777216 bytes")."""
        if requested is not None:
            if not self.fits_alone(requested):
                raise ValueError(f"max_model_len: {requested} tokens do not fit in a cache of {budget} "
                                 f"({self.num_slots} slots, blocks {self.num_blocks}); raise kv_cache_memory")
            return requested
        lo, hi = 1, model_max
        while lo < hi:  # fits_alone is monotone in the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits_alone(mid) else (lo, mid - 1)
        if not self.fits_alone(lo):
            raise ValueError(f"kv_cache_memory: a cache of {budget} ({self.num_slots} slots, "
                             f"blocks {self.num_blocks}) cannot hold a single request")
        return lo

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow `req`'s holdings to cover `num_tokens` computed tokens; all or nothing."""
        if req.slot is not None:  # steady decode: the tables already cover it (no block boundary crossed)
            tables, bs = req.block_tables, self.block_size
            for m in self.num_blocks:
                if num_tokens // m > len(tables.get(m, ())) * bs:
                    break
            else:
                return True
        need = {m: n - len(req.block_tables.get(m, [])) for m, n in self.blocks_for(num_tokens).items()}
        if req.slot is None and not self.free_slots:
            return False
        if any(n > len(self.free_blocks[m]) for m, n in need.items()):
            return False
        if req.slot is None:
            req.slot = self.free_slots.popleft()
        for m, n in need.items():
            table = req.block_tables.setdefault(m, [])
            if n > 0:
                old = len(table)
                table.extend(self.free_blocks[m].popleft() for _ in range(n))
                self._set_row(m, req.slot, old, table[old:])
        return True

    def crossing(self, slots: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        """[B] whether growing slot b's request to num_tokens[b] computed tokens needs a block it does not hold
        (`allocate`'s test, on the arrays: where it is False, allocate would return at once)."""
        out = np.zeros(len(slots), dtype=bool)
        for m, lens in self.table_len.items():
            out |= num_tokens // m > lens[slots] * self.block_size
        return out

    def table_rows(self, slots: np.ndarray) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """(ratio -> [B, width] these slots' tables, ratio -> [B] their lengths): copies, cut to the longest of
        them and at least one column wide (the arrays' width is the longest table any slot has held)."""
        lens = {m: t[slots] for m, t in self.table_len.items()}
        return {m: t[slots, :max(1, int(lens[m].max(initial=0)))] for m, t in self.tables.items()}, lens

    def _set_row(self, m: int, slot: int, first: int, blocks: list[int]) -> None:
        arr, end = self.tables[m], first + len(blocks)
        if end > arr.shape[1]:
            wide = np.zeros((arr.shape[0], max(end, 2 * arr.shape[1])), dtype=np.int64)
            wide[:, :arr.shape[1]] = arr
            arr = self.tables[m] = wide
        arr[slot, first:end] = blocks
        self.table_len[m][slot] = end

    def free(self, req: Request) -> None:
        for m, table in req.block_tables.items():
            self.free_blocks[m].extend(table)
            if req.slot is not None:
                self.tables[m][req.slot, :len(table)] = 0
                self.table_len[m][req.slot] = 0
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None
        req.block_tables = {}

    def num_free(self) -> tuple[int, dict[int, int]]:
        return len(self.free_slots), {m: len(q) for m, q in self.free_blocks.items()}

    def all_free(self) -> bool:
        slots, blocks = self.num_free()
        return slots == self.num_slots and blocks == self.num_blocks


def plan_capacity(memory_bytes: int, slot_bytes: int, block_bytes: dict[int, int], block_size: int,
                  max_num_seqs: int, expected_len: int) -> tuple[int, dict[int, int]]:
    """Split a byte budget into request slots and per-ratio blocks.

    As many slots as max_num_seqs allows while each still comes with blocks for an
    `expected_len`-token request; the rest of the budget buys blocks so that every ratio can
    hold the same number of tokens (ratio m spends block_bytes[m] per block_size * m tokens)."""
    per_token = sum(b / (block_size * m) for m, b in block_bytes.items())
    per_request = slot_bytes + expected_len * per_token
    num_slots = max(1, min(max_num_seqs, int(memory_bytes // per_request)))
    tokens = max(0, memory_bytes - num_slots * slot_bytes) / per_token if per_token else 0
    return num_slots, {m: int(tokens // (block_size * m)) for m in block_bytes}
