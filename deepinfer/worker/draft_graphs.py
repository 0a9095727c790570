"""CUDA graphs of a drafter's block (worker/drafter.py DSparkDrafter.draft): one graph per padded anchor
count (the decode graphs' batch buckets).

Inputs are three static device vectors (anchor tokens, positions, slots) filled by device-to-device copies,
so a draft costs three copies and one replay and never waits for the host. Rows past the anchors hold
what earlier replays left there (at capture: token 0 at position 0 of the cache's scratch slot, a context
wholly before position 0, masked): the draft only reads the cache, so such rows compute an unused block
and change no state. The outputs are the captured block's tensors, valid until the next replay.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.interface import DraftBlock
from deepinfer.worker.cuda_graph import BATCH_BUCKETS


class DraftGraphs:
    def __init__(self, draft: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], DraftBlock], scratch_slot: int,
                 device: torch.device | str, buckets: tuple[int, ...] = BATCH_BUCKETS):
        """`draft(tokens, positions, slots)` -> DraftBlock of one anchor per row, on the device, without a host
        sync and without writing the cache."""
        self.draft, self.scratch_slot, self.device, self.buckets = draft, scratch_slot, torch.device(device), buckets
        # padded anchors -> (graph, (tokens, positions, slots) inputs, the block it writes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], DraftBlock]] = {}
        self.pool = None

    def fits(self, num_anchors: int) -> bool:
        return num_anchors <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> DraftBlock:
        n = tokens.shape[0]
        padded = next(b for b in self.buckets if b >= n)
        entry = self.graphs.get(padded)
        if entry is None:
            entry = self.graphs[padded] = self._capture(padded)
        graph, inputs, out = entry
        for dst, src in zip(inputs, (tokens, positions, slots)):
            dst[:n].copy_(src)
        graph.replay()
        return DraftBlock(out.tokens[:n], out.logits[:n], out.confidence[:n])

    def capture_buckets(self, max_anchors: int) -> int:
        """Captures the graph of every bucket up to `max_anchors` not yet held. -> the graphs captured."""
        top = next((b for b in self.buckets if b >= max_anchors), self.buckets[-1])
        todo = [b for b in self.buckets if b <= top and b not in self.graphs]
        for b in todo:
            self.graphs[b] = self._capture(b)
        return len(todo)

    def _capture(self, padded: int):
        long = dict(dtype=torch.long, device=self.device)
        inputs = (torch.zeros(padded, **long), torch.zeros(padded, **long),
                  torch.full((padded,), self.scratch_slot, **long))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (lazy initialisations, kernel compiles)
            self.draft(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.draft(*inputs)
        return graph, inputs, out
