"""Speculative decoding through LLM when the cache preempts running requests (a preempted request drops
its drafts and recomputes its tokens): outputs equal speculation off, on tiny V4 (prompt lookup) and
V4.1 (DSpark stages with an oracle that makes some drafts right)."""
from __future__ import annotations

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.loader.model_config import read_model_config
from deepinfer.worker.drafter import DSparkDrafter
from deepinfer.worker.kv_cache import cache_spec

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """55-85 tokens: noise, then a short motif repeated (prompt lookup finds drafts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(3, vocab, (int(torch.randint(20, 40, (1,), generator=g)),), generator=g).tolist()
        out.append(([0] + noise + motif * 8)[:85])
    return out


def _small(ckpt, slack: int, **kw) -> LLM:
    """3 slots sharing compressed-entry blocks for 300 tokens, a 24-token budget: 7 requests of 55-97 tokens
    queue, prompts are chunked, running requests get preempted when blocks run out (as test_llm.py's)."""
    spec = cache_spec(read_model_config(ckpt), "float32", 4, ring_slack=slack)
    per_token = sum(b / (4 * m) for m, b in spec.block_bytes.items())
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4,
               kv_cache_memory=3 * spec.slot_bytes + int(300 * per_token) + 1, max_num_seqs=3,
               max_num_batched_tokens=24, max_model_len=100, **kw)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_prompt_lookup_under_preemption_v4(ckpt):
    prompts = _prompts(7, read_model_config(ckpt).vocab_size)
    want = _tokens(_small(ckpt, 0), prompts)
    llm = _small(ckpt, 3, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert _tokens(llm, prompts) == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["num_drafts"] > 0
    assert llm.scheduler.kv.all_free()


def test_dspark_under_preemption_v41(ckpt41, monkeypatch):
    k = 3
    prompts = _prompts(7, read_model_config(ckpt41).vocab_size, seed=1)
    want = _tokens(_small(ckpt41, 0), prompts)
    truth = {(i, t): (p + w)[i + 1:] for p, w in zip(prompts, want) for i, t in enumerate(p + w)}
    real = DSparkDrafter.draft

    def oracle(self, anchor_tokens, anchor_pos, slots):  # right up to a position that moves with the anchor
        block = real(self, anchor_tokens, anchor_pos, slots)
        for b, (t, q) in enumerate(zip(anchor_tokens.tolist(), anchor_pos.tolist())):
            nxt = (truth.get((q, t), []) + [0] * k)[:k]
            if q % (k + 1) < k:
                nxt[q % (k + 1)] = (nxt[q % (k + 1)] + 1) % 1000 + 3
            block.tokens[b, :k] = torch.tensor(nxt)
        return block

    monkeypatch.setattr(DSparkDrafter, "draft", oracle)
    llm = _small(ckpt41, k, num_speculative_tokens=k)
    # V4.1's ratios (1 and 2) leave no rounding room in a pool planned for max_model_len per slot: take
    # half of every pool away, so three long requests outgrow it and get preempted
    kv = llm.scheduler.kv
    for m, free in kv.free_blocks.items():
        for _ in range(len(free) // 2):
            free.pop()
            kv.num_blocks[m] -= 1
    assert _tokens(llm, prompts) == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0, m
    assert m["num_accepted_tokens"] > 0, m
    assert llm.scheduler.kv.all_free()
