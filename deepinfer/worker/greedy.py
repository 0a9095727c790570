"""Minimal greedy generation over the flat varlen batch: chunked prefill mixed with decode.

A reference loop for tests and the demo; the continuous-batching engine builds on the
same model/cache interface.
"""
from __future__ import annotations

import torch

from deepinfer.layers.forward_batch import SeqChunk, build_forward_batch
from deepinfer.worker.kv_cache import V4Cache


@torch.inference_mode()
def greedy_generate(model, cache: V4Cache, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None = None, prefill_chunk: int = 512) -> list[list[int]]:
    if len(prompts) > cache.num_slots:
        raise ValueError(f"{len(prompts)} prompts but the cache has {cache.num_slots} slots")
    device = next(model.parameters()).device
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    out: list[list[int]] = [[] for _ in prompts]
    active = [i for i, p in enumerate(prompts) if p and max_new_tokens > 0]
    while active:
        chunks = [SeqChunk(i, done[i], seqs[i][done[i]:done[i] + prefill_chunk], cache.static_tables(i))
                  for i in active]
        batch = build_forward_batch(chunks, model.config.sliding_window, cache.compress_kinds,
                                    cache.block_size, device)
        streams = model(batch, cache.layers)
        next_ids = model.compute_logits(streams[batch.logits_idx]).argmax(-1).tolist()
        still = []
        for i, c, tok in zip(active, chunks, next_ids):
            done[i] += len(c.token_ids)
            if done[i] < len(seqs[i]):
                still.append(i)  # prompt not fully prefilled yet
                continue
            out[i].append(tok)
            seqs[i].append(tok)
            if len(out[i]) < max_new_tokens and tok != eos_token_id:
                still.append(i)
        active = still
    return out
