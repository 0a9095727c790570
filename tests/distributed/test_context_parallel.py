"""Context parallelism on the CPU: 2 and 4 gloo ranks (spawned) prefill one long prompt of the tiny
V4 checkpoint in zig-zag chunks, fp32 activations and cache, against one process.

Exactness: bit-identical. Each rank computes its tokens' projections with the same per-row math
as one process, the all-gathers only move rows, and pooling, attention and MoE are row-local, so
the tiny model's tokens, every logprob and every cache row (window ring, compressed entries,
indexer keys, compressor carry) equal one process's exactly. A prompt whose length is not a
multiple of 2 * cp * 16 runs its tail as a second, ordinary step: that is chunked prefill, equal to
one process's single step within 1e-5 (measured: one ulp of a logprob).

DeepSeek-V4.1 (tiny41: CSA2 ratio-2 and ratio-1 KV sources, reindex / reuse layers, candidate
blocks, Engram windows from the device token history) in batch-invariant mode: bit-identical the
same way. Outside that mode the CPU's fp32 GEMM is not row-independent for 1-3 rows (another
kernel), and a rank's routed experts see other row counts than one process's, so tokens are equal
and logprobs agree within 1e-5.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.context_parallel import (CPArgs, CPRunner, _generate_rank, aligned_prefix, causal_work,
                                                    generate_cp, generate_cp_spawn, load_rank, run_on_ranks,
                                                    zigzag_split)
from deepinfer.engine.outputs import ScheduledChunk, SchedulerOutput
from deepinfer.layers import invariant
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.worker.model_runner import ModelRunner
from steps import assert_chosen_close
from test_tensor_parallel import ROW_LOCAL_BF16_STEP_BOUND

CFG = {**PRESETS["tiny"], "index_topk": 64}  # top-k >= entries: scores decide nothing near ties
ALIGN = 16  # the tiny model's largest compression ratio; sliding window 8
# 256 tokens: 16 windows of 16, 64 of 4, 32 sliding windows of 8; at cp=4 chunks of 32
PROMPT = [0] + [(i * 37 + 11) % 1000 + 2 for i in range(255)]
MAX_TOKENS = 4
LOGPROB_TOL = 1e-5
LOGPROB_TOL_GPU_FP32 = 1e-5  # fp32 on the GPU, as LOGPROB_TOL: measured 9.5e-7 (V4 and V4.1, H100, 3f6619c)
TAIL = PROMPT + [7, 8, 9, 10, 11]  # 256 rows in CP at cp=2, 5 as an ordinary step
SPAWN_TIMEOUT_S = 600.0  # a hang guard for the several runs a spawn does


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cp") / "ckpt", CFG, seed=11, dtype="fp8")


@pytest.fixture(scope="module")
def one_process(ckpt):
    """prompt -> generate_cp with no group: the plain forward, the whole prompt in one step."""
    memo = {}

    def run(prompt: list[int]):
        key = tuple(prompt)
        if key not in memo:
            model, cache = load_rank(CPArgs(str(ckpt), 1))
            tokens, lps, first = generate_cp(model, cache, prompt, MAX_TOKENS)
            memo[key] = tokens, lps, first, [[t.clone() for t in c.per_slot() + c.paged()] for c in cache.layers]
        return memo[key]
    return run


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_split_covers_every_row_once_with_equal_causal_work(cp):
    split = zigzag_split(256, cp, ALIGN)
    assert np.array_equal(np.sort(np.concatenate(split)), np.arange(256))
    assert {len(r) for r in split} == {256 // cp}
    c = 256 // (2 * cp)
    for r, rows in enumerate(split):  # chunks r and 2cp-1-r, on window bounds
        assert np.array_equal(rows, np.r_[r * c:(r + 1) * c, (2 * cp - 1 - r) * c:(2 * cp - r) * c])
        assert c % ALIGN == 0
    work = [causal_work(r) for r in split]
    assert len(set(work)) == 1 and sum(work) == 256 * 257 // 2
    contiguous = [causal_work(r) for r in np.split(np.arange(256), cp)]
    assert max(contiguous) / min(contiguous) > 2 * cp - 1.5  # what the zig-zag removes: ~3x at cp=2, ~7x at cp=4


def test_misaligned_lengths_are_refused_and_the_aligned_prefix_is_given():
    with pytest.raises(ValueError, match="num_tokens: 250 is not a positive multiple of 2 \\* cp_size \\* align = 64"):
        zigzag_split(250, 2, ALIGN)
    with pytest.raises(ValueError, match="cp_size"):
        zigzag_split(256, 0)
    assert aligned_prefix(250, 2, ALIGN) == 192 and aligned_prefix(261, 4, ALIGN) == 256
    assert aligned_prefix(100, 4, ALIGN) == 0  # shorter than one unit: no CP step at all


@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_match_one_process_bit_for_bit(ckpt, one_process, cp, request):
    want_tokens, want_lps, want_first, want_cache = one_process(PROMPT)
    if cp == 2:  # generate_cp_spawn itself; cp=4 shares a spawn with V4.1's run
        ranks = generate_cp_spawn(CPArgs(str(ckpt), cp), PROMPT, MAX_TOKENS)
    else:
        ranks = request.getfixturevalue("cp4")["prompt"]
    assert len(ranks) == cp
    for tokens, lps, first, stats, cache in ranks:
        assert tokens == want_tokens and lps == want_lps
        assert torch.equal(first, want_first)
        for layer, (got, want) in enumerate(zip(cache, want_cache, strict=True)):
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), f"layer {layer}: cache differs from one process"
        # every row in CP (256 / cp each); one gather per layer for the window kv plus one per
        # compressor (2 sliding layers, 2 CSA x 3, 2 HCA x 2)
        assert stats["rows"] == 256 and stats["cp_rows"] == 256 // cp and stats["collectives"] == 12


def test_a_misaligned_tail_runs_as_a_second_step(one_process, cp2):
    """PROMPT + 5 tokens at cp=2: 256 rows in CP, 5 as an ordinary step on every rank (chunked
    prefill: equal to one process's single step up to fp32 summation order)."""
    want_tokens, want_lps, want_first, want_cache = one_process(TAIL)
    assert len(cp2["tail"]) == 2
    for tokens, lps, first, stats, cache in cp2["tail"]:
        assert tokens == want_tokens and stats["rows"] == 256
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) <= LOGPROB_TOL
        assert torch.allclose(first, want_first, rtol=0, atol=LOGPROB_TOL)
        for got, want in zip(cache, want_cache, strict=True):
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)


def test_cp_reference_is_the_llm_engine(ckpt, one_process):
    """The one-process reference above is the LLM engine's step: greedy tokens equal, logprobs
    within 1e-5 (the engine's own sampler computes them)."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
              max_num_batched_tokens=512)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False)
    got = out[0].outputs[0]
    tokens, lps = one_process(PROMPT)[:2]
    assert got.token_ids == tokens
    assert max(abs(d[t] - lp) for d, t, lp in zip(got.logprobs, tokens, lps)) <= LOGPROB_TOL


def _engine_steps(rank: int, group, args: CPArgs, batch_invariant: bool = False) -> tuple:
    """The engine's runner on one rank (group None: one process, the plain ModelRunner): PROMPT as
    two prefill chunks of 128 (the second at start 128, reading the first's cache), then greedy
    decode steps fed by the runner's own samples. -> (sampled tokens, logprob dicts, CP steps)."""
    model, cache = load_rank(args)
    runner = ModelRunner(model, cache, "cpu", seed=0, cuda_graphs=False, batch_invariant=batch_invariant)
    run = runner if group is None else CPRunner(runner, group)
    tables = {m: list(range(n)) for m, n in cache.num_blocks.items()}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)

    def step(start, ids, samples):
        c = ScheduledChunk("a", 0, start, ids, tables, samples, params, num_tokens=start + len(ids))
        return run.execute(SchedulerOutput([c]))

    assert not step(0, PROMPT[:128], 0).sampled
    out = step(128, PROMPT[128:], 1)
    tokens, lps = list(out.sampled["a"]), list(out.logprobs["a"])
    while len(tokens) < MAX_TOKENS:  # decode: one token, not a CP step
        out = step(len(PROMPT) + len(tokens) - 1, tokens[-1:], 1)
        tokens += out.sampled["a"]
        lps += out.logprobs["a"]
    return tokens, lps, getattr(run, "cp_steps", 0)


def test_engine_runner_prefills_in_cp_and_decodes_like_one_process(ckpt, cp2):
    """CPRunner (ModelRunner's execute) at cp=2: both prefill chunks in CP, bit-identical sampled
    tokens and logprob dicts to one process's runner on the same SchedulerOutputs."""
    want = _engine_steps(0, None, CPArgs(str(ckpt), 1))
    assert want[2] == 0
    assert len(cp2["runner"]) == 2
    for tokens, lps, cp_steps in cp2["runner"]:
        assert (tokens, lps) == want[:2] and cp_steps == 2


@pytest.fixture(scope="module")
def ckpt41(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cp41") / "ckpt", PRESETS["tiny41"], seed=3, dtype="fp8")


PROMPT41 = PROMPT[:128]  # sliding window 16, ratios 2 and 1; at cp=4 chunks of 16


def _runs(rank: int, group, runs: list) -> list:
    """Several runs on one set of spawned ranks, one after another, each loading its own model and
    cache: a spawn costs every rank a fresh interpreter and its imports, more than a tiny model's run."""
    return [fn(rank, group, *args) for fn, args in runs]


def _spawn(cp: int, runs: dict) -> dict:
    """name -> (fn, args) run on `cp` ranks -> name -> per rank, in rank order, fn's result."""
    ranks = run_on_ranks(cp, _runs, (list(runs.values()),), timeout_s=SPAWN_TIMEOUT_S)
    return {name: [r[i] for r in ranks] for i, name in enumerate(runs)}


@pytest.fixture(scope="module")
def cp2(ckpt, ckpt41):
    """The cp=2 runs of this module on one spawn of 2 ranks, but PROMPT's (generate_cp_spawn's own)."""
    a, a41 = CPArgs(str(ckpt), 2), CPArgs(str(ckpt41), 2)
    return _spawn(2, {"tail": (_generate_rank, (a, TAIL, MAX_TOKENS)), "runner": (_engine_steps, (a,)),
                      "v41_plain": (_v41_rank, (a41, False)), "v41": (_v41_rank, (a41, True)),
                      "v41_runner": (_engine_steps, (a41, True))})


@pytest.fixture(scope="module")
def cp4(ckpt, ckpt41):
    """Every cp=4 run of this module on one spawn of 4 ranks."""
    return _spawn(4, {"prompt": (_generate_rank, (CPArgs(str(ckpt), 4), PROMPT, MAX_TOKENS)),
                      "v41": (_v41_rank, (CPArgs(str(ckpt41), 4), True))})


def _v41_rank(rank: int, group, args: CPArgs, batch_invariant: bool) -> tuple:
    """generate_cp on one rank (group None: one process) -> (tokens, logprobs, first log-softmax,
    every cache tensor incl. the Engram token history)."""
    model, cache = load_rank(args)
    with invariant.mode(batch_invariant):
        tokens, lps, first = generate_cp(model, cache, PROMPT41, MAX_TOKENS, group)
    tensors = [t for c in cache.layers for t in c.per_slot() + c.paged()] + [cache.token_history]
    return tokens, lps, first.cpu(), [t.cpu().clone() for t in tensors]


@pytest.mark.parametrize("cp", [2, 4])
def test_v41_ranks_match_one_process(ckpt41, cp, request):
    """Batch-invariant mode: bit for bit (tokens, logprobs, every cache row, the token history).
    Plain mode (cp=2): tokens equal, logprobs within 1e-5 (see the module docstring)."""
    spawned = request.getfixturevalue(f"cp{cp}")
    for inv in (True, False) if cp == 2 else (True,):
        want = _v41_rank(0, None, CPArgs(str(ckpt41), 1), inv)
        ranks = spawned["v41" if inv else "v41_plain"]
        assert len(ranks) == cp
        for tokens, lps, first, cache in ranks:
            assert tokens == want[0]
            if not inv:
                assert max(abs(a - b) for a, b in zip(lps, want[1])) <= LOGPROB_TOL
                continue
            assert lps == want[1] and torch.equal(first, want[2])
            for i, (g, w) in enumerate(zip(cache, want[3], strict=True)):
                assert torch.equal(g, w), f"cache tensor {i} differs from one process"


def test_v41_engine_runner_prefills_in_cp_like_one_process(ckpt41, cp2):
    """CPRunner over a batch-invariant V4.1 runner at cp=2: both prefill chunks in CP (the second
    reads the first's cache and token history), then the runner's decode steps: bit-identical."""
    want = _engine_steps(0, None, CPArgs(str(ckpt41), 1), True)
    assert len(cp2["v41_runner"]) == 2
    for tokens, lps, cp_steps in cp2["v41_runner"]:
        assert (tokens, lps) == want[:2] and cp_steps == 2


def test_v41_a_cp_step_never_holds_rows_bounded_replay_keeps(ckpt41):
    """With bounded replay a split ends below the request's replay_from (cp_rows); a step whose rows reach past it
    is refused rather than split (its kept rows would need the upper layers' gathers on some ranks only)."""
    from deepinfer.distributed.context_parallel import _plan, cp_rows, engram_windows, local_view
    from deepinfer.state.forward_batch import SeqChunk

    assert cp_rows(128, 0, 104) == 104 and cp_rows(128, 100, 104) == 4 and cp_rows(128, 110, 104) == 0
    assert cp_rows(128, 0, 0) == 128  # replay_from 0: exact prefill, every row may be split
    model, cache = load_rank(CPArgs(str(ckpt41), 1))
    runner = ModelRunner(model, cache, "cpu", cuda_graphs=False, replay_keep=24)
    tables = {m: list(range(n)) for m, n in cache.num_blocks.items()}
    chunk = ScheduledChunk("r", 0, 0, list(range(1, 129)), tables, 1, num_tokens=128)
    assert runner.replay_from(chunk) == 104
    below = _plan(model, [SeqChunk(0, 0, list(range(1, 105)), tables, replay_from=104)], 16, "cpu")
    assert below.replay is not None and below.replay.rows.numel() == 0
    local_view(below, torch.arange(0, 104, 2), engram_windows(below, cache.token_history))  # splittable
    past = _plan(model, [SeqChunk(0, 0, list(range(1, 129)), tables, replay_from=104)], 16, "cpu")
    with pytest.raises(ValueError, match="a context-parallel step ends below replay_from"):
        local_view(past, torch.arange(0, 128, 2), engram_windows(past, cache.token_history))


def _fail_on_rank1(rank: int, group) -> int:
    if rank == 1:
        raise RuntimeError("injected fault in rank 1")
    return rank


def test_a_failing_rank_ends_the_run_naming_it():
    with pytest.raises(RuntimeError, match="rank 1 failed: RuntimeError: injected fault in rank 1"):
        run_on_ranks(2, _fail_on_rank1, timeout_s=60.0)


def test_models_without_a_cp_path_are_refused_by_name():
    runner = SimpleNamespace(model=torch.nn.Linear(1, 1), replay_keep=None)
    with pytest.raises(ValueError, match="context_parallel_size: Linear has no context-parallel path"):
        CPRunner(runner, None)


@pytest.mark.gpu
def test_two_ranks_sharing_one_gpu_run_the_gpu_path(ckpt):
    """On one GPU, 2 ranks over gloo: the Triton compressor pooling over gathered projections, the
    sparse attention kernel (bf16) over the gathered window kv. cuBLAS may pick other kernels for a
    rank's T/2 rows than for T, so bits need not match one process: every greedy step's token equal and
    its logprob within the bound (fp32: LOGPROB_TOL_GPU_FP32; bf16: ROW_LOCAL_BF16_STEP_BOUND, steps.py)."""
    for kw, tol in ((dict(dtype="float32", kv_cache_dtype="float32"), LOGPROB_TOL_GPU_FP32),
                    (dict(dtype="bfloat16", kv_cache_dtype="bfloat16"), ROW_LOCAL_BF16_STEP_BOUND)):
        want = generate_cp_spawn(CPArgs(str(ckpt), 1, device="cuda", **kw), PROMPT, MAX_TOKENS)[0]
        for rank, (tokens, lps, *_) in enumerate(generate_cp_spawn(CPArgs(str(ckpt), 2, device="cuda", **kw),
                                                                   PROMPT, MAX_TOKENS)):
            assert_chosen_close(tokens, lps, want[0], want[1], tol, f"CP=2 {kw['dtype']}, one GPU, rank {rank}")


@pytest.mark.gpu
def test_v41_two_ranks_sharing_one_gpu_run_the_gpu_path(ckpt41):
    """V4.1 on one GPU, 2 ranks over gloo: the Triton pooling over gathered projections, the fused
    indexer and candidate kernels for the rank's queries, Engram from the device history. fp32:
    every greedy step's token equal, its logprob within LOGPROB_TOL_GPU_FP32 (cuBLAS row-count
    dependence, as above)."""
    args = dict(device="cuda", dtype="float32", kv_cache_dtype="float32")
    want = run_on_ranks(1, _v41_rank, (CPArgs(str(ckpt41), 1, **args), False))[0]
    for rank, (tokens, lps, *_) in enumerate(run_on_ranks(2, _v41_rank, (CPArgs(str(ckpt41), 2, **args), False))):
        assert_chosen_close(tokens, lps, want[0], want[1], LOGPROB_TOL_GPU_FP32, f"V4.1 CP=2 float32, one GPU, rank {rank}")
