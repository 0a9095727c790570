"""LLM(tensor_parallel_size=N) starts the tensor-parallel launcher itself: tokens equal to one process,
logprobs within test_tensor_parallel.LOGPROB_TOL (why not bit-identical: see that file); the other
parallel sizes are still refused."""
from __future__ import annotations

import pytest

from deepinfer import LLM
from deepinfer.distributed import parallel_state
from deepinfer.tools.make_checkpoint import write_checkpoint
from test_tensor_parallel import CFG, FORKED, GREEDY, MEMORY, PROMPTS, _assert_same


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llm-tp") / "ckpt", CFG, seed=5, dtype="fp8")


def _llm(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=MEMORY,
               max_num_batched_tokens=16, skip_tokenizer_init=True, **kw)


def test_llm_with_two_tensor_parallel_ranks_matches_one_process(ckpt):
    params = [GREEDY, FORKED, GREEDY]
    want = [o.outputs for o in _llm(ckpt).generate(PROMPTS, params, use_tqdm=False)]
    llm = _llm(ckpt, tensor_parallel_size=2)
    try:
        assert llm.model.tensor_parallel is not None  # the driver holds its shard, not the whole model
        got = [o.outputs for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        with pytest.raises(ValueError, match=r"prompts\[0\]: .*outside the vocabulary"):  # LLM's checks still run
            llm.generate([[10 ** 9]], GREEDY, use_tqdm=False)
        again = [o.outputs for o in llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)]
    finally:
        llm.close()
    _assert_same(got, want)
    _assert_same(again, want[:1])
    assert parallel_state.rank_info() is None  # close() left the group


def test_tensor_parallel_refuses_host_engram_tables(ckpt):
    with pytest.raises(ValueError, match="engram_device"):
        _llm(ckpt, tensor_parallel_size=2, engram_device="cpu")
