"""Verify steps scheduled ahead (async scheduling with DSpark at fixed length): the step after a drafting one is
launched before the host reads back what that step accepted, its tokens and start taken on the device and the
step planned there (engine/scheduler.py _verify_ahead, worker/model_runner.py _verify_ahead,
state/device_plan.py). Greedy outputs equal speculation off and the synchronous speculative engine."""
from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.loader.model_config import read_model_config
from test_spec_graphs import EagerGraphs, _graphed, assert_same_outputs
from test_speculative import _llm, _prompts, confident_oracle


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
    truth = {(i, t): (p + o.outputs[0].token_ids)[i + 1:] for p, o in zip(prompts, off)
             for i, t in enumerate(p + o.outputs[0].token_ids)}
    confident_oracle(monkeypatch, truth, k)
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
