"""Verify steps scheduled ahead (async scheduling with DSpark at fixed length): the step after a drafting one is
launched before the host reads back what that step accepted, its tokens and start taken on the device and the
step planned there (engine/scheduler.py _verify_ahead, worker/model_runner.py _verify_ahead,
state/device_plan.py). Greedy outputs equal speculation off and the synchronous speculative engine."""
from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.llm import GenerationError
from deepinfer.engine.scheduler import VarlenPolicy
from deepinfer.loader.model_config import read_model_config
from deepinfer.spec.schedule import StepTimes
from test_spec_graphs import EagerGraphs, _graphed, assert_same_outputs
from test_speculative import _llm, _prompts, confident_oracle, continuations


def _count_ahead(llm) -> list[int]:
    """Logs the request count of every verify step the runner launches ahead."""
    r, seen = llm.engine.core.runner, []
    real = r._verify_ahead

    def logged(so, prev):
        seen.append(len(so.chunks))
        return real(so, prev)

    r._verify_ahead = logged
    return seen


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shapes"])
def test_verify_steps_launched_ahead_keep_greedy_tokens(ckpt41, monkeypatch, graphs):
    k = 3
    prompts = _prompts(5, read_model_config(ckpt41).vocab_size, seed=11)
    # requests finish at different steps, some inside a step launched ahead of their last one
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=1) for m in (5, 9, 16, 23, 30)]
    off = _llm(ckpt41, None, max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    confident_oracle(monkeypatch, continuations(prompts, [o.outputs[0].token_ids for o in off]), k)
    kw = dict(speculative_config={"method": "dspark", "num_speculative_tokens": k}, max_num_seqs=8)
    sync = _llm(ckpt41, None, async_scheduling=False, **kw)
    ahead = _llm(ckpt41, None, **kw)
    if graphs:
        _graphed(ahead)
    seen = _count_ahead(ahead)
    want = sync.generate(prompts, params, use_tqdm=False)
    got = ahead.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(got, want, off)
    assert len(seen) > 5 and max(seen) == 5
    # the counters are a synchronous engine's: drafts past a request's room are not counted
    assert ahead.get_metrics() == sync.get_metrics()
    assert ahead.scheduler.kv.all_free()
    if graphs:
        assert isinstance(ahead.engine.core.runner.graphs, EagerGraphs)


def test_one_length_a_step_launched_ahead_backs_off_and_resumes(ckpt41, monkeypatch):
    """With the graphs' verify-length policy, verify steps scheduled ahead take the step's one length l: l > 0
    verifies the first l drafts, l = 0 the pending token alone without drafting, after which decode steps launch
    ahead from host positions that learned the device's. The policy's lengths are scripted here (four calls
    drafting, four not); greedy outputs equal speculation off."""
    k = 3
    prompts = _prompts(3, read_model_config(ckpt41).vocab_size, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (17, 40, 60)]
    off = [o.outputs[0].token_ids for o in _llm(ckpt41, None, max_num_seqs=8).generate(prompts, params, use_tqdm=False)]
    confident_oracle(monkeypatch, continuations(prompts, off), k)
    llm = _llm(ckpt41, None, speculative_config={"method": "dspark", "num_speculative_tokens": k}, max_num_seqs=8)
    sched, calls = llm.scheduler, [0]
    sched.varlen = VarlenPolicy(None, None, StepTimes([1, 8], [[0.01] * (k + 1)] * 2))

    def scripted():
        length = (1 + calls[0] % 3) if calls[0] // 4 % 2 == 0 else 0
        calls[0] += 1
        sched._propose = length > 0
        return {r.request_id: length for r in sched.running}

    sched._uniform_lengths = scripted
    r, launches = llm.engine.core.runner, []
    real = r.launch

    def logged(so, prev=None):  # (requests, verified drafts, proposes) of verify steps ahead, else the kind
        kind = "decode ahead" if so.decode is not None and prev is not None else "other"
        launches.append((len(so.chunks), len(so.chunks[0].token_ids) - 1, so.propose) if so.verify_ahead else kind)
        return real(so, prev)

    r.launch = logged
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == off
    ahead = [(i, x) for i, x in enumerate(launches) if isinstance(x, tuple)]
    assert len({q for _, (_, q, p) in ahead if p}) > 1  # lengths vary
    # backed off ahead (the pending token alone), then decode steps launched ahead of it
    assert any(q == 0 and not p and launches[i + 1] == "decode ahead" for i, (_, q, p) in ahead[:-1])
    assert sched.kv.all_free()


def test_an_abort_while_a_verify_step_ahead_is_in_flight_harms_no_other_request(ckpt41, monkeypatch):
    """A request aborted (a client gone) between the launch of a verify step scheduled ahead and the read-back of
    the step before it: that step's tokens for it are dropped, its blocks freed once the steps end, and every other
    request's greedy tokens equal speculation off."""
    k = 3
    prompts = _prompts(4, read_model_config(ckpt41).vocab_size, seed=12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = [o.outputs[0].token_ids for o in _llm(ckpt41, None, max_num_seqs=8).generate(prompts, params, use_tqdm=False)]
    confident_oracle(monkeypatch, continuations(prompts, off), k)
    llm = _llm(ckpt41, None, speculative_config={"method": "dspark", "num_speculative_tokens": k}, max_num_seqs=8)
    core = llm.engine.core
    runner, aborted = core.runner, []
    collect = runner.collect

    def abort_once(h):
        if not aborted and core.inflight is not None and core.inflight[0].verify_ahead:
            victim = core.inflight[0].chunks[1].request_id
            aborted.append(victim)
            core.abort([victim], "client disconnected")
        return collect(h)

    runner.collect = abort_once
    with pytest.raises(GenerationError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert aborted and [i for i, _ in e.value.failed] == [1]
    outs = [o.outputs[0] for o in e.value.outputs]
    assert outs[1].finish_reason == "abort"
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [t for i, t in enumerate(off) if i != 1]
    assert llm.scheduler.kv.all_free() and core.inflight is None
