"""LLM(context_parallel_size=N) starts the context-parallel ranks itself: a long prompt's prefill is
split over them (zig-zag, distributed/context_parallel.py) and the tokens and logprobs equal one
process's bit for bit (fp32, the whole prompt in one aligned step: see test_context_parallel.py)."""
from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.tools.make_checkpoint import write_checkpoint
from test_context_parallel import CFG, PROMPT

GREEDY = SamplingParams(temperature=0, max_tokens=5, logprobs=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llm-cp") / "ckpt", CFG, seed=11, dtype="fp8")


def _llm(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
               max_num_batched_tokens=512, skip_tokenizer_init=True, **kw)


def test_llm_with_two_context_parallel_ranks_matches_one_process(ckpt):
    one = _llm(ckpt)  # each prompt alone, as below (batch invariance is not asked for)
    want = [one.generate([p], GREEDY, use_tqdm=False)[0] for p in (PROMPT, PROMPT[:40])]
    llm = _llm(ckpt, context_parallel_size=2)
    try:
        got = llm.generate([PROMPT], GREEDY, use_tqdm=False)  # one request: its prefill is one CP step
        short = llm.generate([PROMPT[:40]], GREEDY, use_tqdm=False)  # too short to split: every rank alike
        cp_steps = llm.engine.executor.worker.runner.cp_steps
    finally:
        llm.close()
    assert cp_steps == 1  # the long prefill, and only it, went through the split
    for g, w in zip([got[0], short[0]], want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert parallel_state.rank_info() is None


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from deepinfer.tools.make_checkpoint import PRESETS

    return write_checkpoint(tmp_path_factory.mktemp("llm-cp41") / "v41", PRESETS["tiny41"], seed=3, dtype="fp8")


def _v41_cp_matches_one_process(v41, **kw) -> None:
    """A 128-token prompt's prefill split once over 2 CP ranks: tokens and logprobs equal one process's."""
    want = _llm(v41, **kw).generate([PROMPT[:128]], GREEDY, use_tqdm=False)[0]
    llm = _llm(v41, context_parallel_size=2, **kw)
    try:
        got = llm.generate([PROMPT[:128]], GREEDY, use_tqdm=False)[0]
        cp_steps = llm.engine.executor.worker.runner.cp_steps
    finally:
        llm.close()
    assert cp_steps == 1
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs


def test_v41_with_exact_prefill_matches_one_process(v41):
    """V4.1 with yoco_prefill_truncation_mode="none", batch-invariant (bit for bit on the CPU: see
    test_context_parallel.py)."""
    _v41_cp_matches_one_process(v41, yoco_prefill_truncation_mode="none", batch_invariant=True)


def test_v41_with_bounded_replay_matches_one_process(v41):
    """V4.1's default prefill (bounded replay, keep 24 rows), batch-invariant: the split ends below the prompt's
    replay_from (104 of 128), its rows stopping at the last KV source; the kept 24 run as an ordinary step, as
    one process's one step stops the same rows at the same layer."""
    _v41_cp_matches_one_process(v41, yoco_prefill_keep_tokens=24, batch_invariant=True)
