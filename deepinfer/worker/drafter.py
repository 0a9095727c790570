"""The model's own draft layers as the engine's proposer: DSpark (DeepSeek-V4.1's draft stages `mtp.0..2`,
through the model's SelfDrafting interface: models/interface.py) and V4's MTP layer (`mtp.0`, MTPDrafting).
Which of them a model runs, its draft stages and block size are what it declares (CausalLM.drafting).

The runner drives both through one hook pair: `observe(chunks, batch, streams, features)` after the trunk
forward (before verification) and `propose(anchors)` after it, on the device (no host sync); `propose`
returns the next step's DraftBlock of the anchors, or None when there are none.

DSpark:

State: each stage's context KV lives in that stage's window ring of the cache (V4Cache.mtp[s].ring), at
the trunk's ring geometry (row = slot * (W + ring_slack) + pos % (W + ring_slack)). Every step stores the
context KV of the positions the trunk's window ring keeps (ForwardBatch.ring_src / ring_dst) from the
step's target features, so a draft reads its W context positions from the rings and never recomputes
them. Positions of rejected drafts are written too and rewritten when recomputed (the ring slack keeps
them from overwriting positions still read).

A draft starts at each sampled request's anchor: the last token the step emitted and its position (both
on the device, after verification). Drafts are the stages' greedy tokens (deterministic: verification
reads them as one-hot, exact for every sampling setting), except for the rows of a DraftSampler, drawn from
the drafter's own filtered distribution q (kept for verification's rejection test). With `graphs` set
(worker/draft_graphs.py), a greedy block replays a CUDA graph per padded anchor count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.outputs import ScheduledChunk
from deepinfer.kernels.row_argmax import row_argmax
from deepinfer.models.interface import CausalLM, DraftBlock
from deepinfer.state.forward_batch import ForwardBatch, single_token_batch, to_device
from deepinfer.worker.kv_cache import V4Cache
from deepinfer.worker.sampler import SamplingBatch, filtered_probs, race, race_noise


class DraftSampler:
    """Picks each draft position's tokens (a DSpark block's `pick`): rows at temperature 0 take the argmax, the
    others draw from q = sampler.filtered_probs of the drafter's logits with their request's temperature and
    top-k / top-p / min-p, with noise from `generator` (drawn before the verifying step draws its own: the two
    are independent, as rejection sampling needs). `probs` collects each position's q [B, V]."""

    def __init__(self, sb: SamplingBatch, generator: torch.Generator | None):
        self.sb, self.generator, self.probs = sb, generator, []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        q = filtered_probs(logits.float(), self.sb)
        self.probs.append(q)
        drawn = race(q, race_noise(q, self.sb, self.generator))
        return torch.where(self.sb.temperature == 0, row_argmax(logits), drawn)


@dataclass
class Anchors:
    """Each drafting request's anchor after verification, on the device ([G] each): the last token the step
    emitted for it, that token's position, its slot, and the step's flat row that computed it (the row of
    its last accepted position, one before `pos`). `sampler`: the rows that draw their drafts (None: all
    greedy)."""

    tokens: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    sampler: DraftSampler | None = None


class DSparkDrafter:
    needs_features = True  # the trunk forward also returns the target features (draft_features=True)
    optional = True  # a step may skip `propose` (SchedulerOutput.propose): the context is stored in `observe`

    def __init__(self, model: CausalLM, cache: V4Cache, num_tokens: int):
        drafting = model.drafting
        if "dspark" not in drafting.proposers:
            raise ValueError(f"speculative_config.method 'dspark': {type(model).__name__}'s draft stages do not run "
                             "as a proposer")
        if not drafting.runs("dspark") or not drafting.block_size:
            raise ValueError("speculative_config.method 'dspark': this checkpoint has no DSpark draft stages")
        block = drafting.block_size
        if not 1 <= num_tokens <= block:
            raise ValueError(f"speculative_config.num_speculative_tokens: {num_tokens} is not in 1 .. the draft "
                             f"block ({block})")
        self.model, self.num_tokens = model, num_tokens
        self.rings = [c.ring for c in cache.mtp]
        self.window = model.config.sliding_window
        self.size = self.window + cache.ring_slack
        self.graphs = None  # a DraftGraphs over `draft`, set by the runner when it replays graphs

    def store_context(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        """features [T, len(targets) * D] of the step's tokens -> the stages' rings, at the rows the trunk's
        window ring keeps."""
        src = batch.ring_src
        if src.numel():
            self.model.store_draft_context(features[src], batch.positions[src], batch.ring_dst, self.rings)

    def observe(self, chunks: list[ScheduledChunk], batch: ForwardBatch, streams: torch.Tensor,
                features: torch.Tensor) -> None:
        self.store_context(batch, features)

    def propose(self, anchors: Anchors) -> DraftBlock | None:
        n = anchors.tokens.numel()
        if not n:
            return None
        if anchors.sampler is not None:  # (eager: the sampled rows' noise is drawn per step)
            block = self.draft(anchors.tokens, anchors.pos, anchors.slots, anchors.sampler)
            block.probs = torch.stack(anchors.sampler.probs, 1)
            return block
        if self.graphs is not None and self.graphs.fits(n):
            return self.graphs.run(anchors.tokens, anchors.pos, anchors.slots)
        return self.draft(anchors.tokens, anchors.pos, anchors.slots)

    def draft(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, slots: torch.Tensor,
              pick=None) -> DraftBlock:
        """One block per anchor ([G] tokens, positions and slots, on the device): context = the W positions
        before the anchor (masked below 0). `pick`: see DraftSampler (None: greedy)."""
        pos = anchor_pos[:, None] - self.window + torch.arange(self.window, device=anchor_pos.device)
        rows = slots[:, None] * self.size + pos.clamp(min=0) % self.size
        return self.model.draft_from_cache(self.rings, rows, pos >= 0, anchor_tokens, anchor_pos, pick)


class MTPDrafter:
    """V4's MTP layer (`mtp.0`: trunk streams at t + the embedding of token t + 1 -> logits for t + 2), k draft
    tokens a step (chained for k > 1, below).

    State: the MTP layer's own window ring (V4Cache.mtp[0].ring, the trunk's ring geometry). Every position
    goes through the MTP layer once with its true next token, so the ring holds the layer's own keys for
    the window: each step runs it over all rows of the step's batch (the trunk's plan) after verification,
    with next_ids = the step's input ids shifted by one within each chunk, where
      - a sampling chunk's anchor row (its last accepted position) takes the token the step emitted there
        (a device scatter); rows past it are rejected positions, whose ring writes land in slack rows and
        are recomputed with the positions;
      - a prefill chunk that does not reach the end of its request takes the chunk's `next_token` (the
        first token of the request's next chunk, known to the scheduler);
      - an n > 1 fork's last prompt row takes the next chunk's first row (its siblings' tokens differ:
        their drafts are less likely accepted there; verification keeps outputs exact regardless).
    The draft of each anchor is the argmax of the MTP logits at its row (greedy, deterministic:
    verification reads it as one-hot); its confidence is that token's softmax probability.

    For k > 1 the layer is chained on the device: draft i + 1 comes from the layer at the anchor's position
    + i, with its own output streams of the step before standing in for the trunk's and draft i as the next
    token (state/forward_batch.py single_token_batch plans it from the device positions). Its window keys go
    to the ring at positions the next step computes again (within the ring slack, as rejected drafts').
    """

    needs_features = False
    optional = False  # `propose` writes the MTP layer's ring: every step runs it

    def __init__(self, model: CausalLM, cache: V4Cache, num_tokens: int):
        if not model.drafting.runs("mtp"):
            raise ValueError("speculative_config.method 'mtp': this checkpoint has no MTP layer (V4's mtp.0; "
                             "DSpark draft stages use method 'dspark')")
        if num_tokens < 1 or num_tokens > cache.ring_slack:
            raise ValueError(f"speculative_config.num_speculative_tokens: {num_tokens} is not in 1 .. the cache's "
                             f"ring slack ({cache.ring_slack})")
        self.model, self.num_tokens = model, num_tokens
        self.cache = cache.mtp[0]
        self.window = model.config.sliding_window
        self.ring = self.window + cache.ring_slack
        self._step: tuple[ForwardBatch, torch.Tensor, torch.Tensor] | None = None

    def observe(self, chunks: list[ScheduledChunk], batch: ForwardBatch, streams: torch.Tensor,
                features: torch.Tensor | None) -> None:
        """Holds the batch and each row's next token (as far as the host knows it) for `propose`."""
        next_ids = torch.roll(batch.input_ids, -1)
        ends = [c.next_token for c in chunks if c.next_token >= 0]
        if ends:
            rows, off = [], 0
            for c in chunks:
                off += len(c.token_ids)
                if c.next_token >= 0:
                    rows.append(off - 1)
            host = torch.tensor([rows, ends], dtype=torch.long)
            rows_d, ends_d = to_device(host, next_ids.device)
            next_ids[rows_d] = ends_d
        self._step = (batch, streams, next_ids)

    def propose(self, anchors: Anchors) -> DraftBlock | None:
        batch, streams, next_ids = self._step
        self._step = None
        next_ids[anchors.rows] = anchors.tokens
        block, x = self.model.mtp_draft(batch, streams, next_ids, anchors.rows, self.cache)
        if not anchors.rows.numel():
            return None
        if self.num_tokens == 1:
            return block
        tokens, logits, conf = [block.tokens[:, 0]], [block.logits[:, 0]], [block.confidence[:, 0]]
        for i in range(1, self.num_tokens):  # the layer at position anchor + i - 1 reads draft i
            step = single_token_batch(tokens[-1], anchors.pos + i - 1, anchors.slots, self.window, self.ring)
            li, x = self.model.mtp_chain(x, tokens[-1], step, self.cache)
            prob, tok = li.softmax(-1).max(-1)
            tokens.append(tok)
            logits.append(li)
            conf.append(prob)
        return DraftBlock(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1))
