"""Request: one sequence being generated, and the counters the scheduler works from."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deepinfer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted: its state was freed, it will recompute)
    RUNNING = "running"      # owns a slot and blocks
    FORKING = "forking"      # n > 1 sibling: waits for its leader's prompt prefill, then copies it
    FINISHED = "finished"    # stopped, hit its length, or aborted (finish_reason says which)


@dataclass(eq=False)  # identity: `req in running` / `remove` would otherwise compare every field of every request
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # tokens whose state is in the cache; everything at or after this index still needs computing
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # why the request was aborted
    slot: int | None = None
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    siblings: list["Request"] = field(default_factory=list)  # n > 1: forks waiting on this leader
    images: list[tuple[int, Any]] = field(default_factory=list)  # (span start, preprocessed image)
    sample_index: int = 0  # j of the prompt's n samples (0 = the leader)
    # the model's drafts for the tokens after the pending one (a model-based proposer; verified next step)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_confidence: list[float] = field(default_factory=list)  # each draft's P(accepted | earlier accepted)
    # the confidences of the drafts the request verified last (two steps older than the drafts it verifies next):
    # what the graphs' verify-length policy reads (spec/schedule.py uniform_length)
    stale_confidence: list[float] = field(default_factory=list)
    # structured outputs (so_args): its grammar matcher (structured/backend.py RequestGrammar), advanced
    # by every token the request emits; None when unconstrained
    grammar: Any = None
    # SamplingParams.prompt_logprobs (the leader only): one entry per prompt position, filled as prefill computes them
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # and each prompt token's rank

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the whole prompt + outputs again after a preemption)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
