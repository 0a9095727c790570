"""The offline engine end to end on a tiny random checkpoint (fp32, CPU)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.worker.cuda_graph import DecodeGraphs
from deepinfer.worker.kv_cache import cache_spec
from deepinfer.loader.model_config import read_model_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
from oracle import transformers_model  # noqa: E402

from conftest import CFG  # noqa: E402  (tests/engine/conftest.py: the ckpt / ckpt41 fixtures)
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20)


def _memory_for(ckpt, slots: int, tokens: int) -> int:
    """kv_cache_memory for `slots` request slots plus compressed entries for `tokens` tokens."""
    spec = cache_spec(read_model_config(ckpt), "float32", 4)
    per_token = sum(b / (4 * m) for m, b in spec.block_bytes.items())
    return slots * spec.slot_bytes + int(tokens * per_token) + 1


def _prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [[0] + torch.randint(3, CFG["vocab_size"], (k,), generator=g).tolist() for k in lens]


def test_mixed_batch_with_chunking_queueing_and_preemption_matches_solo_and_transformers(ckpt, llm, tmp_path):
    prompts = _prompts(7, lo=55, hi=85)
    # 3 slots sharing compressed-entry blocks for 300 tokens: 7 requests of 67-97 tokens queue,
    # prompts are chunked (budget 24 tokens/step), running requests get preempted when blocks run out
    small = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4,
                kv_cache_memory=_memory_for(ckpt, slots=3, tokens=300), max_num_seqs=3,
                max_num_batched_tokens=24, max_model_len=100)
    assert small.scheduler.kv.num_slots == 3 and small.scheduler.kv.num_blocks == {4: 18, 16: 4}
    mixed = small.generate(prompts, GREEDY, use_tqdm=False)
    assert small.scheduler.num_preemptions > 0
    assert small.scheduler.kv.all_free()
    hf = transformers_model(llm.model, tmp_path)
    for p, out in zip(prompts, mixed):
        alone = llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert alone.token_ids == ref
        assert alone.finish_reason == ("stop" if ref[-1] == CFG["eos_token_id"] else "length")


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"), ({"n": 0}, "n"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_before_scheduling_and_the_engine_keeps_serving(llm):
    good = _prompts(2, seed=3)
    for bad, field in [("", "empty"), ([], "empty"), ([0, CFG["vocab_size"]], "vocabulary"), ([0, -1], "vocabulary"),
                       ([0] * 5000, "max_model_len")]:
        with pytest.raises(ValueError, match=field):
            llm.generate(good + [bad], GREEDY, use_tqdm=False)
        assert not llm.scheduler.has_unfinished()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(good, [GREEDY], use_tqdm=False)
    outs = llm.generate(good, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)


def test_no_block_leaks_after_many_requests(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4,
              kv_cache_memory=_memory_for(ckpt, slots=4, tokens=300), max_num_seqs=4,
              max_num_batched_tokens=40, max_model_len=120)
    kv = llm.scheduler.kv
    params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=k, ignore_eos=True) for k in range(1, 31)]
    outs = llm.generate(_prompts(30, seed=5), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 31))
    assert kv.all_free(), kv.num_free()


def test_finish_reasons_stop_tokens_and_strings(llm):
    p = _prompts(1, seed=7)[0]
    base = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and len(toks) == 10
    cut = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                           stop_token_ids=[toks[3]]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids == toks[:toks.index(toks[3]) + 1]
    # the stop string: the first two letters or digits in a row in the second half of the text
    text = base.outputs[0].text
    stop = next((text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].isalnum()), None)
    assert stop is not None, f"no two-character word in the second half of {text!r}"
    # generation ends with the first token whose text completes the stop string's first occurrence
    n = next(k for k in range(1, len(toks) + 1) if stop in llm.detokenizer.decode(toks[:k]))
    assert n < len(toks)
    s = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
                     use_tqdm=False)[0].outputs[0]
    assert s.finish_reason == "stop" and s.token_ids == toks[:n]
    assert s.text == text[:text.index(stop)]


def test_n_siblings_share_the_prefill_and_logprobs(llm):
    p = _prompts(1, seed=9)[0]
    one = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    three = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3, logprobs=3),
                         use_tqdm=False)[0]
    assert [c.index for c in three.outputs] == [0, 1, 2]
    for c in three.outputs:  # forks copy the leader's state: greedy continuations are identical
        assert c.token_ids == one.outputs[0].token_ids
        assert len(c.logprobs) == 8
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and len(lp) == 3 and max(lp.values()) == lp[tok] and lp[tok] <= 0
    sampled = llm.generate([p], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4),
                           use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert llm.scheduler.kv.all_free()


def test_text_prompts_get_bos_and_decoded_text(llm):
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "Hello world" and out.prompt_token_ids[0] == 0
    assert out.outputs[0].text == llm.detokenizer.decode(out.outputs[0].token_ids)


def test_offline_example_runs_with_the_demo_model(tmp_path):
    """The shipped trained demo (an empty cache dir: nothing is written), 2 tokens a prompt: a prefill and a
    decode step of the demo's bf16 CPU forward, the costly part of this test."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--model", "demo",
                          "--device", "cpu", "--max-tokens", "2"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("Completion:") == 4 and "output tok/s" in res.stdout


def test_cli_generate(ckpt):
    res = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "generate", "--model", str(ckpt),
                          "--prompt", "Hello", "--max-tokens", "5", "--temperature", "0", "--device", "cpu"],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "finish_reason" in res.stdout


def test_an_llm_is_a_context_manager_closed_once_and_freed_when_dropped(ckpt):
    with LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20) as llm:
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.close()  # closing again does nothing
    with pytest.raises(RuntimeError, match="LLM is closed"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    ref = weakref.ref(llm)
    del llm  # no reference cycle holds it
    assert ref() is None


def test_cli_refuses_a_max_model_len_above_the_model_in_one_line(ckpt):
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN"}
    res = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "generate", "--model", str(ckpt),
                          "--prompt", "Hello", "--max-model-len", "100000", "--device", "cpu"],
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    limit = CFG["max_position_embeddings"]
    assert res.returncode == 2, res.stderr[-2000:]
    assert re.match(r"deepinfer: error: (--max-model-len|max_model_len): 100000 ", res.stderr), res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert f"max_position_embeddings {limit}" in res.stderr


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_greedy(ckpt, llm):
    prompts = _prompts(6, seed=13)
    gpu = LLM(str(ckpt), device="cuda", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20,
              max_num_batched_tokens=32)
    for a, b in zip(gpu.generate(prompts, GREEDY, use_tqdm=False), llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert gpu.scheduler.kv.all_free()


class _HostGraphs(DecodeGraphs):
    """DecodeGraphs' step planning (batch padded with scratch rows, entry widths bucketed, inputs packed into
    the staging buffer and copied into the graph's input buffer, placeholder inputs filled there) with the
    capture and each replay replaced by an eager forward over that input buffer, on the CPU. `planned` logs
    each step's entry point: ("rows", B) planned from the scheduler's arrays, ("chunks", B) from its chunks."""

    planned: list

    def run(self, chunks, fill=None):
        self.planned.append(("chunks", len(chunks)))
        return super().run(chunks, fill)

    def run_rows(self, rows, fill=None):
        self.planned.append(("rows", len(rows.slots)))
        return super().run_rows(rows, fill)

    def _capture(self, host_batch, inputs):
        views = self.input_views(host_batch, inputs)
        return views, inputs, self.forward(views)

    def _launch_graph(self, entry) -> None:
        entry[2].copy_(self.forward(entry[0]))


def _check_graph_decode_matches_eager(ckpt, device: str) -> None:
    """5 greedy requests, bf16, batch-invariant: with every pure-decode step on the graph path,
    tokens and top-5 logprobs bit for bit those of eager decode (the padding and the bucketed
    entry tables reach no real row)."""
    prompts = _prompts(5, seed=17)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs, steps = {}, []
    for eager in (True, False):
        llm = LLM(str(ckpt), device=device, dtype="bfloat16", kv_cache_dtype="bfloat16", kv_cache_memory=64 << 20,
                  enforce_eager=eager or device == "cpu", batch_invariant=True)
        runner = llm.engine.core.runner
        if device == "cpu" and not eager:
            runner.graphs = _HostGraphs(runner.model, runner.cache, runner.cache.scratch_slot,
                                        runner.cache.scratch_addr, device="cpu")
            runner.graphs.planned = steps
        assert (runner.graphs is None) == eager
        if not eager and device != "cpu":
            run, run_rows = runner.graphs.run, runner.graphs.run_rows
            runner.graphs.run = lambda chunks, fill=None: steps.append(("chunks", len(chunks))) or run(chunks, fill)
            runner.graphs.run_rows = lambda rows, fill=None: steps.append(("rows", len(rows.slots))) or \
                run_rows(rows, fill)
        outs[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                       for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.scheduler.kv.all_free()
    # one prefill step, then every decode step on graphs, planned from the scheduler's arrays; the first step of
    # each graph layout (batch bucket, entry widths) also from its chunks: that one builds the batch it captures
    assert [s for s in steps if s[0] == "rows"] == [("rows", 5)] * 11
    assert steps.count(("chunks", 5)) == len(runner.graphs.graphs) < 11
    for toks, lps in outs[True]:  # greedy: each token is its own logprobs' argmax
        assert len(toks) == len(lps) == 12 and all(lp[t] == max(lp.values()) for t, lp in zip(toks, lps))
    assert outs[False] == outs[True]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_graph_planned_decode_matches_eager_on_the_cpu(request, arch):
    _check_graph_decode_matches_eager(request.getfixturevalue("ckpt" if arch == "v4" else "ckpt41"), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_cuda_graph_decode_in_the_engine(request, arch):
    """Captured and replayed CUDA graphs (logprobs taken at launch: the next replay overwrites the
    graph's logits before the step is collected)."""
    _check_graph_decode_matches_eager(request.getfixturevalue("ckpt" if arch == "v4" else "ckpt41"), "cuda")


@pytest.mark.parametrize("kv", ["float32", "auto"])
def test_v41_async_scheduling_matches_synchronous_steps(ckpt41, kv):
    """V4.1 hashes Engram n-grams from the device history, so steps planned ahead with placeholder
    inputs are hashed from the tokens filled on the device: the synchronous engine's tokens, with
    chunked prefill and preemption (few slots), in exact and reference cache formats."""
    prompts = _prompts(6, seed=23)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs, ahead = {}, {}
    for on in (False, True):
        engine = LLM(str(ckpt41), device="cpu", dtype="float32", kv_cache_dtype=kv, kv_cache_memory=32 << 20,
                     max_num_seqs=3, max_num_batched_tokens=24, async_scheduling=on)
        assert engine.engine.core.async_scheduling == on
        calls = []
        launch = engine.engine.core.runner.launch
        engine.engine.core.runner.launch = lambda so, prev=None: calls.append(prev is not None) or launch(so, prev)
        outs[on] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        ahead[on] = sum(calls)
        assert engine.scheduler.kv.all_free()
    assert outs[True] == outs[False]
    assert ahead[False] == 0 and ahead[True] > 10


def test_async_scheduling_matches_synchronous_steps(ckpt, llm):
    """Steps planned ahead with placeholder inputs give the synchronous engine's tokens, through
    stop tokens (wasted look-ahead tokens dropped), length limits, admission and chunked prefill."""
    prompts = _prompts(9, seed=21)
    base = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    # odd requests stop on their third greedy token, even ones run to a length of 4 + i
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True,
                             stop_token_ids=[b.outputs[0].token_ids[2]] if i % 2 else []) for i, b in enumerate(base)]
    outs, ahead = {}, {}
    for on in (False, True):
        engine = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4,
                     kv_cache_memory=_memory_for(ckpt, slots=4, tokens=400), max_num_seqs=4,
                     max_num_batched_tokens=32, async_scheduling=on)
        calls = []
        launch = engine.engine.core.runner.launch
        engine.engine.core.runner.launch = lambda so, prev=None: calls.append(prev is not None) or launch(so, prev)
        outs[on] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                    for o in engine.generate(prompts, params, use_tqdm=False)]
        ahead[on] = sum(calls)
        assert engine.scheduler.kv.all_free() and engine.engine.core.inflight is None
    assert outs[True] == outs[False]
    assert ahead[False] == 0 and ahead[True] > 10  # most decode steps were launched ahead
    assert sum(why == "stop" for _, why in outs[True]) >= 4


def test_scheduled_ahead_placeholders_need_a_step_before():
    import numpy as np

    from deepinfer.engine.outputs import PLACEHOLDER, DecodeRows, SchedulerOutput, ScheduledChunk
    from deepinfer.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    so = SchedulerOutput([ScheduledChunk("r", 0, 5, [PLACEHOLDER], {}, 1, GREEDY)])
    with pytest.raises(ValueError, match="placeholder"):
        runner._fill(so, None)
    so.decode = DecodeRows(np.array([PLACEHOLDER]), np.array([0]), np.array([5]), {}, {})  # the array path
    with pytest.raises(ValueError, match="request r: placeholder input without a step before it"):
        runner._fill(so, None)


def test_logprobs_survive_a_reused_logits_buffer(ckpt):
    """A CUDA graph returns its logits in one static buffer, and async scheduling launches step
    i + 1 before collecting step i: logprobs must be taken at launch. Here compute_logits writes
    into one reused buffer on the CPU, the same aliasing without a GPU."""
    prompts = [[0] + list(range(5, 5 + n)) for n in (7, 12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run(static: bool):
        eng = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=64 << 20)
        model = eng.engine.core.runner.model
        if static:
            plain, buf = model.compute_logits, {}

            def into_buffer(h):
                out = plain(h)
                b = buf.get(out.shape)
                if b is None:
                    b = buf[out.shape] = torch.empty_like(out)
                return b.copy_(out)
            model.compute_logits = into_buffer
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eng.generate(prompts, params, use_tqdm=False)]

    assert run(static=True) == run(static=False)


def test_the_sampling_batch_is_reused_only_for_the_same_params_objects_unseeded():
    from deepinfer.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner._sb_cache = torch.device("cpu"), None
    a, b = SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=3)
    first = runner._sampling_batch([a, b], 100, [None, None])
    assert runner._sampling_batch([a, b], 100, [None, None]) is first
    c = SamplingParams(temperature=0.5, top_k=4)  # another object: rebuilt, whatever its values
    again = runner._sampling_batch([a, c], 100, [None, None])
    assert again is not first and again.top_k.tolist() == [100, 4]
    assert runner._sampling_batch([a], 100, [None]) is not again  # fewer rows
    assert runner._sampling_batch([a, c], 50, [None, None]) is not again  # another vocabulary
    seeded = runner._sampling_batch([a, c], 50, [None, (1, 7, 0)])
    assert seeded.seed_keys[1] is not None and runner._sampling_batch([a, c], 50, [None, (1, 8, 0)]) is not seeded
