"""SamplingParams.prompt_logprobs (vLLM's): the logprob of every prompt token after the first and the top-k,
computed by prefill from the raw model distribution, on tiny V4 and V4.1 checkpoints (fp32, CPU)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ModelOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
from deepinfer.tools.static_cache import static_v4_cache

from conftest import CFG  # noqa: E402  (tests/engine/conftest.py: the ckpt / ckpt41 fixtures)

DEVICE = "cuda"
TOL = 1e-4  # fp32: the engine's batched, chunked forward against one full-sequence forward


def _llm(ckpt, **kw) -> LLM:
    kw = {"kv_cache_memory": 64 << 20, **kw}
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", skip_tokenizer_init=True, **kw)


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def _prompt(seed: int, n: int, vocab: int = CFG["vocab_size"]) -> list[int]:
    return [0] + torch.randint(3, vocab, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def _teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """[S, V] log_softmax of one full-sequence forward of `model` (row p predicts position p + 1)."""
    cfg = model.config
    cache = static_v4_cache(cfg, 1, len(ids), "float32", "cpu")
    batch = build_forward_batch([SeqChunk(0, 0, ids, cache.static_tables(0))], cfg.sliding_window,
                                cache.compress_kinds, cache.block_size, "cpu", model.token_history)
    with torch.inference_mode():
        return model.compute_logits(model(batch, cache.layers)).log_softmax(-1)


def _check(got: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        d, row = got[p], ref[p - 1]
        top = row.topk(k).indices.tolist() if k else []
        assert set(d) == set(top) | {ids[p]}, p  # the prompt token and the top-k, nothing else
        for t, v in d.items():
            assert abs(v - row[t].item()) <= TOL, (p, t, v, row[t].item())


def test_prompt_logprobs_equal_a_full_sequence_forward_v4(llm):
    prompts = [_prompt(1, 40), _prompt(2, 2), _prompt(3, 1), _prompt(4, 25)]
    ks = [3, 0, 5, 20]
    params = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k) for k in ks]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, k, out in zip(prompts, ks, outs):
        ref = _teacher_forced(llm.model, ids)
        _check(out.prompt_logprobs, ids, ref, k)
        # the true rank over the whole vocabulary (vLLM's count: tokens at least as likely), far past the top-k too
        want = [None] + [int((ref[p - 1] >= ref[p - 1, ids[p]]).sum()) for p in range(1, len(ids))]
        assert out.prompt_logprob_ranks == want
    assert any(r > 20 for o in outs for r in o.prompt_logprob_ranks[1:])  # (ranks beyond every k asked)
    assert outs[2].prompt_logprobs == [None]  # a one-token prompt: nothing predicts its only token
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_chunked_prefill_gives_the_unchunked_values(llm, monkeypatch):
    prompts = [_prompt(10, 30), _prompt(11, 21)]
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, n=2),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)]
    whole = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(llm.scheduler, "budget", 9)  # 9-token steps: every prompt in several chunks
    chunked = llm.generate(prompts, params, use_tqdm=False)
    for ids, a, b in zip(prompts, whole, chunked):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert len(b.prompt_logprobs) == len(ids) and b.prompt_logprobs[0] is None
        for p in range(1, len(ids)):
            assert a.prompt_logprobs[p].keys() == b.prompt_logprobs[p].keys()
            assert max(abs(v - b.prompt_logprobs[p][t]) for t, v in a.prompt_logprobs[p].items()) <= TOL


@pytest.fixture(scope="module")
def llm41(ckpt41):
    """V4.1 with bounded replay keeping the last 24 rows above the cut (window 16 + draft block 5, and more),
    24-token steps, batch-invariant (a request prefilled exactly changes which rows the others' upper layers see
    batched with: only batch invariance makes their numbers independent of that)."""
    llm = _llm(ckpt41, max_num_batched_tokens=24, yoco_prefill_keep_tokens=24, batch_invariant=True)
    assert llm.engine.core.runner.replay_keep == 24
    return llm


def test_prompt_logprobs_equal_a_full_sequence_forward_v41_chunked_past_bounded_replay(llm41):
    # a request with prompt_logprobs is prefilled exactly, every chunk of it
    prompts = [_prompt(20, 61, 1000), _prompt(21, 30, 1000)]
    outs = llm41.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=4), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        _check(out.prompt_logprobs, ids, _teacher_forced(llm41.model, ids), 4)


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_a_batch_mixing_prompt_logprobs_leaves_the_other_requests_unchanged(request, arch, monkeypatch):
    llm = request.getfixturevalue("llm" if arch == "v4" else "llm41")
    vocab = llm.model.config.vocab_size
    prompts = [_prompt(30 + i, n, vocab) for i, n in enumerate([40, 50, 30])]
    others = [SamplingParams(temperature=0, max_tokens=3, logprobs=3),
              SamplingParams(temperature=0.8, max_tokens=3, logprobs=3, seq_seed=7)]
    rows = []
    compute = llm.model.compute_logits
    monkeypatch.setattr(llm.model, "compute_logits", lambda s: rows.append(s.shape[0]) or compute(s))
    base = llm.generate(prompts, [others[0], SamplingParams(temperature=0, max_tokens=3), others[1]], use_tqdm=False)
    # without prompt_logprobs the head runs on the sampled rows only: one per output token
    assert sum(rows) == sum(len(o.outputs[0].token_ids) for o in base)
    rows.clear()
    mixed = llm.generate(prompts, [others[0], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5),
                                   others[1]], use_tqdm=False)
    assert sum(rows) == sum(len(o.outputs[0].token_ids) for o in mixed) + len(prompts[1]) - 1
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == base[i].outputs[0].token_ids
        assert mixed[i].outputs[0].logprobs == base[i].outputs[0].logprobs  # bit for bit
        assert mixed[i].prompt_logprobs is None
    if arch == "v4":  # (V4.1 prefills it exactly, not with bounded replay: its own tokens may differ)
        assert mixed[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert len(mixed[1].prompt_logprobs) == len(prompts[1])


@pytest.mark.parametrize("value", [-1, True, 1.5, "3"])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_above_the_limit_are_refused(llm):
    good = [_prompt(40, 10)]
    with pytest.raises(ValueError, match=r"prompt_logprobs 21 is above the limit 20"):
        llm.generate(good, SamplingParams(prompt_logprobs=21), use_tqdm=False)
    assert not llm.scheduler.has_unfinished()
    out = llm.generate(good, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20), use_tqdm=False)[0]
    assert len(out.prompt_logprobs[1]) in (20, 21)


def test_a_preempted_request_computes_its_prompt_rows_again_and_never_past_the_prompt():
    # the scheduler alone (a fake model): 6 blocks of ratio-4 entries for four 20-token prompts decoding 30 tokens
    kv = KVCacheManager(num_slots=4, num_blocks={4: 6}, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)
    prompt = list(range(1, 21))  # the token at position p is p + 1
    reqs = [Request(str(i), prompt, SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=0),
                    prompt_logprobs=[None] * 20) for i in range(4)]
    for r in reqs:
        sched.add(r)
    computed = {r.request_id: 0 for r in reqs}
    while sched.has_unfinished():
        so = sched.schedule()
        mo = ModelOutput({c.request_id: [7] * c.num_samples for c in so.chunks if c.num_samples})
        for c in so.chunks:
            if c.prompt_rows:
                assert c.start + c.prompt_rows <= len(prompt) - 1  # rows that predict prompt tokens only
                positions = range(c.start + 1, c.start + 1 + c.prompt_rows)
                mo.prompt_logprobs[c.request_id] = (c.start + 1, [{p + 1: -float(p)} for p in positions])
                computed[c.request_id] += c.prompt_rows
        sched.update(so, mo)
    assert sched.num_preemptions > 0 and max(computed.values()) > 19  # a preempted request computed them again
    for r in reqs:
        assert r.prompt_logprobs == [None] + [{p + 1: -float(p)} for p in range(1, 20)]
        assert r.output_token_ids == [7] * 30


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_cuda_prompt_logprobs_match_the_cpu_and_leave_the_others_unchanged(request, arch):
    """fp32 on CUDA: the CPU's values; bf16 (Triton kernels, decode graphs, batch-invariant): within bf16 rounding
    of them on average (bf16 on the CPU: 0.03 - 0.07 nats mean, 0.4 - 1.2 max; on the H200 at c61a567 V4.1's
    160-token prompt 0.18 mean, 1.12 max: benchmarks/results/2026-12-01-h200-gpu-tests-c61a567.log; the fp32 leg,
    which shares the bf16 leg's row alignment, checks that alignment to 1e-3), and every
    other request's tokens and logprobs bit for bit those of the same batch without them."""
    ck = request.getfixturevalue("ckpt" if arch == "v4" else "ckpt41")
    vocab = CFG["vocab_size"] if arch == "v4" else 1000
    prompts = [_prompt(50 + i, n, vocab) for i, n in enumerate([90, 33, 160, 12])]
    want = [SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=None if i % 2 else 3)
            for i in range(4)]
    plain = [replace(p, prompt_logprobs=None) for p in want]
    ref = _llm(ck).generate(prompts, want, use_tqdm=False)
    for dtype, tol, worst in (("float32", 1e-3, 1e-3), ("bfloat16", 0.3, 3.0)):
        gpu = LLM(str(ck), device=DEVICE, dtype=dtype, kv_cache_dtype=dtype, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=64, batch_invariant=dtype == "bfloat16")
        got, base = (gpu.generate(prompts, ps, use_tqdm=False) for ps in (want, plain))
        for i in (0, 2):
            diff = [abs(got[i].prompt_logprobs[p][t] - ref[i].prompt_logprobs[p][t])
                    for p, t in enumerate(prompts[i]) if p]
            assert sum(diff) / len(diff) <= tol and max(diff) <= worst, (dtype, i, max(diff))
        for i in (1, 3):  # bit for bit where batch-invariant (fp32: V4.1's exact prefill regroups the batch)
            assert got[i].outputs[0].token_ids == base[i].outputs[0].token_ids
            if dtype == "bfloat16" or arch == "v4":
                assert got[i].outputs[0].logprobs == base[i].outputs[0].logprobs, (dtype, i)
        assert gpu.scheduler.kv.all_free()
