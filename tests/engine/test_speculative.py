"""Speculative decoding through LLM (prompt-lookup drafts, spec/ngram.py): tokens equal speculation off,
with chunked prefill, preemption and seeded sampling; the proposer and its counters on their own."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.loader.model_config import read_model_config
from deepinfer.spec.ngram import NgramProposer, SpecStats
from conftest import CFG  # tests/engine/conftest.py: the ckpt / ckpt41 fixtures


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (prompt lookup finds drafts, some right and some wrong) of 20-60 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(3, vocab, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
        out.append([0] + noise + motif * 4 + noise[:3])
    return out


def _llm(ckpt, spec: int | None, **kw) -> LLM:
    sc = None if spec is None else {"method": "ngram", "num_speculative_tokens": spec, "prompt_lookup_max": 3}
    base = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20)
    return LLM(str(ckpt), speculative_config=sc, **{**base, **kw})


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_speculation_off_v4(ckpt, k):
    prompts = _prompts(6, CFG["vocab_size"])
    greedy = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]
    llm = _llm(ckpt, k)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]  # accepts and rejects
    assert len(m["accepted_per_position"]) <= k and sum(m["accepted_per_position"]) == m["num_accepted_tokens"]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert llm.scheduler.kv.all_free()


def test_greedy_tokens_equal_speculation_off_v41(ckpt41):
    prompts = _prompts(4, read_model_config(ckpt41).vocab_size, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    want = [o.outputs[0].token_ids for o in _llm(ckpt41, None).generate(prompts, greedy, use_tqdm=False)]
    llm = _llm(ckpt41, 4)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.get_metrics()["num_drafts"] > 0


def test_chunked_prefill_and_preemption(ckpt):
    """A small token budget chunks prompts and caps drafts; a small cache preempts running requests
    (recomputed from their tokens, drafts dropped); outputs still equal speculation off."""
    prompts = _prompts(6, CFG["vocab_size"], seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    want = [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]
    small = _llm(ckpt, 4, block_size=4, kv_cache_memory=3 << 20, max_num_seqs=3, max_num_batched_tokens=16,
                 max_model_len=120)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    assert small.get_metrics()["num_drafts"] > 0
    assert small.scheduler.kv.all_free()


def test_seeded_sampling_equals_speculation_off(ckpt):
    """Prompt-lookup drafts are deterministic: a seeded request verifies them by matching the draw the
    target makes at that position, so its tokens equal speculation off's (batch-invariant logits)."""
    prompts = _prompts(4, CFG["vocab_size"], seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seq_seed=100 + i) for i in range(4)]
    off = _llm(ckpt, None, batch_invariant=True).generate(prompts, params, use_tqdm=False)
    on = _llm(ckpt, 3, batch_invariant=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_stops_and_max_tokens_are_never_passed(ckpt):
    prompts = _prompts(4, CFG["vocab_size"], seed=4)
    ref = _llm(ckpt, None).generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    stop = [o.outputs[0].token_ids[5] for o in ref]  # a token each output reaches
    llm = _llm(ckpt, 5)
    for p, r, s in zip(prompts, ref, stop):
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[s]),
                           use_tqdm=False)[0].outputs[0]
        cut = r.outputs[0].token_ids.index(s) + 1
        assert out.token_ids == r.outputs[0].token_ids[:cut] and out.finish_reason == "stop"
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == r.outputs[0].token_ids[:7] and out.finish_reason == "length"


def test_logprobs_match_speculation_off(ckpt):
    prompts = _prompts(2, CFG["vocab_size"], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    off = _llm(ckpt, None).generate(prompts, params, use_tqdm=False)
    on = _llm(ckpt, 3).generate(prompts, params, use_tqdm=False)
    for a, b in zip(on, off):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == len(a.outputs[0].token_ids)
        for da, db in zip(la, lb):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)


def test_bad_speculative_config_names_the_field(ckpt):
    for sc, field in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=field):
            LLM(str(ckpt), device="cpu", dtype="float32", speculative_config=sc)


def test_ngram_proposer():
    p = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert p.propose([5, 6, 7, 8, 9, 5, 6, 7], 10) == [8, 9, 5]      # the 3-gram 5 6 7 recurs
    assert p.propose([1, 2, 3, 9, 2, 3, 4, 2, 3], 10) == [4, 2, 3]   # latest earlier occurrence of 2 3
    assert p.propose([1, 2, 3, 9, 2, 3, 4, 2, 3], 2) == [4, 2]       # capped by the room left
    assert p.propose([1, 2, 3, 4], 10) == []                          # nothing recurs
    assert p.propose([7], 10) == [] and p.propose([4, 4], 0) == []
    assert NgramProposer(2, 2, 2).propose([1, 2, 3, 1, 3], 5) == []   # only 1-gram matches, min n is 2
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 2, 3)


def test_spec_stats():
    s = SpecStats()
    assert s.as_dict()["mean_acceptance_length"] is None
    s.record(3, 2)
    s.record(5, 0)
    s.record(0, 0)  # a step without drafts is not a draft
    assert s.as_dict() == dict(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=2,
                               accepted_per_position=[1, 1, 0, 0, 0], mean_acceptance_length=2.0)
