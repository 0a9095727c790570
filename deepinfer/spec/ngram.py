"""Prompt-lookup drafts (vLLM's speculative method "ngram"): the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max]
that occurs earlier. Host-only (numpy); the drafts are deterministic, so verification treats the draft
distribution as one-hot at each draft token (worker/verify.py, draft_probs=None).

Also the host-side stand-in for the model's own draft stages (ModelDrafts) and the speculation counters
the engine reports (vLLM's metric names).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    method: ClassVar[str] = "ngram"
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name}: must be a positive integer, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is greater than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens to follow `token_ids` ([] when no
        n-gram of the allowed sizes recurs)."""
        k = min(self.num_speculative_tokens, max_tokens)
        ids = np.asarray(token_ids, dtype=np.int64)
        L = ids.shape[0]
        if k <= 0:
            return []
        for n in range(min(self.prompt_lookup_max, L - 1), self.prompt_lookup_min - 1, -1):
            # windows starting at 0 .. L-1-n: each has a following token and is not the suffix itself
            hits = np.flatnonzero((sliding_window_view(ids[:L - 1], n) == ids[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []


@dataclass(frozen=True)
class ModelDrafts:
    """A proposer that runs on the device inside the model step (the checkpoint's own draft stages,
    worker/drafter.py): the engine core only carries each request's drafts from one step to the next."""

    method: str
    num_speculative_tokens: int


@dataclass
class SpecStats:
    """Cumulative since start-up: verify steps with at least one draft token (num_drafts), draft tokens
    proposed and accepted, and how often each draft position was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # drafts that reached position i (verified that far): accepted_per_position[i] / drafted_per_position[i]
    # is position i's acceptance rate, whatever the drafts' lengths
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for counts in (self.accepted_per_position, self.drafted_per_position):
            if len(counts) < drafted:
                counts += [0] * (drafted - len(counts))
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    def as_dict(self) -> dict:
        """vLLM's names; mean_acceptance_length counts the target's own token too (1 + accepted per draft)."""
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens,
                    accepted_per_position=list(self.accepted_per_position),
                    drafted_per_position=list(self.drafted_per_position), mean_acceptance_length=mean)
