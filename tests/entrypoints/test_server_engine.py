"""The engine-core loop of `deepinfer serve` (engine_proc.EngineLoop) in-process, over plain queues: its
deltas add up to what LLM.generate returns, each sample finishes exactly once, bad parameters are refused
by name, and an abort frees the request's cache at once (LLM.add_request / step / abort / cache_stats)."""
from __future__ import annotations

import queue

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.openai.engine_proc import EngineLoop
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", PRESETS["tiny"], seed=11, dtype="fp8")
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20)


def _loop(llm):
    inbox, outbox = queue.Queue(), queue.Queue()
    return EngineLoop(llm, inbox, outbox), inbox, outbox


def _drain(outbox) -> list:
    out = []
    while not outbox.empty():
        out.append(outbox.get_nowait())
    return out


def _turn(loop) -> None:
    """One iteration of EngineLoop.run: take messages, step, report."""
    loop._take_messages(block=False)
    if loop.llm.has_unfinished():
        loop.llm.step()
    loop.outbox.put(("step", loop._deltas(), loop.llm.cache_stats()))


def test_deltas_add_up_to_generate_and_finish_once(llm):
    loop, inbox, outbox = _loop(llm)
    prompts = {"a": [0, 5, 9, 13], "b": [0, 7, 7, 7, 7, 7, 21]}
    params = SamplingParams(temperature=1.0, max_tokens=9, n=2, seq_seed=4, logprobs=1)
    for rid, ids in prompts.items():
        inbox.put(("add", rid, ids, params))
    got = {(rid, j): [] for rid in prompts for j in range(2)}
    finishes = {k: [] for k in got}
    lps = {k: 0 for k in got}
    for _ in range(100):
        _turn(loop)
        for msg in _drain(outbox):
            if msg[0] == "added":
                assert msg[2] is None
                continue
            for rid, j, ids, lp, reason, _ in msg[1]:
                got[rid, j] += ids
                lps[rid, j] += len(lp)
                if reason is not None:
                    finishes[rid, j].append(reason)
        if not loop.families:
            break
    assert all(f == ["length"] for f in finishes.values()), finishes
    for rid, ids in prompts.items():
        ref = llm.generate([ids], params, use_tqdm=False)[0].outputs
        assert [got[rid, j] for j in range(2)] == [c.token_ids for c in ref]
    assert all(n == 9 for n in lps.values())
    assert llm.scheduler.kv.all_free()


def test_bad_parameters_refused_by_name(llm):
    loop, inbox, outbox = _loop(llm)
    inbox.put(("add", "x", [0, 5], SamplingParams(logprobs=10_000)))
    inbox.put(("add", "y", [0, 10_000_000], SamplingParams()))
    loop._take_messages(block=False)
    errors = {m[1]: m[2] for m in _drain(outbox)}
    assert "logprobs" in errors["x"] and "vocabulary" in errors["y"]
    assert not loop.families and not llm.has_unfinished()


def test_abort_frees_the_cache_at_once(llm):
    loop, inbox, outbox = _loop(llm)
    inbox.put(("add", "long", [0] + [9] * 40, SamplingParams(max_tokens=200, ignore_eos=True)))
    for _ in range(3):
        _turn(loop)
    held = llm.cache_stats()
    assert held["num_running"] == 1 and held["free_blocks"] < held["total_blocks"]
    _drain(outbox)
    inbox.put(("abort", "long"))
    _turn(loop)
    (msg,) = _drain(outbox)
    (delta,) = [d for d in msg[1] if d[4] is not None]
    assert delta[4] == "abort" and "client" in delta[5]
    stats = msg[2]
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    assert not loop.families


def test_serve_with_a_missing_model_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--model", str(tmp_path / "nope"),
                        "--device", "cpu", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "deepinfer: error:" in r.stderr and "nope" in r.stderr


def test_engine_stats_become_metrics(llm):
    from deepinfer.entrypoints.openai.engine_proc import _stats
    from deepinfer.entrypoints.openai.metrics import ServerMetrics

    stats = _stats(llm)
    assert stats["free_blocks"] == stats["total_blocks"] > 0 and stats["spec_num_drafts"] == 0
    m = ServerMetrics("tiny")
    m.update_engine({**stats, "free_blocks": 25, "total_blocks": 100, "num_running": 3, "num_waiting": 2,
                     "spec_num_drafts": 10, "spec_num_accepted_tokens": 17, "spec_mean_acceptance_length": 2.7})
    m.finished("stop", prompt_tokens=5, output_tokens=4, start=0.0, first=0.5, end=2.0)
    text = m.render().decode()
    for line in ('deepinfer:kv_cache_usage_perc{model_name="tiny"} 0.75',
                 'deepinfer:num_requests_running{model_name="tiny"} 3.0',
                 'deepinfer:num_requests_waiting{model_name="tiny"} 2.0',
                 'deepinfer:spec_decode_num_accepted_tokens{model_name="tiny"} 17.0',
                 'deepinfer:spec_decode_mean_acceptance_length{model_name="tiny"} 2.7',
                 'deepinfer:prompt_tokens_total{model_name="tiny"} 5.0',
                 'deepinfer:generation_tokens_total{model_name="tiny"} 4.0',
                 'deepinfer:request_success_total{finished_reason="stop",model_name="tiny"} 1.0',
                 'deepinfer:time_to_first_token_seconds_sum{model_name="tiny"} 0.5',
                 'deepinfer:time_per_output_token_seconds_sum{model_name="tiny"} 0.5',
                 'deepinfer:e2e_request_latency_seconds_sum{model_name="tiny"} 2.0'):
        assert line in text, line
