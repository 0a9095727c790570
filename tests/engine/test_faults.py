"""A failing step aborts only its own requests and leaves the engine as a fresh one (tiny model, CPU).

Faults are injected at prefill, decode, graph replay, sampling, collect (async look-ahead in
flight), the stop-string check, and as an interruption of generate itself. After each one every
slot, block, detokenizer state and look-ahead step is released, and the next generate returns
exactly what a fresh engine returns.
"""
from __future__ import annotations

import pytest
import torch

import deepinfer.worker.model_runner as model_runner
from deepinfer import LLM, GenerationError, SamplingParams
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
POISON = 7  # a token id the request-specific fault reacts to


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt", CFG, seed=3, dtype="fp8")


def _engine(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20,
               **kw)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(10, CFG["vocab_size"], (int(k),), generator=g).tolist()
            for k in torch.randint(5, 40, (n,), generator=g)]


PROMPTS = _prompts(4, seed=1)


@pytest.fixture(scope="module")
def fresh(ckpt):
    """What a fresh engine returns for PROMPTS, greedy."""
    llm = _engine(ckpt)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _assert_released(llm: LLM) -> None:
    eng, sched = llm.engine.core, llm.scheduler
    assert sched.kv.all_free(), sched.kv.num_free()
    assert not sched.has_unfinished() and not sched.pending_forks
    assert eng.inflight is None and not eng.requests and not eng.decode_state


def _serves_as_fresh(llm: LLM, fresh) -> None:
    _assert_released(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == fresh
    _assert_released(llm)


def _fail_forward_once(llm: LLM, when) -> list[int]:
    """Make the model raise at the first forward whose batch satisfies `when`; returns a counter."""
    model, plain, hits = llm.engine.core.runner.model, llm.engine.core.runner.model.forward, []

    def forward(batch, *a, **kw):
        if not hits and when(batch):
            hits.append(1)
            raise RuntimeError("injected fault")
        return plain(batch, *a, **kw)
    model.forward = forward
    return hits


def _check_failure(err: GenerationError, n_prompts: int, failed_prompts=None) -> None:
    assert "injected fault" in str(err)
    assert len(err.outputs) == n_prompts
    aborted = {i for i, o in enumerate(err.outputs) for c in o.outputs if c.finish_reason == "abort"}
    assert aborted == {i for i, _ in err.failed}
    if failed_prompts is not None:
        assert aborted == set(failed_prompts)
    for i in aborted:
        assert f"prompts[{i}]" in str(err)
        assert all("injected fault" in c.error for c in err.outputs[i].outputs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_failing_forward_aborts_its_step_and_the_engine_serves_as_fresh(ckpt, fresh, where, async_scheduling):
    llm = _engine(ckpt, async_scheduling=async_scheduling)
    n = len(PROMPTS)
    when = (lambda b: b.input_ids.numel() > n) if where == "prefill" else (lambda b: b.input_ids.numel() == n)
    hits = _fail_forward_once(llm, when)
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert hits
    _check_failure(e.value, n, failed_prompts=range(n))  # all four were in the failing step
    if where == "decode":  # they had tokens before the fault; they keep them
        assert all(0 < len(o.outputs[0].token_ids) < GREEDY.max_tokens for o in e.value.outputs)
    _serves_as_fresh(llm, fresh)


def test_a_request_specific_fault_does_not_break_later_calls(ckpt, fresh):
    llm = _engine(ckpt, max_num_seqs=2)  # two requests per step: the poisoned one fails only its step
    model, plain = llm.engine.core.runner.model, llm.engine.core.runner.model.forward

    def forward(batch, *a, **kw):
        if (batch.input_ids == POISON).any():
            raise RuntimeError("injected fault: poison token")
        return plain(batch, *a, **kw)
    model.forward = forward
    poisoned = PROMPTS[:2] + [[0, 11, POISON, 12]] + PROMPTS[2:]
    for _ in range(2):
        with pytest.raises(GenerationError) as e:
            llm.generate(poisoned, GREEDY, use_tqdm=False)
        _check_failure(e.value, len(poisoned))
        assert 2 in {i for i, _ in e.value.failed} and len(e.value.failed) <= 2
        for i, o in enumerate(e.value.outputs):  # the steps without the poison ran to the end
            if o.outputs[0].finish_reason != "abort":
                assert o.outputs[0].token_ids == fresh[i if i < 2 else i - 1]
        _serves_as_fresh(llm, fresh)


def test_a_failing_sampler_aborts_its_step(ckpt, fresh, monkeypatch):
    llm = _engine(ckpt)
    plain, calls = model_runner.sample, []

    def sample(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault in sampling")
        return plain(*a, **kw)
    monkeypatch.setattr(model_runner, "sample", sample)
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _check_failure(e.value, len(PROMPTS))
    _serves_as_fresh(llm, fresh)


class _FailingGraphs:
    """Stands in for DecodeGraphs on the CPU: takes every pure-decode step, and its replay raises."""

    def __init__(self, runner):
        self.runner, self.calls = runner, 0

    def fits(self, n: int) -> bool:
        return True

    def run(self, chunks, fill=None):
        self.calls += 1
        self.runner.graphs = None  # the next decode steps run eagerly
        raise RuntimeError("injected fault in graph replay")

    run_rows = run  # (a step planned from the scheduler's arrays)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_graph_replay_aborts_its_step(ckpt, fresh, async_scheduling):
    llm = _engine(ckpt, async_scheduling=async_scheduling)
    graphs = llm.engine.core.runner.graphs = _FailingGraphs(llm.engine.core.runner)
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert graphs.calls == 1
    _check_failure(e.value, len(PROMPTS), failed_prompts=range(len(PROMPTS)))
    _serves_as_fresh(llm, fresh)


def test_a_failing_collect_discards_the_step_launched_ahead(ckpt, fresh):
    llm = _engine(ckpt, async_scheduling=True)
    runner = llm.engine.core.runner
    plain, calls = runner.collect, []

    def collect(h):
        calls.append(llm.engine.core.inflight is not None)
        if len(calls) == 3:
            assert llm.engine.core.inflight is not None  # a step was launched ahead of this one
            raise RuntimeError("injected fault at collect")
        return plain(h)
    runner.collect = collect
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _check_failure(e.value, len(PROMPTS), failed_prompts=range(len(PROMPTS)))
    _serves_as_fresh(llm, fresh)


def test_a_failing_stop_string_check_aborts_only_its_request(ckpt, fresh):
    llm = _engine(ckpt)
    detok, plain = llm.detokenizer, llm.detokenizer.update

    def update(st, ids, stop, check=True):
        if "<boom>" in stop:
            raise RuntimeError("injected fault in detokenisation")
        return plain(st, ids, stop, check)
    detok.update = update
    params = [GREEDY] * len(PROMPTS)
    params[1] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["<boom>"])
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS, params, use_tqdm=False)
    _check_failure(e.value, len(PROMPTS), failed_prompts=[1])
    assert [o.outputs[0].token_ids for i, o in enumerate(e.value.outputs) if i != 1] == fresh[:1] + fresh[2:]
    _serves_as_fresh(llm, fresh)


def test_a_failing_prefill_aborts_the_siblings_waiting_on_it(ckpt, fresh):
    llm = _engine(ckpt)
    _fail_forward_once(llm, lambda b: True)
    params = SamplingParams(temperature=0.8, max_tokens=4, n=3, seq_seed=5)
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert [c.finish_reason for c in e.value.outputs[0].outputs] == ["abort"] * 3
    _serves_as_fresh(llm, fresh)
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == \
        [c.token_ids for c in _engine(ckpt).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_interrupted_generate_releases_its_requests(ckpt, fresh, async_scheduling):
    llm = _engine(ckpt, async_scheduling=async_scheduling)
    runner = llm.engine.core.runner
    plain, calls = runner.collect, []

    def collect(h):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return plain(h)
    runner.collect = collect
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del runner.collect
    _serves_as_fresh(llm, fresh)


@pytest.mark.gpu
def test_a_failing_cuda_graph_replay_aborts_its_step(ckpt, monkeypatch):
    """Real graphs on the GPU (bf16, batch-invariant so two engines' tokens compare exactly): the first
    replay raises; its requests are aborted and the engine then serves as a fresh one."""
    def engine():
        return LLM(str(ckpt), device="cuda", dtype="bfloat16", kv_cache_dtype="bfloat16",
                   kv_cache_memory=32 << 20, batch_invariant=True)
    fresh = [o.outputs[0].token_ids for o in engine().generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = engine()
    plain, calls = torch.cuda.CUDAGraph.replay, []

    def replay(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault in graph replay")
        return plain(self)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    with pytest.raises(GenerationError) as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _check_failure(e.value, len(PROMPTS), failed_prompts=range(len(PROMPTS)))
    assert llm.engine.core.runner.graphs.graphs and len(calls) == 1
    _serves_as_fresh(llm, fresh)
    assert len(calls) > 1  # the engine went on replaying graphs
