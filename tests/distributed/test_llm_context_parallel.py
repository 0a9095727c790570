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
        cp_steps = llm.engine._runner.runner.cp_steps
    finally:
        llm.close()
    assert cp_steps == 1  # the long prefill, and only it, went through the split
    for g, w in zip([got[0], short[0]], want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert parallel_state.rank_info() is None


def test_context_parallel_refuses_a_model_without_its_path(tmp_path):
    from deepinfer.distributed.launch import TPWorkerError
    from deepinfer.tools.make_checkpoint import PRESETS

    v41 = write_checkpoint(tmp_path / "v41", PRESETS["tiny41"], seed=3, dtype="fp8")
    with pytest.raises((TPWorkerError, ValueError), match="context-parallel path|context_parallel_size"):
        _llm(v41, context_parallel_size=2)
