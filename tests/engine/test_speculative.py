"""Speculative decoding through LLM (prompt-lookup drafts, spec/ngram.py): tokens equal speculation off,
with chunked prefill, preemption and seeded sampling; the proposer and its counters on their own."""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.loader.model_config import read_model_config
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ModelOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.spec.ngram import ModelDrafts, NgramProposer, SpecStats
from deepinfer.spec.schedule import SPSTable
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
    """spec: k prompt-lookup drafts (None: off, or a speculative_config in kw)."""
    sc = None if spec is None else {"method": "ngram", "num_speculative_tokens": spec, "prompt_lookup_max": 3}
    base = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20,
                speculative_config=sc)
    return LLM(str(ckpt), **{**base, **kw})


@functools.cache
def _greedy_off(ckpt: str, n: int, seed: int, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy tokens with speculation off) for n _prompts of the seed: computed once for the
    k-parametrized tests below, which compare against the same reference."""
    prompts = _prompts(n, read_model_config(ckpt).vocab_size, seed=seed)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    return prompts, [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_speculation_off_v4(ckpt, k):
    prompts, want = _greedy_off(str(ckpt), 6, 0, 24)
    greedy = SamplingParams(temperature=0, max_tokens=24)
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


def test_chunked_prefill_and_a_small_token_budget(ckpt):
    """A small token budget chunks prompts and caps the drafts; outputs still equal speculation off
    (preemption under speculation: the scheduler tests below)."""
    prompts = _prompts(6, CFG["vocab_size"])
    greedy = SamplingParams(temperature=0, max_tokens=30)
    want = [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]
    small = _llm(ckpt, 4, block_size=4, max_num_seqs=3, max_num_batched_tokens=6, max_model_len=120)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    m = small.get_metrics()
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0
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
                               accepted_per_position=[1, 1, 0, 0, 0], drafted_per_position=[2, 2, 2, 1, 1],
                               mean_acceptance_length=2.0)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dspark_drafts_keep_greedy_tokens_v41(ckpt41, k):
    """V4.1's own draft stages propose (context KV kept in the stages' rings): greedy outputs equal
    speculation off (random stages: their drafts are rejected)."""
    prompts, want = _greedy_off(str(ckpt41), 4, 6, 20)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    llm = _llm(ckpt41, None, speculative_config={"method": "dspark", "num_speculative_tokens": k})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_drafts"]
    assert llm.scheduler.kv.all_free()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dspark_drafts_keep_greedy_tokens_v4_0731(ckpt0731, k):
    """V4-Flash-0731's DSpark stages propose (the V4 trunk's features after layers dspark_target_layer_ids):
    greedy outputs equal speculation off, and num_speculative_tokens alone picks them."""
    prompts, want = _greedy_off(str(ckpt0731), 4, 6, 20)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    llm = _llm(ckpt0731, None, num_speculative_tokens=k)
    assert llm.scheduler.proposer.method == "dspark"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_drafts"]
    assert llm.scheduler.kv.all_free()


def test_dspark_partial_acceptance_with_chunking_v41(ckpt41, monkeypatch):
    """The drafter's blocks replaced by the true continuation with one wrong token at a position that
    varies (0 .. k: all rejected .. all accepted), so every acceptance length occurs, with a small cache
    and a small budget that chunks prompts. Greedy outputs still equal speculation off."""
    from deepinfer.worker.drafter import DSparkDrafter
    from deepinfer.worker.kv_cache import cache_spec

    k = 4
    prompts = _prompts(6, read_model_config(ckpt41).vocab_size, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    want = [o.outputs[0].token_ids for o in _llm(ckpt41, None).generate(prompts, greedy, use_tqdm=False)]
    truth = {}  # (position, token) -> the tokens after it
    for p, w in zip(prompts, want):
        seq = p + w
        for i in range(len(seq)):
            truth[(i, seq[i])] = seq[i + 1:]
    real = DSparkDrafter.draft

    def oracle(self, anchor_tokens, anchor_pos, slots):
        block = real(self, anchor_tokens, anchor_pos, slots)
        for b, (t, q) in enumerate(zip(anchor_tokens.tolist(), anchor_pos.tolist())):
            nxt = (truth.get((q, t), []) + [0] * k)[:k]
            bad = q % (k + 1)  # the first wrong draft (k: none)
            if bad < k:
                nxt[bad] = (nxt[bad] + 1) % 1000 + 3
            block.tokens[b, :k] = torch.tensor(nxt)
        return block

    monkeypatch.setattr(DSparkDrafter, "draft", oracle)
    spec = cache_spec(read_model_config(ckpt41), "float32", 4, ring_slack=k)
    per_token = sum(b / (4 * m) for m, b in spec.block_bytes.items())
    llm = _llm(ckpt41, None, block_size=4, kv_cache_memory=int(3 * spec.slot_bytes + 110 * per_token),
               max_num_seqs=3, max_num_batched_tokens=16, max_model_len=100,
               speculative_config={"method": "dspark", "num_speculative_tokens": k})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert all(n > 0 for n in m["accepted_per_position"]) and m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert llm.scheduler.kv.all_free()


def _spec_execute(so):
    """A fake target that always emits token 7 and a fake drafter: drafts are accepted while they are 7;
    each request's next drafts are 7s with an 8 at a position that moves with its length."""
    out = ModelOutput({})
    for c in so.chunks:
        if not c.num_samples:
            continue
        drafts = c.token_ids[len(c.token_ids) - c.num_draft:]
        a = next((i for i, t in enumerate(drafts) if t != 7), len(drafts))
        out.sampled[c.request_id] = [7] * (a + 1)
        n = c.start + len(c.token_ids) - c.num_draft + a
        out.drafts[c.request_id] = [8 if i == n % 5 else 7 for i in range(4)]
    return out


def test_scheduler_preempts_under_speculation_and_loses_nothing():
    kv = KVCacheManager(num_slots=4, num_blocks={4: 6}, block_size=4)  # 96 tokens of state for all
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
                      proposer=ModelDrafts("dspark", 4))
    reqs = [Request(str(i), list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(4)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_unfinished():
        so = sched.schedule()
        assert so.chunks and steps < 1000
        for c in so.chunks:  # a chunk's drafts always fit its cache and its max_tokens
            req = next(r for r in reqs if r.request_id == c.request_id)
            assert len(req.output_token_ids) + c.num_draft + 1 <= 30
            assert len(c.block_tables[4]) * 4 >= (c.start + len(c.token_ids)) // 4  # entries held
        sched.update(so, _spec_execute(so))
        steps += 1
    assert sched.num_preemptions > 0 and sched.spec_stats.num_accepted_tokens > 0
    assert all(r.output_token_ids == [7] * 30 and r.finish_reason == "length" for r in reqs)
    assert kv.all_free()


def test_drafts_are_dropped_rather_than_preempting():
    kv = KVCacheManager(num_slots=2, num_blocks={4: 2}, block_size=4)  # 32 tokens of state
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                      proposer=ModelDrafts("dspark", 4))
    a, b = (Request(i, list(range(1, 16)), SamplingParams(max_tokens=20, ignore_eos=True)) for i in "ab")
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), ModelOutput({"a": [7], "b": [7]}, drafts={"a": [7] * 4, "b": [7] * 4}))
    so = sched.schedule()  # 16 tokens each: their blocks are full, 4 drafts need a block neither can get
    assert [c.num_draft for c in so.chunks] == [0, 0] and sched.num_preemptions == 0


def test_dspark_on_a_checkpoint_with_an_mtp_layer_is_refused(ckpt):
    with pytest.raises(ValueError, match="no DSpark draft stages"):
        _llm(ckpt, None, speculative_config={"method": "dspark", "num_speculative_tokens": 2})


def continuations(prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """(position, token) -> the tokens after it, over each prompt and its output (confident_oracle's truth)."""
    return {(i, t): (p + o)[i + 1:] for p, o in zip(prompts, outputs) for i, t in enumerate(p + o)}


def confident_oracle(monkeypatch, truth: dict, k: int) -> None:
    """DSpark blocks replaced by the true continuation (truth: (position, token) -> the tokens after it) with one
    wrong token at a position that moves with the anchor (every acceptance length occurs), confident before it
    and not after."""
    from deepinfer.worker.drafter import DSparkDrafter

    real = DSparkDrafter.draft

    def oracle(self, anchor_tokens, anchor_pos, slots):
        block = real(self, anchor_tokens, anchor_pos, slots)
        for b, (t, q) in enumerate(zip(anchor_tokens.tolist(), anchor_pos.tolist())):
            nxt = (truth.get((q, t), []) + [0] * k)[:k]
            bad = q % (k + 1)
            if bad < k:
                nxt[bad] = (nxt[bad] + 1) % 1000 + 3
            block.tokens[b, :k] = torch.tensor(nxt)
            block.confidence[b, :k] = torch.tensor([0.95 if j < bad else 0.02 for j in range(k)])
        return block

    monkeypatch.setattr(DSparkDrafter, "draft", oracle)


def test_varlen_verification_keeps_greedy_tokens_and_varies_lengths(ckpt41, monkeypatch):
    """DEEPINFER_ENABLE_MTP_VARLEN: lengths from the drafts' confidences (oracle confidences: high where
    the oracle's draft is right, low after its wrong token) over the start-up steps-per-second table.
    Greedy outputs equal speculation off; steps verify fewer drafts than k where confidence is low."""
    k = 4
    prompts = _prompts(4, read_model_config(ckpt41).vocab_size, seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    want = [o.outputs[0].token_ids for o in _llm(ckpt41, None).generate(prompts, greedy, use_tqdm=False)]
    confident_oracle(monkeypatch, {(i, t): (p + w)[i + 1:] for p, w in zip(prompts, want) for i, t in enumerate(p + w)}, k)
    llm = _llm(ckpt41, None, num_speculative_tokens=k, enable_mtp_varlen=True, max_num_seqs=8)
    assert llm.scheduler.varlen is not None and llm.scheduler.varlen.sps.max_batch >= k + 1
    # the table measured at start-up follows the CPU's load (a busy machine can measure a flat one, where
    # every draft is free to verify): the allocation below runs over a fixed, affine one instead
    most = llm.scheduler.varlen.sps.max_batch
    llm.scheduler.varlen = replace(llm.scheduler.varlen, sps=SPSTable.from_points([(1, 0.010), (most, 0.010 + 0.002 * most)], most))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] < k * m["num_drafts"]  # some steps verify fewer
    assert m["num_accepted_tokens"] / m["num_draft_tokens"] > 0.6  # low-confidence (wrong) drafts left out
    fixed = _llm(ckpt41, None, num_speculative_tokens=k)
    assert [o.outputs[0].token_ids for o in fixed.generate(prompts, greedy, use_tqdm=False)] == want
    mf = fixed.get_metrics()
    assert mf["num_accepted_tokens"] / mf["num_draft_tokens"] < m["num_accepted_tokens"] / m["num_draft_tokens"]


def test_varlen_needs_model_drafts_and_batch_invariance_turns_it_off(ckpt, ckpt41):
    with pytest.raises(ValueError, match="enable_mtp_varlen"):
        _llm(ckpt, 3, enable_mtp_varlen=True)
    assert _llm(ckpt41, None, num_speculative_tokens=2, enable_mtp_varlen=True, max_num_seqs=4,
                batch_invariant=True).scheduler.varlen is None


def test_deepinfer_env_names():
    from deepinfer.config import EngineConfig

    cfg = EngineConfig.from_env({"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "1"})
    assert cfg.speculation == {"method": "dspark", "num_speculative_tokens": 3} and cfg.enable_mtp_varlen
    assert EngineConfig.from_env({"DEEPINFER_USE_NEXTN_DECODE": "0"}).speculation is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.from_env({"DEEPINFER_USE_NEXTN_DECODE": "five"})
    with pytest.raises(ValueError, match="enable_mtp_varlen"):
        EngineConfig.from_env({"DEEPINFER_ENABLE_MTP_VARLEN": "maybe"})
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_speculative_tokens=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _mtp_oracle(monkeypatch, truth: dict):
    """MTPDrafter's drafts replaced by the true next token at anchors of even position (confidence 0.95), a
    wrong one at odd positions (0.02); the MTP layer still runs: its ring is written as without the oracle."""
    from deepinfer.worker.drafter import MTPDrafter

    real = MTPDrafter.propose

    def oracle(self, anchors):
        block = real(self, anchors)
        for b, (t, q) in enumerate(zip(anchors.tokens.tolist(), anchors.pos.tolist())):
            nxt = (truth.get((q, t), []) + [0])[0]
            block.tokens[b, 0] = nxt if q % 2 == 0 else (nxt + 1) % 1000 + 3
            block.confidence[b, 0] = 0.95 if q % 2 == 0 else 0.02
        return block

    monkeypatch.setattr(MTPDrafter, "propose", oracle)


def test_mtp_drafts_keep_greedy_tokens_v4(ckpt):
    """V4's MTP layer proposes one token per step (random weights: its drafts are rejected); with a
    small budget that chunks prompts too. num_speculative_tokens=1 on this checkpoint picks it."""
    from deepinfer.worker.drafter import MTPDrafter

    assert read_model_config(ckpt).num_nextn_predict_layers == 1
    prompts = _prompts(5, CFG["vocab_size"], seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    want = [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]
    for kw in (dict(speculative_config=MTP), dict(num_speculative_tokens=1, max_num_batched_tokens=6, max_num_seqs=3)):
        llm = _llm(ckpt, None, **kw)
        assert isinstance(llm.engine.core.runner.drafter, MTPDrafter)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
        m = llm.get_metrics()
        assert m["num_drafts"] > 0 and m["num_draft_tokens"] == m["num_drafts"]
        assert llm.scheduler.kv.all_free()


def test_mtp_oracle_accepts_and_rejects_with_chunking_v4(ckpt, monkeypatch):
    prompts = _prompts(5, CFG["vocab_size"], seed=10)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    want = [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]
    _mtp_oracle(monkeypatch, {(i, t): (p + w)[i + 1:] for p, w in zip(prompts, want) for i, t in enumerate(p + w)})
    llm = _llm(ckpt, None, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
               block_size=4, max_num_seqs=3, max_num_batched_tokens=7, max_model_len=120)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"] and m["accepted_per_position"] == [m["num_accepted_tokens"]]
    assert llm.scheduler.kv.all_free()


@pytest.mark.parametrize("max_tokens", [3, 14])
def test_mtp_ring_holds_each_position_with_its_true_next_token(ckpt, monkeypatch, max_tokens):
    """After a run with MTP speculation (oracle drafts: accepted and rejected; chunked prefill), the MTP
    layer's ring holds, for the last W computed positions, the keys of one pass of the MTP layer over the
    whole sequence with next tokens = the sequence shifted by one (to fp32 rounding). max_tokens=3 keeps
    prefill chunk boundaries in the window (their rows complete with the next chunk), 14 verify anchors.
    Negative control: the same pass with the last row's next token wrong differs there."""
    from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
    from deepinfer.tools.static_cache import static_v4_cache

    prompt = _prompts(1, CFG["vocab_size"], seed=11)[0]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = _llm(ckpt, None).generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    seq = prompt + out
    _mtp_oracle(monkeypatch, {(i, t): seq[i + 1:] for i, t in enumerate(seq)})
    llm = _llm(ckpt, None, speculative_config=MTP, max_num_seqs=1, max_num_batched_tokens=6)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == out
    if max_tokens > 3:
        assert llm.get_metrics()["num_accepted_tokens"] > 0
    model, cache = llm.model, llm.engine.core.runner.cache
    W, size = model.config.sliding_window, model.config.sliding_window + cache.ring_slack
    positions = torch.arange(len(seq) - 1 - W, len(seq) - 1)  # the last computed position: len(seq) - 2
    got = cache.mtp[0].ring.read(positions % size, torch.float32)  # slot 0: the only request

    def reference(next_ids):
        ref = static_v4_cache(model.config, 1, 256, "float32", "cpu")
        with torch.inference_mode():
            b = build_forward_batch([SeqChunk(0, 0, seq[:-1], ref.static_tables(0))], W, ref.compress_kinds,
                                    ref.block_size, "cpu")
            model.mtp_draft(b, model(b, ref.layers), torch.tensor(next_ids), torch.zeros(0, dtype=torch.long),
                            ref.mtp[0])
        return ref.mtp[0].ring.read(positions % W, torch.float32)

    want = reference(seq[1:])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().amax(-1)
    wrong = reference(seq[1:-1] + [(seq[-1] + 1) % CFG["vocab_size"]])
    assert not torch.allclose(got[-1], wrong[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [2, 3])
def test_chained_mtp_drafts_keep_greedy_tokens_v4(ckpt, k):
    """V4's MTP layer chained on its own output for k drafts a step (worker/drafter.py MTPDrafter): greedy
    outputs equal speculation off, with a small budget that chunks prompts too."""
    prompts, want = _greedy_off(str(ckpt), 6, 0, 24)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    for kw in (dict(speculative_config={"method": "mtp", "num_speculative_tokens": k}),
               dict(num_speculative_tokens=k, max_num_batched_tokens=9, max_num_seqs=3)):
        llm = _llm(ckpt, None, **kw)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
        m = llm.get_metrics()
        assert m["num_drafts"] > 0 and m["num_draft_tokens"] > m["num_drafts"]
        assert llm.scheduler.kv.all_free()


def test_mtp_refuses_dspark_checkpoints(tmp_path):
    from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

    dspark = write_checkpoint(tmp_path / "dspark", PRESETS["tiny-dspark"], seed=1, dtype="fp8")
    with pytest.raises(ValueError, match="no MTP layer"):
        _llm(dspark, None, speculative_config=MTP)


def test_mtp_with_forks_and_varlen_v4(ckpt, monkeypatch):
    """n = 2 forks sharing a prompt (their last prompt row's next token is one sibling's) and
    confidence-scheduled lengths (0 or 1 draft per step): greedy outputs equal speculation off."""
    prompts = _prompts(4, CFG["vocab_size"], seed=12)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    want = [o.outputs[0].token_ids for o in _llm(ckpt, None).generate(prompts, greedy, use_tqdm=False)]
    _mtp_oracle(monkeypatch, {(i, t): (p + w)[i + 1:] for p, w in zip(prompts, want) for i, t in enumerate(p + w)})
    llm = _llm(ckpt, None, speculative_config=MTP, max_num_batched_tokens=16)
    two = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=12, n=2), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in two] == [[w[:12]] * 2 for w in want[:2]]
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    varlen = _llm(ckpt, None, num_speculative_tokens=1, enable_mtp_varlen=True, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in varlen.generate(prompts, greedy, use_tqdm=False)] == want
    m = varlen.get_metrics()
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] / m["num_draft_tokens"] > 0.6  # wrong ones left out
