"""Attention data parallelism with expert-parallel MoE (executor/, distributed/expert_shard.py) on the CPU: 2 and 4
gloo ranks (spawned) on the tiny V4 checkpoint, fp32 activations and cache, against one process.

Tolerances. Greedy tokens (and seeded samples) are always equal. Logprobs:
* default mode, chunked prefill: within test_tensor_parallel.LOGPROB_TOL = 1e-4 (measured <= 2e-6). Not bit-identical for
  two reasons: every DP rank has its own token budget, so a prompt is prefilled in other chunks than in
  one process (the chunk's attention sums run in another order), and with k = 3 experts a token the
  one-process CPU loop adds its products in expert order, the expert-parallel combine in slot order.
* batch-invariant mode, k = 2, prompts prefilled whole: bit-identical (0.0), EPLB rebalancing
  included: every row is computed as in one process and a sum of two products does not depend on
  their order.
"""
from __future__ import annotations

import dataclasses

import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.distributed.expert_shard import EPLBConfig, initial_placement, load_expert_shard, trunk_moes
from deepinfer.executor.engine import Engine, start_engine
from deepinfer.distributed.expert_parallel import shard_experts
from deepinfer.executor.procs import TPWorkerError
from deepinfer.executor.worker import EngineArgs
from deepinfer.distributed.parallel_state import ParallelConfig
from deepinfer.engine.request import Request
from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from steps import assert_steps_close
from test_tensor_parallel import ROW_LOCAL_BF16_STEP_BOUND, CFG, FORKED, GREEDY, MEMORY, PROMPTS, _assert_same

# a prompt per rank at most: with 4 ranks one is idle for the whole run
PARAMS = [GREEDY, FORKED, GREEDY]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dp") / "ckpt", CFG, seed=11, dtype="fp8")


@pytest.fixture(scope="module")
def ckpt_k2(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dp2") / "ckpt", {**CFG, "num_experts_per_tok": 2}, seed=11,
                            dtype="fp8")


def _engine_kw(**kw) -> dict:
    return {"kv_cache_dtype": "float32", "kv_cache_memory": MEMORY, "max_num_batched_tokens": 16, **kw}


def _args(ckpt, dp: int, ep: bool = True, **kw) -> EngineArgs:
    base = _engine_kw(num_threads=1, timeout_s=60.0, max_num_seqs=8)
    return EngineArgs(str(ckpt), ParallelConfig(data_parallel_size=dp, enable_expert_parallel=ep), **{**base, **kw})


def _one_process(ckpt, prompts, params, **kw) -> list:
    one = LLM(str(ckpt), device="cpu", dtype="float32", skip_tokenizer_init=True, **_engine_kw(**kw))
    return [o.outputs for o in one.generate(prompts, params, use_tqdm=False)]


def _exact(outs) -> list:
    """Per prompt, its completions' tokens, logprobs (floats compared exactly) and finish reasons."""
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in cs] for cs in outs]


@pytest.fixture(scope="module")
def want(ckpt):
    return _one_process(ckpt, PROMPTS, PARAMS)


def test_two_ranks_match_one_process(ckpt, want):
    with start_engine(_args(ckpt, 2)) as eng:
        moe = eng.model.layers[1].ffn
        assert moe.experts.num_experts == CFG["n_routed_experts"] // 2  # the driver keeps its experts only
        assert moe.expert_parallel.experts is moe.experts
        got = eng.generate(PROMPTS, PARAMS)
        assert 0 < eng.fixed_steps < eng._steps  # decode steps took the fixed-capacity exchange
        assert [len(c.decode_state) for c in eng.cores] == [0, 0]  # completions read and dropped
    _assert_same(got, want)  # logprobs within LOGPROB_TOL
    assert parallel_state.rank_info() is None  # the group was left


def test_four_ranks_with_an_idle_rank_and_eplb_rebalancing_match_one_process(ckpt, want):
    """3 prompts on 4 ranks: rank 3 never has a request and joins every MoE layer with zero tokens.
    EPLB every 2 steps, one redundant slot per rank: weights move between steps, requests in flight."""
    t0 = time.monotonic()
    with start_engine(dataclasses.replace(_args(ckpt, 4), eplb=EPLBConfig(interval=2, window=4))) as eng:
        got = eng.generate(PROMPTS, PARAMS)
        assert eng.cores[3].scheduler.num_preemptions == 0 and not eng.cores[3].requests
        assert eng.executor.worker.rebalances == eng._steps // 2 >= 2
        assert eng.executor.worker.remote_slots > 0  # some slots were filled over the process group
    assert time.monotonic() - t0 < 120
    _assert_same(got, want)  # logprobs within LOGPROB_TOL


def test_eplb_rebalancing_after_step_two_is_bit_identical_in_batch_invariant_mode(ckpt_k2):
    """k = 2, prompts prefilled whole (no chunk boundaries of the ranks' own), batch-invariant GEMMs:
    logprobs bit for bit, with the experts moved after step 2 while every request is mid-decode."""
    kw = {"max_num_batched_tokens": 256, "batch_invariant": True}
    want = _one_process(ckpt_k2, PROMPTS, PARAMS, **kw)
    with start_engine(dataclasses.replace(_args(ckpt_k2, 2, **kw), eplb=EPLBConfig(interval=2, window=2))) as eng:
        got = eng.generate(PROMPTS, PARAMS)
        assert eng.executor.worker.rebalances >= 1 and eng.executor.worker.moved_slots > 0 and eng.executor.worker.remote_slots > 0
        placement = eng.model.placement
        start = initial_placement(placement.num_layers, CFG["n_routed_experts"], 2, 1)
        assert not torch.equal(placement.physical_to_logical, start.physical_to_logical)
    assert _exact(got) == _exact(want)


def test_eplb_moves_experts_kept_as_shipped(ckpt):
    """quantized=True: packed FP4 experts (int8) and their E8M0 scales move between ranks as bytes."""
    with start_engine(dataclasses.replace(_args(ckpt, 2, quantized=True), eplb=EPLBConfig(interval=2, window=2))) as eng:
        experts = eng.model.layers[2].ffn.experts
        assert experts.w1.dtype == torch.int8 and experts.w1_scale.dtype == torch.float8_e8m0fnu
        got = eng.generate(PROMPTS, PARAMS)
        assert eng.executor.worker.remote_slots > 0
    _assert_same(got, _one_process(ckpt, PROMPTS, PARAMS, quantization="fp8"))


def test_eplb_moves_experts_repacked_as_fp8_codes(ckpt):
    """repack_fp4_experts=True (LLM sets it on CUDA where each rank's repacked share fits): every rank holds
    its packed FP4 experts as FP8 codes, each projection's scales in the form all ranks agreed on; EPLB moves
    them as bytes; the tokens are those of one process on the shipped formats (the repack is exact)."""
    with start_engine(dataclasses.replace(_args(ckpt, 2, quantized=True, repack_fp4_experts=True), eplb=EPLBConfig(interval=2, window=2))) as eng:
        experts = eng.model.layers[2].ffn.experts
        assert experts.w1.dtype == torch.float8_e4m3fn and experts.w1_scale.dtype == torch.float8_e8m0fnu
        got = eng.generate(PROMPTS, PARAMS)
        assert eng.executor.worker.remote_slots > 0
    _assert_same(got, _one_process(ckpt, PROMPTS, PARAMS, quantization="fp8"))


def test_fewer_prompts_than_ranks_do_not_hang(ckpt, want):
    """One prompt on two ranks, then a second generate on the same engine: the idle rank runs dummy steps."""
    with start_engine(_args(ckpt, 2)) as eng:
        first = eng.generate(PROMPTS[:1], GREEDY)
        second = eng.generate(PROMPTS[1:2], GREEDY)  # least loaded: rank 0 again
    assert first[0][0].token_ids == want[0][0].token_ids
    _assert_same(second, _one_process(ckpt, PROMPTS[1:2], GREEDY))


def test_v41_two_ranks_with_eplb_match_one_process(tmp_path):
    """V4.1: CSA2 roles, Engram (replicated), the router's image bias; EPLB every 2 steps."""
    c = PRESETS["tiny41"]
    ck = write_checkpoint(tmp_path / "ckpt", {**c, "text_config": {**c["text_config"], "index_topk": 64}},
                          seed=5, dtype="fp8")
    with start_engine(dataclasses.replace(_args(ck, 2), eplb=EPLBConfig(interval=2, window=2))) as eng:
        got = eng.generate(PROMPTS, PARAMS)
        assert eng.executor.worker.remote_slots > 0
    _assert_same(got, _one_process(ck, PROMPTS, PARAMS))


def test_an_expert_shard_is_prepared_as_load_model_leaves_a_model(tmp_path, monkeypatch):
    """load_expert_shard hands its loaded rank model to prepare_fp8_linears, as load_model does."""
    import deepinfer.distributed.expert_shard as dp_module

    seen = []
    monkeypatch.setattr(dp_module, "prepare_fp8_linears", lambda net: seen.append(net))
    ck = write_checkpoint(tmp_path / "ckpt", CFG, seed=4, dtype="fp8")
    part = load_expert_shard(str(ck), 0, 2, dtype=torch.float32, device="cpu", quantized=True, min_numel=64)
    assert seen == [part]


@pytest.mark.parametrize("model, quantized", [("v4", True), ("v41", False)])
def test_a_rank_loaded_alone_holds_its_slots_and_everything_else_whole(tmp_path, model, quantized):
    """load_expert_shard (large tensors on the meta device, only the rank's range of experts read) holds
    what load_model + shard_experts hold: FP8/FP4 experts with their scales as shipped, replica slots
    included; every other tensor (draft layers' experts too) whole. min_numel=64: nearly every tensor
    takes the meta path."""
    c = PRESETS["tiny41"] if model == "v41" else CFG
    ck = write_checkpoint(tmp_path / "ckpt", c, seed=4, dtype="fp8")
    whole, _ = load_model(ck, dtype=torch.float32, quantized=quantized)
    want = whole.state_dict()
    for r in range(2):
        part = load_expert_shard(str(ck), r, 2, dtype=torch.float32, device="cpu", quantized=quantized,
                                 redundant_per_rank=1, min_numel=64)
        got = part.state_dict()
        assert got.keys() == want.keys()
        sliced = {}
        for layer, moe in enumerate(trunk_moes(whole)):
            local = shard_experts(moe.experts, part.placement, layer, r, 2)
            sliced |= {f"layers.{layer}.ffn.experts.{k}": t for k, t in local.state_dict().items()}
        assert len(sliced) >= 3 * len(trunk_moes(whole))
        for k, t in want.items():
            t = sliced.get(k, t)
            bits = (lambda x: x.view(torch.uint8)) if t.element_size() == 1 else (lambda x: x)  # noqa: E731
            assert got[k].shape == t.shape and torch.equal(bits(got[k]), bits(t)), k
        experts = part.config.n_routed_experts
        assert all(m.experts.num_experts == experts // 2 + 1 for m in trunk_moes(part))


def raise_on_rank1(rank: int, step: int) -> None:
    if rank == 1 and step == 2:
        raise RuntimeError("injected fault in rank 1")


def test_a_rank_that_raises_ends_the_run_with_its_error(ckpt):
    eng = start_engine(_args(ckpt, 2, step_hook=raise_on_rank1))
    reqs = [Request(str(i), p, GREEDY, 1) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        eng.add_request(r)
    t0 = time.monotonic()
    with pytest.raises(TPWorkerError, match="data-parallel rank 1 failed: RuntimeError: injected fault") as err:
        while eng.has_unfinished():
            eng.step()
    assert time.monotonic() - t0 < 30 and err.value.rank == 1
    assert all(r.finished and r.finish_reason == "abort" for r in reqs)  # every rank's requests
    with pytest.raises(TPWorkerError):  # the engine is closed
        eng.add_request(Request("x", PROMPTS[0], GREEDY, 1))
    assert parallel_state.rank_info() is None


def test_an_update_that_raises_on_one_rank_still_applies_the_others(ckpt):
    """The driver applies every rank's output before it raises the first rank's error."""
    with start_engine(_args(ckpt, 2)) as eng:
        reqs = [Request(str(i), PROMPTS[1], GREEDY, 1) for i in range(2)]  # 4 tokens: prefilled in one step
        for r in reqs:
            eng.add_request(r)
        eng.cores[0].finish_step = lambda st: (_ for _ in ()).throw(RuntimeError("update failed"))
        with pytest.raises(RuntimeError, match="update failed"):
            eng.step()
        assert len(reqs[1].output_token_ids) == 1 and not reqs[0].output_token_ids


def test_layouts_not_launched_are_refused_by_name(ckpt):
    with pytest.raises(ValueError, match="enable_expert_parallel.*needs data_parallel_size > 1"):
        EngineArgs(str(ckpt), ParallelConfig(enable_expert_parallel=True))
    with pytest.raises(ValueError, match="enable_expert_parallel: with tensor_parallel_size=2"):
        EngineArgs(str(ckpt), ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="enable_eplb: .*enable_expert_parallel=True"):
        _args(ckpt, 2, ep=False, eplb=EPLBConfig())
    with pytest.raises(ValueError, match="interval"):
        EPLBConfig(interval=0)
    with pytest.raises(ValueError, match="redundant_per_rank: expected 0 .. 4"):
        initial_placement(2, 8, 2, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, gpus", [("gloo", 1), ("nccl", 2)])
def test_two_ranks_on_the_gpu_path_match_one_process_in_bf16(ckpt, backend, gpus):
    """bf16 on CUDA (grouped-GEMM experts, Triton attention), EPLB every 2 steps; gloo lets both ranks
    share one GPU (NCCL refuses two ranks on a device). bf16 GEMMs over other row counts round apart
    from one process: every greedy step against one process (steps.py)."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    _gpu_steps_match(ckpt, "none", f"DP=2 + EP + EPLB bf16, {backend}", backend=backend)


@pytest.mark.gpu
def test_two_ranks_hold_repacked_fp4_experts_on_the_gpu(ckpt):
    """The shipped formats on CUDA, two gloo ranks sharing the GPU, each holding its FP4 experts as FP8 codes
    (as one process does), EPLB moving them: every greedy step against one process (steps.py)."""
    _gpu_steps_match(ckpt, "fp8", "DP=2 + EP + EPLB, FP8 expert codes, gloo", quantized=True,
                     repack_fp4_experts=True)


def _gpu_steps_match(ckpt, quantization: str, label: str, backend: str = "gloo", **rank_kw) -> None:
    kw = {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    one = LLM(str(ckpt), skip_tokenizer_init=True, enforce_eager=True, quantization=quantization,
              **{**_engine_kw(), **kw})
    fp8 = quantization == "fp8"
    assert not fp8 or one.model.layers[2].ffn.experts.w1.dtype == torch.float8_e4m3fn
    want = [o.outputs for o in one.generate(PROMPTS, params, use_tqdm=False)]
    one.close()
    with start_engine(dataclasses.replace(_args(ckpt, 2, backend=backend, **rank_kw, **kw), eplb=EPLBConfig(interval=2, window=2))) as eng:
        assert not fp8 or eng.model.layers[2].ffn.experts.w1.dtype == torch.float8_e4m3fn
        got = eng.generate(PROMPTS, params)
        assert eng.executor.worker.rebalances >= 2 and eng.fixed_steps > 0
    assert_steps_close(got, want, ROW_LOCAL_BF16_STEP_BOUND, label)


@pytest.mark.parametrize("ep", [True, False])
def test_llm_with_two_data_parallel_ranks_matches_one_process(ckpt, want, ep):
    """LLM starts the engine itself; without expert parallelism every rank holds all the experts."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", skip_tokenizer_init=True, data_parallel_size=2,
              enable_expert_parallel=ep, enable_eplb=ep, max_num_seqs=8, **_engine_kw())
    try:
        assert isinstance(llm.engine, Engine) and len(llm.engine.cores) == 2
        experts = llm.model.layers[1].ffn.experts.num_experts
        assert experts == ((CFG["n_routed_experts"] + 2) // 2 if ep else CFG["n_routed_experts"])  # + 1 replica a rank
        got = [o.outputs for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        with pytest.raises(ValueError, match=r"prompts\[0\]: .*outside the vocabulary"):  # LLM's checks still run
            llm.generate([[10 ** 9]], GREEDY, use_tqdm=False)
    finally:
        llm.close()
    _assert_same(got, want)  # logprobs within LOGPROB_TOL
    assert parallel_state.rank_info() is None


def test_llm_takes_vllms_eplb_config(ckpt, want, monkeypatch):
    """eplb_config's vLLM keys reach the engine (num_redundant_experts in all, spread over the ranks) and
    rebalancing every 2 steps keeps one process's tokens; a total that does not divide is refused."""
    from deepinfer.executor import multiproc

    seen = []
    real = multiproc.MultiprocExecutor.__init__

    def spy(self, args):
        seen.append(args.eplb)
        real(self, args)

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", spy)
    kw = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, data_parallel_size=2,
              enable_expert_parallel=True, enable_eplb=True, max_num_seqs=8, **_engine_kw())
    with pytest.raises(ValueError, match="num_redundant_experts: 3 is not a multiple of data_parallel_size=2"):
        LLM(str(ckpt), eplb_config={"num_redundant_experts": 3}, **kw)
    llm = LLM(str(ckpt), eplb_config={"step_interval": 2, "window_size": 3, "num_redundant_experts": 4}, **kw)
    try:
        got = [o.outputs for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.close()
    assert seen == [EPLBConfig(interval=2, window=3, redundant_per_rank=2)]
    _assert_same(got, want)


@pytest.mark.parametrize("dtype, fits", [("bfloat16", True), ("bfloat16", False), ("float32", True)])
def test_llm_asks_the_ranks_to_repack_where_each_share_fits(ckpt, monkeypatch, dtype, fits):
    """On CUDA the driver decides the FP4 repack before any rank starts, as one process does: bf16
    activations and the repacked model fitting with the experts split over the expert-parallel ranks
    (repack_fits with ep_size 2); the decision reaches every rank through EngineArgs."""
    import deepinfer.llm as llm_module
    from deepinfer.executor import multiproc

    class Started(Exception):
        pass

    asked, args_seen = [], []

    def repack_fits(weights, available, reserve, ep_size=1):
        asked.append(ep_size)
        return fits

    def executor(args):
        args_seen.append(args)
        raise Started

    monkeypatch.setattr(llm_module, "repack_fits", repack_fits)
    monkeypatch.setattr(multiproc, "MultiprocExecutor", executor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    with pytest.raises(Started):
        LLM(str(ckpt), device="cuda", dtype=dtype, quantization="fp8", data_parallel_size=2,
            enable_expert_parallel=True, skip_tokenizer_init=True, **_engine_kw())
    assert asked == ([2] if dtype == "bfloat16" else [])
    assert args_seen[0].repack_fp4_experts is (fits and dtype == "bfloat16")
