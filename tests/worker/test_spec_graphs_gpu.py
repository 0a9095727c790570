"""Speculative steps replayed as CUDA graphs (worker/cuda_graph.py at q tokens a request, worker/draft_graphs.py):
greedy outputs and logprobs equal the eager speculative engine's, and speculation off's, bit for bit under
batch-invariant numerics (bf16, the V4.1 cache formats); the CPU twin is tests/engine/test_spec_graphs.py."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.tools.demo import resolve_demo
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt41(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("g41") / "ckpt", PRESETS["tiny41"], seed=5, dtype="fp8")


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Noise, then a motif repeated (the demo's drafts and prompt lookup find something to accept)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        noise = torch.randint(3, vocab, (8 + i % 13,), generator=g).tolist()
        motif = torch.randint(3, vocab, (3 + i % 5,), generator=g).tolist()
        out.append([0] + noise + motif * 6)
    return out


def _run(path, spec, eager: bool, prompts, max_tokens: int = 24, **kw):
    kw = {"dtype": "bfloat16", "batch_invariant": True, **kw}
    # (max_model_len bounds the graphs captured at start-up: the prompts hold at most 63 tokens)
    llm = LLM(str(path), device="cuda", enforce_eager=eager, kv_cache_memory=1 << 30, max_model_len=64 + max_tokens,
              max_num_seqs=max(len(prompts), 1), skip_tokenizer_init=True, speculative_config=spec, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


@pytest.mark.parametrize("spec", [{"method": "dspark", "num_speculative_tokens": 4},
                                  {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}],
                         ids=["dspark", "ngram"])
def test_graphed_verify_steps_equal_eager_and_speculation_off(ckpt41, spec):
    prompts = _prompts(6, PRESETS["tiny41"]["text_config"]["vocab_size"], seed=0)
    off, _ = _run(ckpt41, None, False, prompts)
    eager, _ = _run(ckpt41, spec, True, prompts)
    graphed, llm = _run(ckpt41, spec, False, prompts)
    runner = llm.engine.core.runner
    assert set(runner.eager_steps) <= {"prefill, n > 1 or prompt logprobs"}  # every verify step on the graphs
    if spec["method"] == "dspark":
        assert runner.drafter.graphs.graphs and runner.ahead_steps  # the drafter's blocks, verify steps ahead
    assert graphed == eager == off  # tokens and every top-3 logprob, bit for bit


@pytest.mark.parametrize("concurrency", [1, 16, 64])
def test_demo_dspark_greedy_equals_speculation_off(concurrency):
    """The trained demo (its drafts are accepted at times): speculation on equals off at every concurrency."""
    path = resolve_demo("demo")
    prompts = _prompts(concurrency, 1000, seed=concurrency)
    off, _ = _run(path, None, False, prompts, 48)
    on, llm = _run(path, {"method": "dspark", "num_speculative_tokens": 5}, False, prompts, 48)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert [lp for _, lp in on] == [lp for _, lp in off]
    assert llm.get_metrics()["num_drafts"] > 0 and llm.engine.core.runner.ahead_steps


@pytest.mark.parametrize("concurrency", [1, 16, 64])
def test_demo_dspark_equals_speculation_off_in_fp32_with_exact_caches(concurrency):
    """Issue 39 item 6: without batch invariance, fp32 weights and activations and fp32 caches (no rounding
    through the V4.1 cache formats). What differs from speculation off is only the batch's shape (verify
    chunks of 6 tokens a request against 1), so a greedy divergence here would be a bug, not rounding."""
    path = resolve_demo("demo")
    prompts = _prompts(concurrency, 1000, seed=100 + concurrency)
    exact = dict(dtype="float32", kv_cache_dtype="float32", batch_invariant=False)
    off, _ = _run(path, None, False, prompts, 48, **exact)
    on, llm = _run(path, {"method": "dspark", "num_speculative_tokens": 5}, False, prompts, 48, **exact)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert llm.get_metrics()["num_drafts"] > 0
