"""DSpark as the engine's proposer (DeepSeek-V4.1's draft stages `mtp.0..2`, through the model's
SelfDrafting interface: models/interface.py).

State: each stage's context KV lives in that stage's window ring of the cache (V4Cache.mtp[s].ring), at
the trunk's ring geometry (row = slot * (W + ring_slack) + pos % (W + ring_slack)). Every step stores the
context KV of the positions the trunk's window ring keeps (ForwardBatch.ring_src / ring_dst) from the
step's target features, so a draft reads its W context positions from the rings and never recomputes
them. Positions of rejected drafts are written too and rewritten when recomputed (the ring slack keeps
them from overwriting positions still read).

A draft starts at each sampled request's anchor: the last token the step emitted and its position (both
on the device, after verification). Drafts are the stages' greedy tokens (deterministic: verification
reads them as one-hot, exact for every sampling setting).
"""
from __future__ import annotations

import torch

from deepinfer.models.interface import DraftBlock, SelfDrafting
from deepinfer.state.forward_batch import ForwardBatch
from deepinfer.worker.kv_cache import V4Cache


class DSparkDrafter:
    def __init__(self, model, cache: V4Cache, num_tokens: int):
        block = getattr(model.config, "dspark_block_size", None)
        if not isinstance(model, SelfDrafting):
            raise ValueError(f"speculative_config.method 'dspark': {type(model).__name__}'s draft stages do not run "
                             "as a proposer yet (DeepSeek-V4.1's do)")
        if getattr(model, "mtp", None) is None or not block:
            raise ValueError("speculative_config.method 'dspark': this checkpoint has no DSpark draft stages")
        if not 1 <= num_tokens <= block:
            raise ValueError(f"speculative_config.num_speculative_tokens: {num_tokens} is not in 1 .. the draft "
                             f"block ({block})")
        self.model, self.num_tokens = model, num_tokens
        self.rings = [c.ring for c in cache.mtp]
        self.window = model.config.sliding_window
        self.size = self.window + cache.ring_slack

    def store_context(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        """features [T, len(targets) * D] of the step's tokens -> the stages' rings, at the rows the trunk's
        window ring keeps."""
        src = batch.ring_src
        if src.numel():
            self.model.store_draft_context(features[src], batch.positions[src], batch.ring_dst, self.rings)

    def draft(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, slots: torch.Tensor) -> DraftBlock:
        """One block per anchor ([G] tokens, positions and slots, on the device): context = the W positions
        before the anchor (masked below 0)."""
        pos = anchor_pos[:, None] - self.window + torch.arange(self.window, device=anchor_pos.device)
        rows = slots[:, None] * self.size + pos.clamp(min=0) % self.size
        return self.model.draft_from_cache(self.rings, rows, pos >= 0, anchor_tokens, anchor_pos)
