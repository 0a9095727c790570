"""A rank of a multi-process engine that dies (killed, os._exit, or raising) ends the run promptly with
an error naming the rank and its exit code: the driver watches the ranks' processes, terminates the
survivors (under NCCL they would block in a collective until the timeout) and raises at its next
check. And the multi-process engines log the start-up capacity (each rank's weights, the cache, the
requests that fit), through the function one process uses. Gloo ranks on the CPU, tiny V4, fp32."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.executor import multiproc
from deepinfer.executor.engine import start_engine
from deepinfer.executor.procs import TPWorkerError
from deepinfer.executor.worker import EngineArgs
from deepinfer.distributed.parallel_state import ParallelConfig
from deepinfer.engine.memory_fit import format_bytes
from deepinfer.engine.request import Request
from deepinfer.loader.model_loader import load_model, weight_bytes
from deepinfer.tools.make_checkpoint import write_checkpoint
from test_tensor_parallel import CFG, GREEDY, MEMORY, PROMPTS

# the run must end within this (the collectives' timeout_s is far longer: no waiting for it)
PROMPT_S = 20.0
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dead") / "ckpt", CFG, seed=11, dtype="fp8")


def exit_on_rank1(rank: int, step: int) -> None:
    """step_hook: rank 1 leaves mid-generate without a word (no report, no clean-up)."""
    if rank == 1 and step == 1:
        os._exit(3)


def _capacity_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepinfer.llm"
            and (" weights: " in r.getMessage() or r.getMessage().startswith("cache: "))]


def test_llm_generate_ends_promptly_when_a_rank_exits_and_start_up_logs_each_ranks_capacity(ckpt, monkeypatch,
                                                                                             caplog):
    # LLM builds the EngineArgs: the fault hook goes to the spawned ranks' copy
    start = multiproc.MultiprocExecutor.__init__
    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", lambda self, args: start(
        self, dataclasses.replace(args, step_hook=exit_on_rank1, num_threads=1)))
    caplog.set_level(logging.INFO, logger="deepinfer.llm")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=MEMORY,
              max_num_batched_tokens=16, skip_tokenizer_init=True, data_parallel_size=2,
              enable_expert_parallel=True)
    try:
        lines = _capacity_lines(caplog)
        whole = weight_bytes(load_model(str(ckpt), dtype=torch.float32)[0])
        held = weight_bytes(llm.model)  # the driver's: half the trunk's routed experts (the draft's whole)
        assert held.experts < whole.experts
        for rank in (0, 1):  # expert parallelism splits the experts evenly
            line = next(ln for ln in lines if ln.startswith(f"rank {rank} weights: "))
            assert f"{format_bytes(held.total)} on cpu" in line and f"routed experts {format_bytes(held.experts)}" \
                in line, line
        cache = next(ln for ln in lines if ln.startswith("cache: "))
        assert "on each rank" in cache and f"max_model_len={llm.max_model_len}" in cache, cache
        assert "fit at once on each of the 2 data-parallel ranks" in cache, cache

        t0 = time.monotonic()
        with pytest.raises(TPWorkerError) as err:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        took = time.monotonic() - t0
    finally:
        llm.close()
    assert took < PROMPT_S, took
    assert err.value.rank == 1
    assert "data-parallel rank 1 failed: exited without a report (exit code 3)" in str(err.value)
    assert parallel_state.rank_info() is None


def test_a_killed_rank_terminates_the_survivors_and_the_next_call_names_it(ckpt):
    """The driver is idle (between steps) when rank 2 is killed; rank 1 would wait in its broadcast
    for timeout_s. The driver's watch ends rank 1 at once, and the next call raises naming rank 2."""
    args = EngineArgs(str(ckpt), ParallelConfig(data_parallel_size=3), kv_cache_dtype="float32",
                      kv_cache_memory=MEMORY, max_num_batched_tokens=16, num_threads=1, timeout_s=TIMEOUT_S)
    eng = start_engine(args)
    try:
        survivor, victim = eng.executor._procs[1], eng.executor._procs[2]
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        survivor.join(timeout=PROMPT_S)
        assert not survivor.is_alive() and survivor.exitcode == -signal.SIGTERM
        assert time.monotonic() - t0 < PROMPT_S
        with pytest.raises(TPWorkerError) as err:
            eng.add_request(Request("0", PROMPTS[1], GREEDY, 1))
    finally:
        eng.close()
    msg = str(err.value)
    assert err.value.rank == 2 and "data-parallel rank 2 failed" in msg and "exit code -9, killed by SIGKILL" in msg
    assert any("rank 1: terminated by the driver after rank 2 died" in d for d in err.value.details)
    assert parallel_state.rank_info() is None and not eng.executor._procs


def test_tensor_parallel_start_up_logs_each_ranks_shard(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.llm")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=MEMORY,
              max_num_batched_tokens=16, skip_tokenizer_init=True, tensor_parallel_size=2)
    try:
        out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.close()
    lines = _capacity_lines(caplog)
    whole = weight_bytes(load_model(str(ckpt), dtype=torch.float32)[0]).total
    totals = []
    for rank in (0, 1):
        line = next(ln for ln in lines if ln.startswith(f"rank {rank} weights: "))
        totals.append(line.split()[3])  # "rank R weights: X MiB ..."
    assert all(float(t) < whole / (1 << 20) for t in totals), (totals, whole)  # a shard each, not the whole
    assert any(ln.startswith("cache: ") and "on each rank" in ln and "data-parallel" not in ln for ln in lines)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_a_rank_that_exits_ends_an_nccl_run_promptly(ckpt, layout):
    """Under NCCL the driver's all-reduce / all-to-all waits on the dead peer with no connection to
    lose: the driver's watch aborts its communicators, so the step ends long before timeout_s."""
    parallel = (ParallelConfig(tensor_parallel_size=2) if layout == "tp"
                else ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))
    args = EngineArgs(str(ckpt), parallel, device="cuda", kv_cache_dtype="float32", kv_cache_memory=MEMORY,
                      max_num_batched_tokens=16, timeout_s=TIMEOUT_S, step_hook=exit_on_rank1)
    eng = start_engine(args)
    try:
        t0 = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"rank 1 failed: exited without a report \(exit code 3\)"):
            eng.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < PROMPT_S
    finally:
        eng.close()
    assert parallel_state.rank_info() is None
