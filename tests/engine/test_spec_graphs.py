"""Speculative steps through the CUDA graphs' fixed shapes (worker/cuda_graph.py at q tokens a request, each
chunk padded to the step's longest; worker/draft_graphs.py for the drafter's block). On the CPU the
captured functions run eagerly on the same fixed-shape batches (planning, padding, row mapping and the
drafter's context store inside the step are what is tested); tests/worker/test_spec_graphs_gpu.py replays
them as graphs. Greedy outputs equal speculation off and the eager speculative engine, counters included."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.scheduler import VarlenPolicy
from deepinfer.layers import invariant
from deepinfer.loader.model_config import read_model_config
from deepinfer.models.interface import DraftBlock
from deepinfer.spec.schedule import SPSTable, StepTimes
from deepinfer.worker.cuda_graph import DecodeGraphs
from deepinfer.worker.draft_graphs import DraftGraphs
from deepinfer.worker.drafter import DSparkDrafter
from deepinfer.worker.sps_profile import profile_step_times, step_buckets
from test_speculative import _greedy_off, _llm, _prompts, confident_oracle, continuations


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose steps call the captured function eagerly on their fixed-shape batch."""

    def run(self, chunks, fill=None):
        batch = self.plan(chunks)[1]
        if fill is not None:  # placeholder inputs, as the graphs fill their input buffer
            batch.input_ids[fill[0]] = fill[1]
        return self.forward(batch)[:sum(len(c.token_ids) for c in chunks)]

    def run_planned(self, tokens, starts, slots, tables, visible):
        B, q = tokens.shape
        padded = self._bucket(B)
        inputs = self.stage_planned(B, q, slots, tables, visible)[1].clone()  # (the graph's packed inputs)
        self._fill_planned(inputs, tokens, starts, padded)
        return self.forward(self._planned_batch(inputs, padded, q, visible))[:B * q]


class EagerDraftGraphs(DraftGraphs):
    """DraftGraphs whose blocks are drafted eagerly over the padded anchors (scratch-slot rows at position 0)."""

    def run(self, tokens, positions, slots):
        n = tokens.shape[0]
        pad = torch.zeros(next(b for b in self.buckets if b >= n) - n, dtype=torch.long)
        block = self.draft(torch.cat((tokens, pad)), torch.cat((positions, pad)),
                           torch.cat((slots, pad + self.scratch_slot)))
        return DraftBlock(block.tokens[:n], block.logits[:n], block.confidence[:n])

    def _capture(self, padded):  # (start-up capture: the bucket is held, its blocks drafted eagerly as above)
        return None


def assert_same_outputs(got, want, off) -> None:
    """Greedy tokens equal (got, want and speculation off); got's logprobs equal want's within fp32 noise."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want] == \
        [o.outputs[0].token_ids for o in off]
    # fp32: a fixed-shape batch (padded rows, a compressor row for every token) runs its GEMMs at other row
    # counts than an eager one; measured up to 3.3e-6 apart on the CI host, 1e-4 leaves room for thread counts
    for a, b in zip(got, want):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def _graphed(llm) -> list[tuple[int, list[int], bool]]:
    """Installs the stand-ins in the LLM's runner; returns the log of (q, the chunks' token counts before
    padding, whether every chunk is a pending token and its drafts) of every speculative step, q = 0 for the
    steps left eager (verify steps scheduled ahead included)."""
    r = llm.engine.core.runner
    drafter = r.drafter if isinstance(r.drafter, DSparkDrafter) else None
    r.graphs = EagerGraphs(r.model, r.cache, r.cache.scratch_slot, r.cache.scratch_addr, visible_bucket=4,
                           device="cpu", drafter=drafter)
    if drafter is not None:
        drafter.graphs = EagerDraftGraphs(drafter.draft, r.cache.scratch_slot, "cpu")
    seen, width = [], r._graph_width

    def logged(so, fill):
        q = width(so, fill)
        seen.append((q, [len(c.token_ids) for c in so.chunks],
                     all(len(c.token_ids) == 1 + c.num_draft and not c.prompt_rows for c in so.chunks)))
        return q

    r._graph_width = logged
    ahead = r._verify_ahead

    def planned(so, prev):  # a verify step scheduled ahead: always on the fixed shapes (planned on the device)
        seen.append((len(so.chunks[0].token_ids), [len(c.token_ids) for c in so.chunks], True))
        return ahead(so, prev)

    r._verify_ahead = planned
    cover, llm.past_tables = r._cover, []

    def covered(c, q):  # logs the padded chunks whose tables were extended with the scratch block
        tables = cover(c, q)
        if tables is not c.block_tables:
            llm.past_tables.append((c.request_id, c.start, q))
        return tables

    r._cover = covered
    return seen


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_dspark_steps_on_fixed_shapes_equal_eager(ckpt41, monkeypatch, varlen):
    k = 4
    prompts = _prompts(5, read_model_config(ckpt41).vocab_size, seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    off = _llm(ckpt41, None, max_num_seqs=8).generate(prompts, greedy, use_tqdm=False)
    confident_oracle(monkeypatch, continuations(prompts, [o.outputs[0].token_ids for o in off]), k)
    kw = dict(speculative_config={"method": "dspark", "num_speculative_tokens": k}, enable_mtp_varlen=varlen,
              max_num_seqs=8)
    eager = _llm(ckpt41, None, **kw)
    graphed = _llm(ckpt41, None, **kw)
    for llm in (eager, graphed) if varlen else ():  # one fixed table (the start-up one follows the CPU's load)
        most = llm.scheduler.varlen.sps.max_batch
        llm.scheduler.varlen = replace(llm.scheduler.varlen,
                                       sps=SPSTable.from_points([(1, 0.010), (most, 0.010 + 0.002 * most)], most))
    seen = _graphed(graphed)
    want = eager.generate(prompts, greedy, use_tqdm=False)
    got = graphed.generate(prompts, greedy, use_tqdm=False)
    assert_same_outputs(got, want, off)
    assert graphed.get_metrics() == eager.get_metrics()
    # every decode step took the fixed shapes (padding past a request's block tables writes the scratch block)
    assert all(q for q, lens, decode in seen if decode)
    assert set(graphed.engine.core.runner.eager_steps) <= {"prefill, n > 1 or prompt logprobs"}
    assert any(q > 1 for q, _, _ in seen)
    if varlen:  # requests verifying fewer drafts than the step's longest were padded
        assert any(q and min(lens) < q for q, lens, _ in seen)
    assert graphed.scheduler.kv.all_free()


def test_prompt_lookup_steps_on_fixed_shapes_equal_speculation_off(ckpt41):
    """No drafter (the drafts are the host's): steps of unequal draft counts are padded to the longest. Blocks of 4
    entries: padded positions often close entries past a request's block tables, which go to the scratch block."""
    prompts, want = _greedy_off(str(ckpt41), 6, 1, 20)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    llm = _llm(ckpt41, 3, block_size=4)
    seen = _graphed(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert any(q > 1 and min(lens) < q for q, lens, _ in seen)
    assert llm.get_metrics()["num_drafts"] > 0
    assert llm.past_tables and not llm.engine.core.runner.eager_steps.get("drafts past the ring slack")


def test_step_times_are_measured_through_the_runner(ckpt41):
    llm = _llm(ckpt41, None, speculative_config={"method": "dspark", "num_speculative_tokens": 2}, max_num_seqs=3)
    assert step_buckets(3) == [1, 2, 3] and step_buckets(4) == [1, 2, 4]
    times = profile_step_times(llm.engine.profile_runner(), llm.scheduler.kv, 2, 3, llm.scheduler.budget, reps=1)
    assert times.buckets.tolist() == [1, 2, 3] and times.k == 2
    assert np.isfinite(times.seconds).all() and (times.seconds > 0).all()
    assert llm.scheduler.kv.all_free()


def test_one_length_a_step_backs_off_and_stops_drafting_where_drafts_cannot_pay(ckpt41, monkeypatch):
    """The graphs' policy (spec/schedule.py uniform_length) over times where drafts pay at 1-2 requests and not
    from 3: a crowded step verifies nothing and drafts nothing (SchedulerOutput.propose), drafting resumes as the
    batch thins out, and greedy outputs equal speculation off throughout."""
    k = 3
    prompts = _prompts(6, read_model_config(ckpt41).vocab_size, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (4, 6, 8, 10, 22, 26)]
    off = [o.outputs[0].token_ids for o in _llm(ckpt41, None, max_num_seqs=8).generate(prompts, params, use_tqdm=False)]
    confident_oracle(monkeypatch, continuations(prompts, off), k)
    llm = _llm(ckpt41, None, speculative_config={"method": "dspark", "num_speculative_tokens": k}, max_num_seqs=8)
    seen = _graphed(llm)
    sched = llm.scheduler
    sched.varlen = VarlenPolicy(None, None, StepTimes([2, 8], [[0.010, 0.0105, 0.011, 0.0115],
                                                               [0.010, 0.030, 0.050, 0.070]]))
    steps, ahead, schedule, schedule_ahead = [], [], sched.schedule, sched.schedule_ahead

    def log(so):
        if so is not None:
            decoding = [c for c in so.chunks if c.num_samples and len(c.token_ids) == 1 + c.num_draft]
            steps.append((len(so.chunks), so.propose, max((c.num_draft for c in decoding), default=0)))
        return so

    def logged():
        return log(schedule())

    def logged_ahead(inflight):
        so = log(schedule_ahead(inflight))
        ahead.append(so is not None)
        return so

    sched.schedule, sched.schedule_ahead = logged, logged_ahead
    assert llm.engine.core.async_scheduling
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == off
    # while speculation is off, steps launch ahead as without it (placeholders from the verify path's rows)
    assert any(ahead)
    crowded = [(p, d) for n, p, d in steps[2:] if n >= 3]  # (after the first steps, which know no confidences)
    thin = [(p, d) for n, p, d in steps if n <= 2]
    assert crowded and all(not p for p, _ in crowded) and all(d == 0 for _, d in crowded[1:])
    assert thin and any(d > 0 for _, d in thin)
    assert any(q > 1 for q, _, _ in seen)
    assert sched.kv.all_free()


class KeyedGraphs(EagerGraphs):
    """EagerGraphs that hold an entry per graph key they ran (what a capture would have made), and log whether
    each ran in batch-invariant numerics (a graph replays the kernels of its capture)."""

    modes: list[bool]

    def run(self, chunks, fill=None):
        self.graphs.setdefault(self.plan(chunks)[0], None)
        self.modes.append(invariant.enabled())
        return super().run(chunks, fill)

    def run_planned(self, tokens, starts, slots, tables, visible):
        self.graphs.setdefault(("planned", self._bucket(tokens.shape[0]), tokens.shape[1],
                                tuple(sorted(visible.items()))), None)
        return super().run_planned(tokens, starts, slots, tables, visible)


@pytest.mark.parametrize("invariant_on", [False, True], ids=["default", "batch-invariant"])
def test_start_up_capture_covers_every_step_of_a_run(ckpt41, invariant_on):
    """capture_speculative plans, before any request, the graph of every (batch bucket, q, entry-table widths) the
    run's steps then take: no capture inside a served step (scratch-slot steps of the same shapes)."""
    k, limit = 3, 10_000
    llm = _llm(ckpt41, None, speculative_config={"method": "dspark", "num_speculative_tokens": k}, max_num_seqs=4,
               max_model_len=96, batch_invariant=invariant_on)
    r = llm.engine.core.runner
    _graphed(llm)
    r.graphs = KeyedGraphs(r.model, r.cache, r.cache.scratch_slot, r.cache.scratch_addr, visible_bucket=4,
                           device="cpu", drafter=r.drafter)
    r.graphs.modes = []
    sets = r.graphs.visible_sets(96 + k - 1)
    assert [p for p, _ in sets] == sorted(p for p, _ in sets) and len(sets) > 2
    assert all(r.graphs.visible(p) == v for p, v in sets)
    assert {tuple(sorted(r.graphs.visible(p).items())) for p in range(96 + k)} == \
        {tuple(sorted(v.items())) for _, v in sets}
    captured = r.capture_speculative(4, k, 96 + k - 1, limit)
    assert r.graphs.modes and all(m == invariant_on for m in r.graphs.modes)  # the runner's numerics
    held = set(r.graphs.graphs)
    assert captured >= len(held) > 0 and any(key[0] == "planned" for key in held)
    assert r.capture_speculative(4, k, 96 + k - 1, limit) == 0  # nothing left to capture
    prompts = _prompts(4, read_model_config(ckpt41).vocab_size, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (30, 41, 52, 63)]
    llm.generate(prompts, params, use_tqdm=False)
    assert set(r.graphs.graphs) == held  # every step's key was captured at start-up
    assert sorted(r.drafter.graphs.graphs) == [1, 2, 4]
    assert r.capture_speculative(4, k, 96 + k - 1, limit=3) == 0
