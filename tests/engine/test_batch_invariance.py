"""Batch-invariant inference and deterministic (seeded) sampling (issue: DEEPINFER_BATCH_INVARIANT);
the gpu-marked cases run the same checks on CUDA (Triton kernels with fixed tilings, CUDA graphs)."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.layers import invariant
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = PRESETS["tiny"]  # index_topk 4 < visible entries: the indexer really selects
VOCAB = CFG["vocab_size"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("inv") / "ckpt", CFG, seed=3, dtype="fp8")


@pytest.fixture(scope="module")
def ckpt41(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("inv41") / "ckpt", PRESETS["tiny41"], seed=3, dtype="fp8")


def _prompts(lens: list[int], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lens]


def _engine(ckpt, dtype: str, kv: str | None = None, device: str = "cpu", **kw) -> LLM:
    return LLM(str(ckpt), device=device, dtype=dtype, kv_cache_dtype=kv or dtype, kv_cache_memory=64 << 20,
               batch_invariant=True, **kw)


def _gpu(*args):
    return pytest.param(*args, "cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("arch, dtype, kv, device", [
    ("v4", "float32", "float32", "cpu"), ("v4", "bfloat16", "bfloat16", "cpu"),
    ("v41", "float32", "auto", "cpu"), ("v41", "bfloat16", "auto", "cpu"),
    _gpu("v4", "bfloat16", "bfloat16"), _gpu("v4", "float32", "float32"), _gpu("v41", "bfloat16", "auto")])
def test_logprobs_are_bit_identical_across_batch_mixes_and_chunking(request, arch, dtype, kv, device):
    """V4 with exact KV; V4.1 (Engram, CSA2 roles, bounded replay) with its reference cache formats."""
    path = request.getfixturevalue("ckpt" if arch == "v4" else "ckpt41")
    vocab = VOCAB if arch == "v4" else PRESETS["tiny41"]["text_config"]["vocab_size"]
    target = _prompts([61], seed=1, vocab=vocab)[0]
    short, long = _prompts([5, 9, 7], seed=2, vocab=vocab), _prompts([90, 75, 83], seed=3, vocab=vocab)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    runs = {}
    for name, budget, batch in [("solo", 8192, []), ("short neighbours", 8192, short),
                                ("long neighbours", 64, long), ("chunked prompt", 8, []),
                                ("chunked, mixed", 12, short[:1] + long[:1])]:
        llm = _engine(path, dtype, kv, device, max_num_batched_tokens=budget)
        out = llm.generate(batch[:1] + [target] + batch[1:], params, use_tqdm=False)[min(1, len(batch))].outputs[0]
        runs[name] = (out.token_ids, out.logprobs)
    solo = runs.pop("solo")
    for name, got in runs.items():
        assert got[0] == solo[0], name
        assert got[1] == solo[1], name  # every top-5 logprob, bit for bit (==, not close)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_seeded_sampling_is_reproducible_alone_batched_and_across_instances(ckpt, device):
    prompt = _prompts([40], seed=4)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seq_seed=1234)
    alone = _engine(ckpt, "float32", device=device).generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts([12, 50, 30], seed=5)
    mix = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seq_seed=7),
           seeded, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),  # unseeded neighbour
           SamplingParams(temperature=0.9, top_k=20, min_p=0.01, max_tokens=12, ignore_eos=True, seq_seed=99)]
    second = _engine(ckpt, "float32", device=device, max_num_batched_tokens=16)
    batched = second.generate([others[0], prompt, others[1], others[2]], mix, use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone
    assert second.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids == alone  # same instance again
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seq_seed=1235)
    assert second.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    n2 = second.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True,
                                                  seq_seed=1234, n=2), use_tqdm=False)[0].outputs
    assert n2[0].token_ids == alone and n2[1].token_ids != alone  # sample j has its own stream


def test_unseeded_requests_stay_random(ckpt):
    llm = _engine(ckpt, "float32")
    prompt = _prompts([20], seed=6)[0]
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert len({tuple(llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}) > 1


def test_config_switch():
    assert EngineConfig.from_env({"DEEPINFER_BATCH_INVARIANT": "1"}, device="cpu").batch_invariant
    assert not EngineConfig.from_env({}, device="cpu").batch_invariant
    assert not EngineConfig.from_env({"DEEPINFER_BATCH_INVARIANT": "1"}, device="cpu", batch_invariant=False).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig.from_env({"DEEPINFER_BATCH_INVARIANT": "maybe"}, device="cpu")
    assert EngineConfig(device="cuda", batch_invariant=True).batch_invariant  # Triton kernels with fixed tilings


@pytest.mark.parametrize("n, k", [(96, 200), (24, 1024)])  # (24, 1024): one GEMM alone splits K across threads
def test_invariant_linear_rows_do_not_depend_on_the_batch(n, k):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g), torch.randn(40, k, generator=g)
    with invariant.mode(True):
        want = invariant.linear(x[7:8], w)
        for T in (1, 5, 16, 17, 40, 48):
            for pos in (0, T // 2, T - 1):
                batch = torch.randn(T, k, generator=g)
                batch[pos] = x[7]
                assert torch.equal(invariant.linear(batch, w)[pos], want[0])


def test_invariant_attention_ignores_padding_blocks():
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(3, 4, 32, generator=g), torch.randn(3, 21, 32, generator=g)
    valid = torch.rand(3, 21, generator=g) > 0.3
    sinks = torch.randn(4, generator=g)
    base = invariant.attend(q, keys, valid, sinks, 0.2)
    wide = invariant.attend(q, torch.cat((keys, torch.randn(3, 40, 32, generator=g)), 1),
                            torch.cat((valid, torch.zeros(3, 40, dtype=torch.bool)), 1), sinks, 0.2)
    assert torch.equal(base, wide)
    from deepinfer.kernels.sparse_attention import attend
    torch.testing.assert_close(base, attend(q, keys, valid, sinks, 0.2), atol=1e-5, rtol=1e-5)
