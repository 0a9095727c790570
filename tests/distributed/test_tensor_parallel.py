"""Tensor parallelism on the CPU: 2 and 4 gloo ranks (torch.multiprocessing, spawn) on the tiny V4
checkpoint, fp32 activations and cache, against one process; a failing rank ends the run with its
error, not a hang.

Tolerance: logprobs within 1e-4 of one process. They cannot be bit-identical: each rank's attention
and MoE output is a partial sum (its heads' rows of wo_b, its experts) and the all-reduce adds the
partials in another order than one GEMM / one expert loop does; in fp32 that moves a logprob by a
few 1e-6 over the tiny model's 6 layers (measured: <= 2e-6). Greedy tokens must be equal.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.executor import multiproc
from deepinfer.executor.engine import generate as generate_tp, start_engine
from deepinfer.executor.procs import TPWorkerError
from deepinfer.executor.worker import EngineArgs
from deepinfer.distributed.parallel_state import ParallelConfig
from deepinfer.distributed.tensor_parallel import load_shard, shard_model, shard_moe
from deepinfer.engine.request import Request
from deepinfer.layers.moe import MoE
from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from steps import assert_steps_close

CFG = {**PRESETS["tiny"], "index_topk": 64}  # top-k >= entries: no indexer near-ties between engines
LOGPROB_TOL = 1e-4
# bf16 on the GPU against one process, every greedy step (steps.py), measured on an H100 at 3f6619c
# (benchmarks/results/2026-12-07-h100-gpu-tests-parallel-3f6619c.log): TP=2 0.214 nats, from bf16 partial sums
# (each rank's wo_b / expert outputs rounded to bf16 before the all-reduce; later steps also read kv computed from
# them: the first token alone was 0.064); DP + EP and CP 0 (no partial sums: rows computed as one process does)
TP_BF16_STEP_BOUND = 0.25
ROW_LOCAL_BF16_STEP_BOUND = 0.0
MEMORY = 16 << 20
PROMPTS = [[0, 5, 17, 33, 99, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300, 301, 302, 303], [0, 44, 45, 46],
           [0] + list(range(500, 537))]
# chunked prefill (16 tokens a step) and n=2 (the second sample forks from the first's prefill)
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
FORKED = SamplingParams(temperature=0.8, max_tokens=6, logprobs=2, n=2, seq_seed=7)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", CFG, seed=11, dtype="fp8")


def _args(ckpt, tp: int, **kw) -> EngineArgs:
    base = dict(kv_cache_dtype="float32", kv_cache_memory=MEMORY, max_num_batched_tokens=16, num_threads=1,
                timeout_s=60.0)
    return EngineArgs(str(ckpt), ParallelConfig(tensor_parallel_size=tp), **{**base, **kw})


def _assert_same(got, want) -> None:
    """got/want: per prompt, its completions (CompletionOutput lists)."""
    worst = 0.0
    for g_outs, w_outs in zip(got, want, strict=True):
        for g, w in zip(g_outs, w_outs, strict=True):
            assert g.token_ids == w.token_ids
            assert g.finish_reason == w.finish_reason
            for gl, wl, t in zip(g.logprobs, w.logprobs, w.token_ids, strict=True):
                assert gl.keys() == wl.keys()
                worst = max(worst, max(abs(gl[k] - wl[k]) for k in wl))
    assert worst <= LOGPROB_TOL, worst


def _one_process(ckpt, params) -> list:
    one = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=MEMORY,
              max_num_batched_tokens=16)
    return [o.outputs for o in one.generate(PROMPTS, params, use_tqdm=False)]


def test_two_ranks_match_one_process(ckpt):
    params = [GREEDY, FORKED, GREEDY]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # rank 0 runs in this process with num_threads=1 ...
    try:
        _assert_same(generate_tp(_args(ckpt, 2), PROMPTS, params), _one_process(ckpt, params))
        assert torch.get_num_threads() == 2  # ... and closing the engine gives the process its own back
    finally:
        torch.set_num_threads(threads)
    assert parallel_state.rank_info() is None  # the group was left


def test_four_ranks_match_one_process_and_the_driver_holds_its_shard_only(ckpt):
    """tp=4 > o_groups=2: two ranks share each output group (the column-split path of wo_a)."""
    params = [GREEDY, FORKED, GREEDY]
    want = _one_process(ckpt, params)
    with start_engine(_args(ckpt, 4)) as eng:
        m, c = eng.model, eng.model.config
        shard = m.tensor_parallel
        assert (shard.rank, shard.size) == (0, 4)
        attn, moe = m.layers[1].attn, m.layers[1].ffn
        assert attn.n_heads == c.num_attention_heads // 4 and attn.attn_sink.shape == (attn.n_heads,)
        assert attn.wq_b.weight.shape == (attn.n_heads * c.head_dim, c.q_lora_rank)
        assert attn.o_groups == 1 and attn.wo_a.weight.shape == (c.o_lora_rank, c.num_attention_heads * c.head_dim // 4)
        assert attn.wo_b.weight.shape == (c.hidden_size, c.o_lora_rank)
        assert attn.wkv.weight.shape == (c.head_dim, c.hidden_size)  # the KV head: whole
        assert moe.experts.w1.shape[0] == c.n_routed_experts // 4 and moe.experts.num_global == c.n_routed_experts
        assert moe.shared_experts.w1.weight.shape[0] == c.moe_intermediate_size // 4
        assert m.embed.weight.shape[0] == c.vocab_size and m.head.weight.shape[0] == c.vocab_size
        assert len(shard.reduced) == 2 * (c.num_hidden_layers + c.num_nextn_predict_layers)
        assert "layers.1.attn.wo_b" in shard.reduced and "layers.1.ffn" in shard.reduced
        got = eng.generate(PROMPTS, params)
    _assert_same(got, want)


def test_v41_two_ranks_match_one_process(tmp_path):
    """V4.1: CSA2 roles, Engram (replicated), DSpark stages sharded like the trunk."""
    c = PRESETS["tiny41"]
    ck = write_checkpoint(tmp_path / "ckpt", {**c, "text_config": {**c["text_config"], "index_topk": 64}},
                          seed=5, dtype="fp8")
    _assert_same(generate_tp(_args(ck, 2), PROMPTS, GREEDY), _one_process(ck, GREEDY))


def test_checkpoint_formats_kept_as_shipped_shard_on_block_bounds(tmp_path):
    """quantized=True: FP8 block weights sliced with their scales, FP4 experts by whole experts; with
    repack_fp4_experts each rank holds its experts as FP8 codes (exact: the same tokens)."""
    ck = write_checkpoint(tmp_path / "ckpt", {**CFG, "o_lora_rank": 32}, seed=3, dtype="fp8")
    want = generate_tp(_args(ck, 1, quantized=True), PROMPTS[:2], GREEDY)
    got = generate_tp(_args(ck, 2, quantized=True), PROMPTS[:2], GREEDY)
    _assert_same(got, want)
    _assert_same(generate_tp(_args(ck, 2, quantized=True, repack_fp4_experts=True), PROMPTS[:2], GREEDY), want)


def test_a_shard_is_prepared_as_load_model_leaves_a_model(tmp_path, monkeypatch):
    """load_shard hands its loaded shard to prepare_fp8_linears (fp32 W8A8 scales on a GPU), as load_model does."""
    import deepinfer.distributed.tensor_parallel as tp_module

    seen = []
    monkeypatch.setattr(tp_module, "prepare_fp8_linears", lambda net: seen.append(net))
    ck = write_checkpoint(tmp_path / "ckpt", {**CFG, "o_lora_rank": 32}, seed=4, dtype="fp8")
    part = load_shard(ck, 1, 2, dtype=torch.float32, device="cpu", quantized=True, min_numel=64)
    assert seen == [part]


@pytest.mark.parametrize("model, quantized, tp", [("v4", True, 2), ("v41", False, 4)])
def test_a_shard_loaded_alone_equals_the_whole_model_sliced(tmp_path, model, quantized, tp):
    """load_shard (large tensors built on the meta device, only the rank's part read) holds exactly
    what load_model + shard_model hold: FP8 weights with their scale blocks, FP4 experts by expert,
    V4.1's Engram tables and DSpark stages. min_numel=64: nearly every tensor takes the meta path."""
    c = PRESETS["tiny41"] if model == "v41" else {**CFG, "o_lora_rank": 32}
    ck = write_checkpoint(tmp_path / "ckpt", c, seed=4, dtype="fp8")
    for r in range(tp):
        part = load_shard(ck, r, tp, dtype=torch.float32, device="cpu", quantized=quantized, min_numel=64)
        whole, _ = load_model(ck, dtype=torch.float32, quantized=quantized)
        shard_model(whole, r, tp)
        got, want = part.state_dict(), whole.state_dict()
        assert got.keys() == want.keys()
        for k, t in want.items():
            bits = (lambda x: x.view(torch.uint8)) if t.element_size() == 1 else (lambda x: x)  # noqa: E731
            assert got[k].shape == t.shape and torch.equal(bits(got[k]), bits(t)), k
        assert torch.equal(part.inv_freq_compress, whole.inv_freq_compress)  # computed, not loaded


def raise_on_rank1(rank: int, step: int) -> None:
    if rank == 1 and step == 2:
        raise RuntimeError("injected fault in rank 1")


def hang_on_rank1(rank: int, step: int) -> None:
    if rank == 1 and step == 2:
        time.sleep(600)


def _run_until_error(args: EngineArgs) -> tuple[TPWorkerError, list[Request], float]:
    eng = start_engine(args)
    reqs = [Request(str(i), p, GREEDY, 1) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        eng.add_request(r)
    t0 = time.monotonic()
    with pytest.raises(TPWorkerError) as err:
        while eng.has_unfinished():
            eng.step()
    took = time.monotonic() - t0
    with pytest.raises(TPWorkerError):  # closed: every later step says why
        eng.step()
    assert parallel_state.rank_info() is None and not eng.executor._procs
    return err.value, reqs, took


def test_a_rank_that_raises_ends_the_run_with_its_error(ckpt):
    err, reqs, took = _run_until_error(_args(ckpt, 2, step_hook=raise_on_rank1, timeout_s=60.0))
    assert err.rank == 1
    assert "tensor-parallel rank 1 failed: RuntimeError: injected fault in rank 1" in str(err)
    assert any("raise_on_rank1" in d for d in err.details)  # the rank's traceback
    assert took < 30  # the closed connection ends the driver's collective; no wait for timeout_s
    assert all(r.finished and r.finish_reason == "abort" and "rank 1" in r.error for r in reqs)


def test_a_stuck_rank_ends_the_run_after_the_timeout(ckpt, monkeypatch):
    monkeypatch.setattr(multiproc, "REPORT_WAIT_S", 1.0)
    err, reqs, took = _run_until_error(_args(ckpt, 2, step_hook=hang_on_rank1, timeout_s=3.0))
    assert err.rank is None and "no other rank reported an error" in str(err) and "timeout_s=3.0" in str(err)
    assert took < 30
    assert all(r.finished and r.finish_reason == "abort" for r in reqs)


def test_moe_shards_sum_to_the_whole_layer():
    """Each rank's MoE output (its experts, its shared-expert columns) sums to one process's."""
    torch.manual_seed(0)
    moe = MoE(32, 16, 8, 3, 1, 50, False, 1.5, 10.0, torch.float32)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x, ids = torch.randn(11, 32), torch.randint(0, 50, (11,))
    whole = moe(x, ids)
    for tp in (2, 4, 8):
        parts = []
        for r in range(tp):
            m = copy.deepcopy(moe)
            shard_moe(m, r, tp)
            parts.append(m(x, ids))
        torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)  # fp32, summed in another order


def test_expert_shards_sum_to_the_whole_on_the_grouped_path():
    """The GPU's grouped-GEMM path (run on the CPU through the kernels' references): pairs routed to
    another rank's experts sort past the last offset, are never computed and add 0."""
    torch.manual_seed(1)
    moe = MoE(32, 16, 8, 3, 1, 50, False, 1.5, 10.0, torch.bfloat16)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(13, 32, dtype=torch.bfloat16)
    weights, idx = moe.gate(x, torch.randint(0, 50, (13,)))
    whole = moe.experts.grouped(x, weights, idx)
    for tp in (2, 4):
        parts = []
        for r in range(tp):
            m = copy.deepcopy(moe)
            shard_moe(m, r, tp)
            parts.append(m.experts.grouped(x, weights, idx))
        torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)  # fp32 sums of the same bf16 rows


def test_sizes_that_do_not_divide_are_refused_by_name(ckpt):
    model, _ = load_model(str(ckpt), dtype=torch.float32)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads"):
        shard_model(model, 0, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="backend: expected 'gloo' or 'nccl', got 'mpi'"):
        parallel_state.init_parallel(ParallelConfig(), 0, "cpu", "file:///nonexistent/store", backend="mpi")


def test_collectives_are_the_identity_without_a_group():
    x = torch.randn(3, 4)
    assert parallel_state.tp_all_reduce(x) is x and parallel_state.tp_all_gather(x) is x
    assert parallel_state.tp_size() == 1 and parallel_state.rank_info() is None


@pytest.mark.gpu
def test_moe_shards_sum_to_the_whole_layer_on_the_gpu():
    """The grouped-GEMM path (bf16 on CUDA): another rank's pairs run through expert 0 with weight 0."""
    torch.manual_seed(0)
    moe = MoE(256, 128, 16, 4, 1, 50, False, 1.5, 10.0, torch.bfloat16).cuda()
    for p in moe.parameters():
        p.data.normal_(0, 0.05)
    x, ids = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16), torch.randint(0, 50, (40,), device="cuda")
    whole = moe(x, ids).float()
    for tp in (2, 4):
        parts = []
        for r in range(tp):
            m = copy.deepcopy(moe)
            shard_moe(m, r, tp)
            parts.append(m(x, ids).float())
        torch.testing.assert_close(sum(parts), whole, rtol=2e-2, atol=2e-2)  # bf16 partials, rounded apart


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_on_two_gpus_matches_one_process(ckpt):
    """NCCL for the all-reduces, gloo for the step plans; fp32 activations (no TF32)."""
    params = [GREEDY, FORKED, GREEDY]
    want = generate_tp(_args(ckpt, 1, device="cuda"), PROMPTS, params)
    got = generate_tp(_args(ckpt, 2, device="cuda"), PROMPTS, params)
    _assert_same(got, want)


def probe_groups(rank: int, init_method: str, out: str) -> None:
    """One rank of a tp=2 x dp=2 world: what each group sums and gathers."""
    import torch.distributed as dist

    info = parallel_state.init_parallel(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2), rank, "cpu",
                                        init_method, timeout_s=30)
    tp_sum = parallel_state.tp_all_reduce(torch.tensor([float(rank)])).item()
    gathered = parallel_state.tp_all_gather(torch.tensor([rank]), dim=0).tolist()
    dp_sum = torch.tensor([float(rank)])
    dist.all_reduce(dp_sum, group=parallel_state.dp_group())
    objs = parallel_state.all_gather_object(rank * 10)
    torch.save({"info": (info.tp_rank, info.tp_size, info.dp_rank, info.dp_size), "tp_sum": tp_sum,
                "gathered": gathered, "dp_sum": dp_sum.item(), "objs": objs}, f"{out}/{rank}.pt")
    parallel_state.destroy()


def test_groups_lay_out_tensor_parallel_ranks_consecutively(tmp_path):
    """rank = dp_rank * tp + tp_rank: TP groups {0,1} {2,3}, DP groups {0,2} {1,3}."""
    torch.multiprocessing.spawn(probe_groups, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=4)
    got = {r: torch.load(tmp_path / f"{r}.pt") for r in range(4)}
    for r, g in got.items():
        assert g["info"] == (r % 2, 2, r // 2, 2)
        assert g["tp_sum"] == {0: 1, 1: 1, 2: 5, 3: 5}[r]
        assert g["gathered"] == ([0, 1] if r < 2 else [2, 3])
        assert g["dp_sum"] == {0: 2, 1: 4, 2: 2, 3: 4}[r]
        assert g["objs"] == [0, 10, 20, 30]


@pytest.mark.gpu
def test_two_ranks_sharing_one_gpu_run_the_gpu_path(ckpt):
    """bf16 on one GPU, 2 ranks over gloo: the Triton sparse attention on the rank's 2 heads and the
    grouped-GEMM experts split by rank, every greedy step against one process (steps.py; bf16 partial
    sums round apart from one process's sums, so bits cannot match)."""
    bf16 = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="bfloat16", backend="gloo")
    want = generate_tp(_args(ckpt, 1, **bf16), PROMPTS, GREEDY)
    got = generate_tp(_args(ckpt, 2, **bf16), PROMPTS, GREEDY)
    assert_steps_close(got, want, TP_BF16_STEP_BOUND, "TP=2 bf16, one GPU")
