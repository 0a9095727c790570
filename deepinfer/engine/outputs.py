"""What crosses engine -> worker (SchedulerOutput) and back (ModelOutput), and what users get."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepinfer.sampling_params import SamplingParams


@dataclass(eq=False)  # never changed once scheduled; not frozen: a frozen one costs 3.2 us to build against 1.0
class ScheduledChunk:
    """Tokens of one request computed this step. If `num_samples` > 0 the chunk reaches the
    end of the request's tokens and that many tokens are sampled from its last position."""

    request_id: str
    slot: int
    start: int
    token_ids: list[int]
    block_tables: dict[int, list[int]]
    num_samples: int = 0
    params: SamplingParams | None = None
    prev_tokens: list[int] = field(default_factory=list)  # up to CONTEXT_TOKENS tokens before `start`
    num_tokens: int = 0  # the request's length when scheduled (prompt + outputs so far)
    images: list[tuple[int, Any]] = field(default_factory=list)  # image spans near this chunk
    sample_index: int = 0  # which of the prompt's n samples the request is (keys seeded sampling)
    # speculative decoding: the last num_draft token_ids are draft tokens; the last num_draft + 1 positions
    # are verified (worker/verify.py) and the request receives its accepted drafts plus one target token
    num_draft: int = 0
    # the token after the chunk's last one when the chunk stops short of the request's end (a prompt's
    # next chunk starts with it; -1 otherwise): V4's MTP layer reads each position's next token
    next_token: int = -1
    # structured outputs: the request's grammar state (structured/backend.py RequestGrammar); the runner
    # masks the logits of the chunk's sampled (and verified) positions by it
    grammar: Any = None
    # prompt_logprobs: the chunk's first `prompt_rows` rows give the logprobs of the prompt tokens at positions
    # start + 1 .. start + prompt_rows (0: none; never the row that samples)
    prompt_rows: int = 0
    # the request's prompt length: positions before it are prompt, from it on outputs (what the penalties and
    # min_tokens count, worker/logits_processors.py)
    prompt_len: int = 0


# input token of a chunk scheduled ahead (async scheduling): the token its request samples in the step
# before, filled in on the device by the runner
PLACEHOLDER = -1

# tokens of context shipped with every chunk (V4.1 Engram hashes the 3 tokens before each position)
CONTEXT_TOKENS = 7


@dataclass(frozen=True)
class ForkOp:
    """Copy a leader's state into a sibling's slot and blocks, before this step's forward."""

    src_slot: int
    dst_slot: int
    src_blocks: dict[int, list[int]]
    dst_blocks: dict[int, list[int]]


@dataclass(frozen=True)
class DecodeRows:
    """A pure-decode step as arrays, row b = the step's chunk b (one token each, sampled once): what the
    decode-graph planner reads instead of the chunks (state/decode_plan.py)."""

    tokens: np.ndarray    # [B] int64 input token (PLACEHOLDER: filled on the device)
    slots: np.ndarray     # [B] int64
    positions: np.ndarray  # [B] int64 the token's position (= the chunk's start)
    # ratio m -> [B, width >= 1] int64 the requests' block tables, zero past table_len[m] (KVCacheManager.tables rows;
    # the decode graphs put the scratch block in column 0 of their padding rows)
    tables: dict[int, np.ndarray]
    table_len: dict[int, np.ndarray]  # ratio m -> [B] int64


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    forks: list[ForkOp] = field(default_factory=list)
    decode: DecodeRows | None = None  # set on pure-decode steps planned from the cache manager's arrays
    # speculative decoding: whether the model's drafter proposes the next step's drafts (False: the scheduler's
    # verify-length policy found that the next step would not verify any; a drafter whose own state needs every
    # step, V4's MTP layer, runs regardless)
    propose: bool = True
    # async scheduling with a drafter (Scheduler._verify_ahead): every chunk verifies the drafts the step launched
    # before proposes, its tokens PLACEHOLDERs and its `start` the earliest one; the runner reads the tokens and
    # adds the accepted count of that step on the device
    verify_ahead: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class ModelOutput:
    """Per sampled request: its sampled tokens and, when asked, one logprob dict per token. A verify
    chunk's request gets its accepted draft tokens and the target's token (accepted = len - 1)."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # the model's drafts for the next step
    draft_confidence: dict[str, list[float]] = field(default_factory=dict)  # and their confidences
    # request id -> (first position, one logprob dict per prompt position from it on) of its chunk's prompt_rows
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    prompt_ranks: dict[str, list[int]] = field(default_factory=dict)  # and each prompt token's rank (1-based)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # with finish_reason "abort": what failed


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # SamplingParams.prompt_logprobs: per prompt position, {token id: logprob} of the prompt token and the top-k
    # (None at position 0, which nothing predicts); None when not asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # with prompt_logprobs: each prompt token's rank in the raw distribution (1-based, vLLM's count; None at 0)
    prompt_logprob_ranks: list[int | None] | None = None
