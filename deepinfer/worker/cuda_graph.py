"""CUDA graphs for pure-decode steps (one new token per request).

A graph is captured per (padded batch size, entry-width buckets): the batch is padded with
dummy requests that own the cache's scratch slot, every token gets a compressor row
(FixedShape), and entry tables are rounded up to a power of two (at least `visible_bucket`). Replays copy the
step's planned tensors into the captured ones, so the model's launches cost one graph launch.
"""
from __future__ import annotations

import dataclasses

import torch

from deepinfer.layers.forward_batch import FixedShape, ForwardBatch, SeqChunk, build_forward_batch
from deepinfer.worker.kv_cache import V4Cache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _tensors(obj, prefix=""):
    """(name, tensor) of every tensor in a ForwardBatch, its plans included, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{prefix}.{f.name}")
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _tensors(obj[k], f"{prefix}[{k}]")


class DecodeGraphs:
    def __init__(self, model, cache: V4Cache, scratch_slot: int, scratch_addr: dict[int, int],
                 visible_bucket: int = 64, batch_buckets: tuple[int, ...] = BATCH_BUCKETS, device: str = "cuda"):
        self.model, self.cache, self.device = model, cache, device
        self.scratch_slot, self.scratch_addr = scratch_slot, scratch_addr
        self.visible_bucket, self.batch_buckets = visible_bucket, batch_buckets
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]] = {}
        self.pool = None

    def plan(self, chunks: list[SeqChunk]) -> tuple[tuple, ForwardBatch]:
        """(graph key, fixed-shape batch) of a pure-decode step, padded with scratch requests."""
        B = len(chunks)
        padded = next(b for b in self.batch_buckets if b >= B)
        dummy = SeqChunk(self.scratch_slot, 0, [0], {m: [] for m in self.scratch_addr})
        chunks = chunks + [dummy] * (padded - B)
        # entry widths round up to a power of two (>= visible_bucket): O(log context) graphs per batch size
        need = {m: max((c.start + 1) // m for c in chunks) for m in self.scratch_addr}
        visible = {m: max(self.visible_bucket, 1 << max(n - 1, 0).bit_length()) for m, n in need.items()}
        fixed = FixedShape(self.scratch_addr, visible)
        cfg = self.model.config
        batch = build_forward_batch(chunks, cfg.sliding_window, self.cache.compress_kinds, self.cache.block_size,
                                    self.device, fixed=fixed)
        return (padded, tuple(sorted(visible.items()))), batch

    def fits(self, num_requests: int) -> bool:
        return num_requests <= self.batch_buckets[-1]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step eagerly (what a graph captures): logits of every (padded) row."""
        return self.model.compute_logits(self.model(batch, self.cache.layers)[batch.logits_idx])

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] of a pure-decode step (each chunk one token)."""
        if any(len(c.token_ids) != 1 for c in chunks):
            raise ValueError("DecodeGraphs runs pure-decode steps only (one token per request)")
        key, batch = self.plan(chunks)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(batch)
            self.graphs[key] = entry
        else:
            for (_, dst), (_, src) in zip(_tensors(entry[1]), _tensors(batch)):
                dst.copy_(src, non_blocking=True)
        graph, _, out = entry
        graph.replay()
        return out[:len(chunks)]

    def _capture(self, batch: ForwardBatch):
        """Warm up on a side stream (the cache rows written belong to this very step, so the
        repeated writes are idempotent), then capture the step's launches."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(batch)
        return graph, batch, out
