"""The one interface the worker programs against: every model class implements `CausalLM`.

Adding a model means a model file and a config file that provide these members; the worker
(worker/model_runner.py, worker/cuda_graph.py) reads nothing else from a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer.state.forward_batch import ForwardBatch
from deepinfer.state.kv_state import LayerCache


@runtime_checkable
class CausalLM(Protocol):
    config: Any
    dtype: torch.dtype

    @property
    def replay_layer(self) -> int:
        """SWA bounded replay keeps only the last rows above this layer; -1: the model has no cut."""

    @property
    def token_history(self) -> int:
        """Input tokens each position reads, itself included (V4.1 Engram's n-gram window); 0: none.
        The cache keeps a ring of each request's last token_history input tokens (V4Cache.token_history)."""

    @property
    def host_inputs(self) -> bool:
        """Per-step inputs are computed from token values on the host: the step cannot take
        placeholder inputs (async scheduling) and cannot be captured as a graph."""

    @property
    def supports_graphs(self) -> bool:
        """Pure-decode steps may be captured as CUDA graphs (no host values and no host syncs)."""

    @staticmethod
    def compressed_kinds(cfg) -> list[tuple[int, bool]]:
        """(ratio, overlapped) of every layer that owns compressed entries (paged per ratio)."""

    @staticmethod
    def cache_layout(cfg, num_slots: int, num_blocks: dict[int, int], block_size: int, kv_cache_dtype: str,
                     device, ring_slack: int = 0) -> tuple[list[LayerCache], list[LayerCache]]:
        """(trunk layers' caches, draft layers' caches) in the stores and formats kv_cache_dtype names.
        Every per-slot ring (window keys, compressor carries; the draft layers' too) has `ring_slack`
        rows per slot more than its reads need, addressed as state/forward_batch.py plans with the same
        ring_slack (row slot * size + pos % size); paged stores do not change."""

    def forward(self, batch: ForwardBatch, caches: list[LayerCache],
                token_history: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token states [T, ...] that compute_logits maps to logits."""

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """States of N tokens -> fp32 logits [N, vocab]."""

    def image_embeddings(self, image) -> torch.Tensor:
        """Embeddings of one image's whole token span (ValueError for a model without vision)."""


@dataclass
class DraftBlock:
    tokens: torch.Tensor       # [B, block] greedy drafts for positions p+1 .. p+block
    logits: torch.Tensor       # [B, block, V] the logits each draft was picked from
    confidence: torch.Tensor   # [B, block] P(draft i accepted | drafts < i accepted)


@runtime_checkable
class SelfDrafting(Protocol):
    """A model whose own draft stages the engine can run as its proposer (V4.1's DSpark): the
    forward's `draft_features=True` also returns the target features, whose context KV the model
    stores into its draft stages' rings and drafts from."""

    def store_draft_context(self, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                            rings: list) -> None:
        """features [N, F] at positions [N] -> each draft stage's context KV in its ring (rings[s]) at rows [N]."""

    def draft_from_cache(self, rings: list, ctx_rows: torch.Tensor, ctx_valid: torch.Tensor,
                         anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor) -> DraftBlock:
        """One draft block per anchor (the newest token and its position), its context read at ctx_rows [B, C]."""


@runtime_checkable
class MTPDrafting(Protocol):
    """A model whose multi-token-prediction layer (V4's `mtp.0`) the engine can run as its proposer, one
    draft token per step: after verification, over every row of the step's batch with the trunk's plan."""

    def mtp_draft(self, batch: ForwardBatch, streams: torch.Tensor, next_ids: torch.Tensor,
                  anchor_rows: torch.Tensor, cache: LayerCache) -> DraftBlock:
        """The MTP layer over all rows of `batch` (trunk streams [T, ...] at t, next_ids [T] the token at
        t + 1), writing its window ring in `cache`; a one-token DraftBlock for each of anchor_rows [G]."""
