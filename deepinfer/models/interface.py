"""The one interface the serving side programs against: every model class implements `CausalLM`.

Adding a model means a model file and a config file that provide these members; the worker
(worker/model_runner.py, worker/cuda_graph.py, worker/drafter.py), tensor parallelism
(distributed/tensor_parallel.py) and context parallelism (distributed/context_parallel.py) read
nothing else from a model, and name no class defined in deepinfer/models/ (tests/test_import_graph.py).
Capabilities are declared here (`drafting`, `tp_plan`, `supports_context_parallel`), never probed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer.state.forward_batch import ForwardBatch
from deepinfer.state.kv_state import LayerCache


class ConfigError(ValueError):
    """A config.json that deepinfer cannot run; the message names the key."""


class ModelConfig(Protocol):
    """The config members read outside deepinfer/models (the engine sizes replay and caches from
    config.json before a model is built)."""

    sliding_window: int
    compress_ratios: tuple[int, ...]
    num_nextn_predict_layers: int
    dspark_block_size: int | None  # tokens of one DSpark draft block; None: no DSpark draft


# Tensor-parallel split styles (TPSplit.style).
# HEAD_SPLIT: a module with the HeadSplitAttention members; rank r keeps query heads
# [r*H/tp, (r+1)*H/tp) (wq_b rows, attn_sink entries) and their grouped output projection (wo_a
# rows of the rank's groups, or with o_groups < tp its heads' wo_a input columns; wo_b columns).
HEAD_SPLIT = "heads"
# EXPERT_SPLIT: a layers/moe.py MoE; rank r keeps routed experts [r*E/tp, (r+1)*E/tp) (the router
# still picks among all E) and the shared expert's intermediate columns (w1 / w3 rows, w2 columns).
EXPERT_SPLIT = "experts"


@dataclass(frozen=True)
class TPSplit:
    """How tensor parallelism slices one module of the model (a named_modules() path)."""

    style: str   # HEAD_SPLIT or EXPERT_SPLIT
    # named_modules() path whose output is the rank's partial sum of the one-process value: it is
    # all-reduced over the TP group, after which every rank holds the same residual
    reduce: str


class HeadSplitAttention(Protocol):
    """The members of a HEAD_SPLIT module that tensor parallelism slices and rewrites: n_heads query
    heads of head_dim, projected by wq_b [n_heads * head_dim, .] with one attn_sink [n_heads] entry
    each; their outputs form o_groups groups, each projected by wo_a to o_rank, and wo_b
    [., o_groups * o_rank] sums the groups. The single KV head and everything else stays whole."""

    n_heads: int
    head_dim: int
    o_groups: int
    o_rank: int
    wq_b: torch.nn.Module
    wo_a: torch.nn.Module
    wo_b: torch.nn.Module
    attn_sink: torch.Tensor


@dataclass(frozen=True)
class Drafting:
    """A model's draft layers (the checkpoint's `mtp.*`) and which engine proposers its class runs.
    A proposer `m` runs iff m in proposers, kind == m and stages > 0 (`runs`)."""

    kind: str | None = None   # "dspark": a parallel block drafter; "mtp": one token per step; None: no draft layers
    stages: int = 0           # draft layers the model holds
    block_size: int = 0       # tokens one draft proposes (DSpark: dspark_block_size; MTP: 1; none: 0)
    # proposers the class implements: "dspark" -> SelfDrafting, "mtp" -> MTPDrafting (given any stages)
    proposers: frozenset[str] = field(default_factory=frozenset)

    def runs(self, method: str) -> bool:
        return method in self.proposers and self.kind == method and self.stages > 0

    @property
    def features(self) -> bool:
        """forward(draft_features=True) returns (states, target features) for the DSpark proposer."""
        return self.runs("dspark")


@runtime_checkable
class CausalLM(Protocol):
    config: Any  # ModelConfig and the model's own fields
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

    @property
    def supports_images(self) -> bool:
        """The checkpoint has a vision encoder: prompts may carry images (image_embeddings)."""

    @property
    def supports_context_parallel(self) -> bool:
        """forward(gather=...) runs one CP rank's rows of a step (distributed/context_parallel.py)."""

    @property
    def drafting(self) -> Drafting:
        """The draft layers this model holds and the proposers its class runs (worker/drafter.py)."""

    @property
    def needs_engram_vocab(self) -> bool:
        """set_engram_vocab must be given the tokenizer's compressed token map before the first forward."""

    def set_engram_vocab(self, token_map: list[int]) -> None:
        """Install the tokenizer's raw -> compressed token map (a model that reads none ignores it)."""

    def tp_plan(self) -> dict[str, TPSplit]:
        """named_modules() path -> its TPSplit, for every module tensor parallelism slices (trunk and
        draft layers); every other parameter stays whole on each rank. Empty: no tensor parallelism."""

    def forward(self, batch: ForwardBatch, caches: list[LayerCache], *, token_history: torch.Tensor | None = None,
                draft_features: bool = False, gather=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token states [T, ...] that compute_logits maps to logits; with draft_features (only where
        drafting.features) the pair (states, target features [T, F]) the DSpark proposer stores. `gather`:
        this CP rank's rows -> the whole step's rows (only where supports_context_parallel)."""

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """States of N tokens -> fp32 logits [N, vocab]."""

    def image_embeddings(self, image) -> torch.Tensor:
        """Embeddings of one image's whole token span (ValueError for a model without vision)."""


@dataclass
class DraftBlock:
    tokens: torch.Tensor       # [B, block] drafts for positions p+1 .. p+block (greedy unless a `pick` drew them)
    logits: torch.Tensor       # [B, block, V] the logits each draft was picked from
    confidence: torch.Tensor   # [B, block] P(draft i accepted | drafts < i accepted)
    probs: torch.Tensor | None = None  # [B, block, V] the distribution each draft was drawn from (None: greedy)


@runtime_checkable
class SelfDrafting(Protocol):
    """A model whose own draft stages the engine can run as its proposer (V4.1's DSpark; declared by
    "dspark" in Drafting.proposers): the forward's `draft_features=True` also returns the target
    features, whose context KV the model stores into its draft stages' rings and drafts from."""

    def store_draft_context(self, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                            rings: list) -> None:
        """features [N, F] at positions [N] -> each draft stage's context KV in its ring (rings[s]) at rows [N]."""

    def draft_from_cache(self, rings: list, ctx_rows: torch.Tensor, ctx_valid: torch.Tensor,
                         anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, pick=None) -> DraftBlock:
        """One draft block per anchor (the newest token and its position), its context read at ctx_rows [B, C].
        `pick(logits [B, V]) -> tokens [B]` chooses each position's draft (None: the argmax), which the next
        position's Markov head reads."""


@runtime_checkable
class MTPDrafting(Protocol):
    """A model whose multi-token-prediction layer (V4's `mtp.0`) the engine can run as its proposer
    (declared by "mtp" in Drafting.proposers): after verification, over every row of the step's batch with
    the trunk's plan, then chained on its own output for each further draft token."""

    def mtp_draft(self, batch: ForwardBatch, streams: torch.Tensor, next_ids: torch.Tensor,
                  anchor_rows: torch.Tensor, cache: LayerCache) -> tuple[DraftBlock, torch.Tensor]:
        """The MTP layer over all rows of `batch` (trunk streams [T, ...] at t, next_ids [T] the token at
        t + 1), writing its window ring in `cache`: (a one-token DraftBlock for each of anchor_rows [G], the
        layer's output streams at those rows)."""

    def mtp_chain(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                  cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained MTP step, one row per draft: the layer's previous output streams [G, ...] stand in for
        the trunk's, next_ids [G] the newest draft, at `batch`'s positions (writing their window keys) ->
        (fp32 logits [G, vocab] of the token after next_ids, the layer's output streams)."""
