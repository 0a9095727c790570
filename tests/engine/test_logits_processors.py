"""vLLM's logits processing (penalties, logit_bias, min_tokens, bad_words, allowed_token_ids) end to end on a tiny
random checkpoint (fp32, CPU): greedy tokens against a step-by-step torch reference of the processed logits over
the transformers model, with chunked prefill, preemption, n > 1 and speculation."""
from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.outputs import ScheduledChunk, SchedulerOutput
from deepinfer.worker.logits_processors import LogitsProcessors, RowPlan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
from oracle import transformers_model  # noqa: E402

from conftest import CFG  # noqa: E402
from test_speculative import confident_oracle, continuations  # noqa: E402

V, EOS = CFG["vocab_size"], CFG["eos_token_id"]


def processed(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's definitions, one row at a time: the reference the batched processors are held to."""
    x = logits.clone().float()
    if p.allowed_token_ids:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for w in p.bad_words_token_ids or ():
        if len(w) == 1 or (len(outputs) >= len(w) - 1 and outputs[len(outputs) - len(w) + 1:] == w[:-1]):
            x[w[-1]] = float("-inf")
    if len(outputs) < p.min_tokens:
        for t in ([] if p.ignore_eos else [EOS]) + p.stop_token_ids:
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(outputs).items():  # (two subtractions, as vLLM rounds them)
        x[t] -= p.frequency_penalty * c
        x[t] -= p.presence_penalty
    return x


def reference_greedy(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < p.max_tokens:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(processed(logits, prompt, out, p).argmax()))
            if out[-1] == EOS and not p.ignore_eos or out[-1] in p.stop_token_ids:
                break
    return out


def _prompts(n: int, seed: int, lo: int = 8, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    # a small alphabet: prompts repeat tokens, so the repetition penalty has prompt tokens to act on
    return [[0] + torch.randint(3, 40, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def hf(ckpt, tmp_path_factory):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20)
    return transformers_model(llm.model, tmp_path_factory.mktemp("hf"))


def _cases(plain: list[list[int]]) -> list[tuple[SamplingParams, dict]]:
    """(params, the field under test at its neutral value): each picked to act on these prompts' greedy tokens
    `plain` (the random model rarely repeats a token or emits EOS by itself)."""
    g = dict(temperature=0, max_tokens=14)
    return [
        (SamplingParams(**g, repetition_penalty=1.8), {"repetition_penalty": 1.0}),
        (SamplingParams(**g, logit_bias={7: 4.0}, frequency_penalty=1.5), {"frequency_penalty": 0.0}),
        (SamplingParams(**g, presence_penalty=2.0, repetition_penalty=0.7), {"presence_penalty": 0.0}),
        (SamplingParams(**g, logit_bias={7: 5.0, 9: -100}), {"logit_bias": None}),
        (SamplingParams(**g, min_tokens=10, stop_token_ids=[plain[4][2]]), {"min_tokens": 0}),
        (SamplingParams(**g, allowed_token_ids=[5, 6, 7, 8, 9, 10, EOS]), {"allowed_token_ids": None}),
        (SamplingParams(**g, bad_words_token_ids=[[plain[6][7]], plain[6][3:5], [5, 6, 7]]),
         {"bad_words_token_ids": None}),
    ]


def test_each_field_changes_greedy_tokens_as_the_reference_says(ckpt, hf):
    prompts = _prompts(7, seed=1)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20)
    plain = [o.outputs[0].token_ids for o in
             llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14), use_tqdm=False)]
    cases = _cases(plain)
    outs = llm.generate(prompts, [p for p, _ in cases], use_tqdm=False)  # one batch: every field in the same steps
    neutral = llm.generate(prompts, [dataclasses.replace(p, **off) for p, off in cases], use_tqdm=False)
    for prompt, (p, off), o, base in zip(prompts, cases, outs, neutral):
        assert o.outputs[0].token_ids == reference_greedy(hf, prompt, p), p
        assert o.outputs[0].token_ids != base.outputs[0].token_ids, off  # the field acts


def test_history_survives_chunked_prefill_preemption_and_forks(ckpt, hf):
    """Prompts in 24-token chunks, a cache too small for all (preempted requests recompute prompt and outputs),
    and n = 2 (the sibling forks the leader's prompt): every request still equals the reference."""
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.7,
                            bad_words_token_ids=[[14, 15]], min_tokens=4)
    prompts = _prompts(7, seed=2, lo=55, hi=85)
    small = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4,
                kv_cache_memory=_memory(ckpt, slots=3, tokens=300), max_num_seqs=3, max_num_batched_tokens=24,
                max_model_len=100)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.scheduler.num_preemptions > 0 and small.scheduler.kv.all_free()
    for prompt, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference_greedy(hf, prompt, params)
    # n = 2 at temperature 0: both samples are the greedy sequence
    forked = small.generate(prompts[:2], dataclasses.replace(params, n=2), use_tqdm=False)
    for prompt, o in zip(prompts, forked):
        want = reference_greedy(hf, prompt, params)
        assert [c.token_ids for c in o.outputs] == [want, want]


def _memory(ckpt, slots: int, tokens: int) -> int:
    from deepinfer.loader.model_config import read_model_config
    from deepinfer.worker.kv_cache import cache_spec

    spec = cache_spec(read_model_config(ckpt), "float32", 4)
    per_token = sum(b / (4 * m) for m, b in spec.block_bytes.items())
    return slots * spec.slot_bytes + int(tokens * per_token) + 1


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_with_penalties_equals_speculation_off(ckpt41, monkeypatch, k):
    """Verify rows penalised as the target would after the drafts before them: DSpark greedy == off, with drafts
    that are the true continuation up to a wrong one at a moving position (every acceptance length occurs)."""
    prompts = _prompts(4, seed=3, hi=30)
    # biased tokens the penalties then take turns among: which one wins at a verify row depends on the drafts
    # before it (and on bad word 6 -> 7, whose prefix may be a draft)
    bias = {5: 6.0, 6: 6.0, 7: 6.0}
    params = [SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.9, logit_bias=bias),
              SamplingParams(temperature=0, max_tokens=20, presence_penalty=2.0, repetition_penalty=1.5,
                             logit_bias=bias, bad_words_token_ids=[[6, 7]]),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=15, logit_bias={EOS: 50.0, 5: 30.0}),
              SamplingParams(temperature=0, max_tokens=20)]
    kw = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20)
    off = [o.outputs[0].token_ids for o in LLM(str(ckpt41), **kw).generate(prompts, params, use_tqdm=False)]
    confident_oracle(monkeypatch, continuations(prompts, off), k)
    spec = LLM(str(ckpt41), **kw, speculative_config={"method": "dspark", "num_speculative_tokens": k})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == off, (got, off)
    m = spec.get_metrics()
    assert all(n > 0 for n in m["accepted_per_position"])


def test_seeded_sampling_with_penalties_is_the_same_with_speculation(ckpt41, monkeypatch):
    prompts = _prompts(3, seed=4, hi=30)
    params = SamplingParams(temperature=0.9, max_tokens=16, seq_seed=7, frequency_penalty=1.2,
                            repetition_penalty=1.2, logit_bias={5: 4.0})
    kw = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20)
    off = [o.outputs[0].token_ids for o in LLM(str(ckpt41), **kw).generate(prompts, params, use_tqdm=False)]
    confident_oracle(monkeypatch, continuations(prompts, off), 3)
    spec = LLM(str(ckpt41), **kw, speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == off
    assert spec.get_metrics()["num_accepted_tokens"] > 0


def test_verify_rows_see_the_drafts_before_them():
    """Unit level: row j of a verify group counts drafts[:j] on top of the slot's history."""
    procs = LogitsProcessors(num_slots=2, vocab=16, device=torch.device("cpu"), eos_token_id=1)
    p = SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0,
                       bad_words_token_ids=[[3, 4, 5]], min_tokens=3, max_tokens=8)
    prompt, outs = [0, 2, 2, 9], [3]
    so = SchedulerOutput([ScheduledChunk("a", 1, 0, prompt + outs, {}, 1, p, prompt_len=len(prompt))])
    procs.observe(so)  # a recompute: prompt and one earlier output, then samples
    drafts = torch.tensor([4, 7])
    logits = torch.randn(3, 16)
    got = procs.apply(logits, RowPlan([p] * 3, [1] * 3, [0, 1, 2], [0] * 3), drafts)
    for j in range(3):
        want = processed(logits[j], prompt, outs + drafts[:j].tolist(), p)
        torch.testing.assert_close(got[j], want, rtol=0, atol=0)
    assert got[1, 5] == float("-inf") and got[0, 5] != float("-inf")  # 3, 4 precede row 1 only


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words_token_ids": [list(range(9))]}, "bad_words_token_ids"),
])
def test_invalid_fields_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_ids_are_refused_and_the_engine_keeps_serving(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20)
    for kw, field in [({"logit_bias": {V: 1.0}}, "logit_bias"), ({"allowed_token_ids": [3, V]}, "allowed_token_ids"),
                      ({"bad_words_token_ids": [[V + 2]]}, "bad_words_token_ids")]:
        with pytest.raises(ValueError, match=field):
            llm.generate([[0, 5, 6]], SamplingParams(**kw), use_tqdm=False)
    assert not llm.scheduler.has_unfinished()


def test_batch_invariant_rows_are_the_same_alone_and_batched(ckpt):
    """Each row's processing reads only its own request: under batch invariance a penalised, biased, seeded request
    gives the same tokens alone and among others with other fields."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20,
              batch_invariant=True)
    prompts = _prompts(4, seed=6)
    params = [SamplingParams(temperature=0.8, seq_seed=3, max_tokens=12, frequency_penalty=1.0, logit_bias={7: 3.0}),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=list(range(5, 50))),
              SamplingParams(temperature=0.8, seq_seed=4, max_tokens=12)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone


def test_a_recompute_past_the_ring_keeps_the_newest_outputs():
    """A preempted request recomputes prompt and 70 outputs in one chunk: the ring (64 outputs) holds the newest,
    so a bad word whose prefix is the last outputs still bans its last token, and the counts cover all 70."""
    procs = LogitsProcessors(num_slots=1, vocab=40, device=torch.device("cpu"), eos_token_id=1)
    p = SamplingParams(temperature=0, max_tokens=100, frequency_penalty=1.0, bad_words_token_ids=[[7, 8, 9]])
    prompt, outs = [0, 2, 3, 4], [(5 + i) % 30 + 5 for i in range(68)] + [7, 8]
    procs.observe(SchedulerOutput([ScheduledChunk("a", 0, 0, prompt + outs, {}, 1, p, prompt_len=len(prompt))]))
    logits = torch.randn(1, 40)
    got = procs.apply(logits, RowPlan.sampled([p], [0]))
    torch.testing.assert_close(got[0], processed(logits[0], prompt, outs, p), rtol=0, atol=0)
    assert got[0, 9] == float("-inf")
