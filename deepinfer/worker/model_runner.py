"""ModelRunner: owns the model and the cache tensors; SchedulerOutput in, ModelOutput out."""
from __future__ import annotations

import torch

from deepinfer.engine.outputs import ModelOutput, SchedulerOutput
from deepinfer.layers.forward_batch import SeqChunk, build_forward_batch
from deepinfer.worker.kv_cache import V4Cache
from deepinfer.worker.sampler import SamplingBatch, sample, top_logprobs


class ModelRunner:
    def __init__(self, model, cache: V4Cache, device: torch.device | str, seed: int | None = None,
                 replay_keep: int | None = None):
        """`replay_keep`: SWA bounded replay keeps each request's last `replay_keep` rows above the
        model's replay layer (None = exact prefill, or a model without one)."""
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.replay_keep = replay_keep if getattr(model, "replay_layer", -1) >= 0 else None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        for f in so.forks:
            self.cache.copy_state(f.src_slot, f.dst_slot, f.src_blocks, f.dst_blocks)
        keep = self.replay_keep
        chunks = [SeqChunk(c.slot, c.start, c.token_ids, c.block_tables, c.prev_tokens,
                           0 if keep is None else max(0, c.num_tokens - keep),
                           [(s0, img.num_tokens) for s0, img in c.images]) for c in so.chunks]
        batch = build_forward_batch(chunks, self.model.config.sliding_window, self.cache.compress_kinds,
                                    self.cache.block_size, self.device, getattr(self.model, "token_history", 0))
        batch.input_embeds = self._image_embeds(so)
        streams = self.model(batch, self.cache.layers)
        sampled = [c for c in so.chunks if c.num_samples]
        if not sampled:
            return ModelOutput({})
        rows = [i for i, c in enumerate(so.chunks) if c.num_samples]
        # a request forking into n siblings draws n tokens from its one last-position distribution
        repeat = torch.tensor([c.num_samples for c in sampled])
        last = batch.logits_idx[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(streams[last]).repeat_interleave(repeat.to(self.device), dim=0)
        params = [c.params for c in sampled for _ in range(c.num_samples)]
        sb = SamplingBatch.build(params, logits.shape[-1], self.device)
        tokens = sample(logits, sb, self.generator)
        out = ModelOutput({})
        token_list = tokens.tolist()  # the one host sync of the step
        lp = self._logprobs(logits, tokens, token_list, sb.max_logprobs, params) if sb.max_logprobs >= 0 else None
        i = 0
        for c in sampled:
            out.sampled[c.request_id] = token_list[i:i + c.num_samples]
            if lp is not None and c.params.logprobs is not None:
                out.logprobs[c.request_id] = lp[i:i + c.num_samples]
            i += c.num_samples
        return out

    def _image_embeds(self, so: SchedulerOutput):
        """(flat rows, embeddings) for the image-span tokens computed this step, or None.
        The vision tower runs for each image a chunk touches (spans are seldom split)."""
        rows, values, off = [], [], 0
        for c in so.chunks:
            for s0, img in c.images:
                lo, hi = max(s0, c.start), min(s0 + img.num_tokens, c.start + len(c.token_ids))
                if lo < hi:
                    span = self.model.image_embeddings(img)
                    rows.append(torch.arange(lo, hi) - c.start + off)
                    values.append(span[lo - s0:hi - s0])
            off += len(c.token_ids)
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)

    @staticmethod
    def _logprobs(logits, tokens, token_list: list[int], k: int, params) -> list[dict[int, float]]:
        chosen, vals, ids = (t.tolist() for t in top_logprobs(logits, tokens, k))
        out = []
        for r, p in enumerate(params):
            n = p.logprobs or 0
            d = dict(zip(ids[r][:n], vals[r][:n]))
            d[token_list[r]] = chosen[r]
            out.append(d)
        return out
