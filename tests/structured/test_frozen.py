"""freeze_grammars: a step's grammar masks computed on the driver and carried, pickled, to processes that never
see the grammar objects. A ModelRunner given the frozen step applies the very masks (and so samples the very
tokens) it applies given the live step; freezing leaves the live grammars as they were."""
from __future__ import annotations

import itertools
import json
import pickle

import numpy as np
import pytest
import torch

from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ScheduledChunk, SchedulerOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.loader.model_loader import load_model
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.ngram import NgramProposer
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.tools.tiny_tokenizer import SPECIAL_TOKENS
from deepinfer.worker import model_runner
from deepinfer.worker.kv_cache import allocate_v4_cache
from deepinfer.worker.model_runner import ModelRunner

pytest.importorskip("xgrammar")

from deepinfer.structured import FrozenGrammar, GrammarBackend, freeze_grammars  # noqa: E402

EOS = 1
THINK, END_THINK = SPECIAL_TOKENS.index("<think>"), SPECIAL_TOKENS.index("</think>")
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "name", "tags", "ok"], "additionalProperties": False}
SO_ARGS = {"schema_type": "json", "schema": SCHEMA}
SLOTS, BLOCK = 8, 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", {**PRESETS["tiny"], "index_topk": 64},
                            seed=11, dtype="fp8")


def _runner(ckpt, slack=0):
    """A ModelRunner on the tiny model (fp32 on the CPU) with its own cache: SLOTS slots, BLOCK-token blocks."""
    model = load_model(str(ckpt), dtype=torch.float32)[0]
    blocks = {m: 64 for m in set(model.config.compress_ratios) if m}
    cache = allocate_v4_cache(model.config, SLOTS, blocks, "float32", "cpu", BLOCK, ring_slack=slack)
    return ModelRunner(model, cache, "cpu", seed=0, cuda_graphs=False), blocks


@pytest.fixture(scope="module")
def probe(ckpt):
    """A runner that test 1 calls directly, its logits all zero (only the masks decide its rows)."""
    runner, _ = _runner(ckpt)
    vocab = runner.model.config.vocab_size
    runner.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    return runner


@pytest.fixture(scope="module")
def backend(ckpt, probe):
    be = GrammarBackend(ckpt / "tokenizer.json", probe.model.config.vocab_size, [EOS])
    yield be
    be.close()


def _grammar(backend, prompt=(0, 10, 11)):
    g = backend.request_grammar(backend.validate(SO_ARGS), list(prompt))
    assert g.error is None  # waits for the compile
    return g


def _allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.nonzero(np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")[:vocab])[0]


def _walk(g, n, rng, vocab):
    """n tokens the grammar allows in a row from its state (not EOS), drawn by `rng`; g is unchanged."""
    f, out, mask = g.fork(), [], np.zeros(g.backend.bitmask_width, dtype=np.int32)
    for _ in range(n):
        f.fill_bitmask(mask)
        ok = [t for t in _allowed(mask, vocab).tolist() if t != EOS]
        out.append(int(rng.choice(ok)))
        assert f.accept(out[-1])
    return out


def _advance(g, n, rng, vocab):
    for t in _walk(g, n, rng, vocab):
        assert g.accept(t)
    return g


def _next(g):
    mask = np.zeros(g.backend.bitmask_width, dtype=np.int32)
    g.fill_bitmask(mask)
    return mask


def _chunk(rid, slot, tokens, grammar=None, num_samples=1, num_draft=0):
    params = SamplingParams(temperature=0.0, max_tokens=50)
    return ScheduledChunk(rid, slot, 20, list(tokens), {}, num_samples, params, num_tokens=20 + len(tokens),
                          num_draft=num_draft, grammar=grammar)


def _applied(runner, so, verify, monkeypatch):
    """The token masks the runner applies to the step's sampled (verify: verified) rows, [rows, words]."""
    seen = []

    def record(logits, masks):
        seen.append(masks.clone())
        return apply(logits, masks)
    apply = model_runner.apply_token_bitmask
    monkeypatch.setattr(model_runner, "apply_token_bitmask", record)
    rows = list(range(len(so.chunks)))
    with torch.inference_mode():
        if verify:
            streams = torch.zeros(sum(len(c.token_ids) for c in so.chunks), 1)
            starts = list(itertools.accumulate((len(c.token_ids) for c in so.chunks), initial=0))
            runner._verify(so, rows, lambda idx: runner.model.compute_logits(streams[idx]), starts)
        else:
            runner._sample(so, torch.zeros(len(rows), runner.model.config.vocab_size), rows)
    monkeypatch.setattr(model_runner, "apply_token_bitmask", apply)
    assert len(seen) == 1
    return seen[0]


@pytest.fixture
def steps(backend):
    """Live steps over grammars in distinct states: plain (grammar, free and mid-prefill chunks), verify
    (drafts through a grammar, and through the end of a thinking block into one) and an n > 1 fork."""
    vocab, rng = backend.vocab_size, np.random.default_rng(0)
    a, b = _grammar(backend), _advance(_grammar(backend), 3, rng, vocab)
    c = _advance(_grammar(backend), 9, rng, vocab)
    think = _grammar(backend, (0, 10, THINK))  # the prompt opens a thinking block: free until </think>
    d_a, d_c = _walk(a, 3, rng, vocab), _walk(c, 2, rng, vocab)
    d_think = [20, END_THINK] + _walk(_with(think, [20, END_THINK]), 2, rng, vocab)
    plain = SchedulerOutput([_chunk("a", 0, [5], a), _chunk("free", 1, [6]), _chunk("b", 2, [7], b),
                             _chunk("mid", 3, [8, 9], _grammar(backend), num_samples=0), _chunk("c", 4, [9], c)])
    verify = SchedulerOutput([_chunk("a", 0, [5] + d_a, a, num_draft=3), _chunk("b", 2, [7], b),
                              _chunk("free", 1, [6, 30, 31], num_draft=2),
                              _chunk("think", 5, [4] + d_think, think, num_draft=4),
                              _chunk("c", 4, [9] + d_c, c, num_draft=2)])
    fork = SchedulerOutput([_chunk("lead", 0, [5, 6, 7], c, num_samples=3), _chunk("a", 4, [9], a),
                            _chunk("free", 1, [6], num_samples=2)])
    return {"plain": (plain, False), "verify": (verify, True), "fork": (fork, False), "fork-verify": (fork, True)}


def _with(g, tokens):
    f = g.fork()
    for t in tokens:
        assert f.accept(t)
    return f


@pytest.mark.parametrize("kind", ["plain", "verify", "fork", "fork-verify"])
def test_frozen_masks_equal_live(probe, steps, kind, monkeypatch):
    """(1) The runner's masks from the frozen (pickled) step are the live step's, row for row."""
    so, verify = steps[kind]
    runner, vocab = probe, probe.model.config.vocab_size
    live = _applied(runner, so, verify, monkeypatch)
    frozen = pickle.loads(pickle.dumps(freeze_grammars(so, vocab)))
    assert all(isinstance(c.grammar, FrozenGrammar) for c in frozen.chunks if c.grammar is not None)
    got = _applied(runner, frozen, verify, monkeypatch)
    assert torch.equal(live, got)
    # the masks differ across the constrained rows (a row from the wrong state would show)
    constrained = [r for r in live if not bool((r == -1).all())]
    assert len({r.numpy().tobytes() for r in constrained}) >= (4 if kind == "verify" else 2)


def test_frozen_surface(steps, probe):
    """Masks along the drafts frozen only (other drafts raise); a frozen grammar's backend also fills the live
    grammars listed with frozen ones."""
    so, _ = steps["verify"]
    frozen = freeze_grammars(so, probe.model.config.vocab_size)
    g, live = frozen.chunks[0].grammar, so.chunks[1].grammar
    both, want = np.zeros((3, len(g.rows[0])), dtype=np.int32), np.zeros(len(g.rows[0]), dtype=np.int32)
    g.backend.fill_bitmasks([g, live], both, [2, 0])
    live.fill_bitmask(want)
    assert np.array_equal(both[2], g.rows[0]) and np.array_equal(both[0], want) and not both[1].any()
    out = np.zeros((len(g.drafts) + 1, len(g.rows[0])), dtype=np.int32)
    g.fill_bitmasks_along(list(g.drafts), out)
    with pytest.raises(ValueError, match="were frozen"):
        g.fill_bitmasks_along(list(g.drafts[:-1]), out)
    with pytest.raises(ValueError, match="were frozen"):
        g.fill_bitmasks_along(list(g.drafts[:-1]) + [g.drafts[-1] + 1], out)
    with pytest.raises(ValueError, match="rows"):
        g.fill_bitmasks_along(list(g.drafts), out[:-1])


def test_freeze_pickles_small_and_leaves_grammars(steps, probe, backend):
    """(2) The frozen step pickles (the live one cannot), small: one copy of each distinct mask, the rest of
    the step as it was; the live grammars' next masks are the same before and after freezing."""
    vocab, words = probe.model.config.vocab_size, backend.bitmask_width
    for kind in ("plain", "verify", "fork"):
        so, _ = steps[kind]
        grammars = [c.grammar for c in so.chunks if c.grammar is not None]
        before = [(_next(g), g.in_reasoning, g.terminated) for g in grammars]
        frozen = freeze_grammars(so, vocab)
        after = [(_next(g), g.in_reasoning, g.terminated) for g in grammars]
        for (m0, r0, t0), (m1, r1, t1) in zip(before, after):
            assert np.array_equal(m0, m1) and r0 == r1 and t0 == t1
        with pytest.raises(TypeError):
            pickle.dumps(so)
        for c, f in zip(so.chunks, frozen.chunks):
            if c.grammar is None:
                assert f is c  # shared, not copied
            else:
                assert f is not c and c.grammar is not None  # the live step keeps its grammars
                assert (f.grammar is None) == (c.num_samples == 0)
                assert (f.request_id, f.token_ids, f.num_samples, f.num_draft) == \
                    (c.request_id, c.token_ids, c.num_samples, c.num_draft)
        data = pickle.dumps(frozen)
        back = pickle.loads(data)
        rows = {r.tobytes() for c in frozen.chunks if c.grammar is not None for r in c.grammar.rows}
        bare = SchedulerOutput([ScheduledChunk(**{**c.__dict__, "grammar": None}) for c in frozen.chunks])
        assert len(data) <= len(pickle.dumps(bare)) + len(rows) * (words * 4 + 200), kind  # ~160 B a numpy array
        for c, d in zip(frozen.chunks, back.chunks):
            if c.grammar is not None:
                assert c.grammar.drafts == d.grammar.drafts
                assert all(np.array_equal(x, y) for x, y in zip(c.grammar.rows, d.grammar.rows))
    # many requests in one state: their mask is one array, pickled once
    same = pickle.loads(pickle.dumps(freeze_grammars(
        SchedulerOutput([_chunk(f"r{i}", i, [5], _grammar(backend)) for i in range(16)]), vocab)))
    assert len({id(c.grammar.rows[0]) for c in same.chunks}) == 1


def _request(rid, prompt, params, backend=None):
    """A request as the engine submits it: its grammar compiled (so it is schedulable), n > 1 siblings forking."""
    reqs = [Request(f"{rid}.{j}", list(prompt), params, EOS, sample_index=j) for j in range(params.n)]
    if params.so_args is not None:
        reqs[0].grammar = backend.request_grammar(backend.validate(params.so_args), list(prompt))
        assert reqs[0].grammar.error is None
    reqs[0].siblings = reqs[1:]
    for sib in reqs[1:]:
        sib.status = Status.FORKING
    return reqs


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_frozen_runner_samples_as_live(ckpt, backend, speculative):
    """(3) End to end on the CPU, the scheduler driving JSON-schema requests (greedy, n = 2, seeded sampling; a
    free request beside them; speculative: prompt-lookup drafts verified): every step, a second runner of the
    same model given only the pickled frozen step samples the driver's tokens."""
    from tokenizers import Tokenizer

    slack = 3 if speculative else 0
    (runner, blocks), (shadow, _) = _runner(ckpt, slack), _runner(ckpt, slack)
    vocab = runner.model.config.vocab_size
    sched = Scheduler(KVCacheManager(SLOTS, blocks, BLOCK), SLOTS, 256, 1024,
                      NgramProposer(3, prompt_lookup_max=2) if speculative else None)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    text = '{"id":12,"name":"ab","tags":["a"],"ok":true} {"id":12,"name":"ab","tags":["bb","a"],"ok":false}'
    asks = [(text, SamplingParams(temperature=0, max_tokens=80, so_args=SO_ARGS)),
            ("Once upon a time", SamplingParams(temperature=0, max_tokens=80, so_args=SO_ARGS, n=2)),
            (text + " again", SamplingParams(temperature=1.0, seq_seed=7, max_tokens=80, so_args=SO_ARGS)),
            ("The quick brown fox", SamplingParams(temperature=0, max_tokens=20))]
    reqs = []
    for i, (prompt, params) in enumerate(asks):
        group = _request(i, [0] + tok.encode(prompt).ids, params, backend)
        sched.add(group[0])
        reqs += group
    seen, steps = {"grammar": 0, "drafts": 0, "fork": 0}, 0
    while sched.has_unfinished():
        so = sched.schedule()
        data = pickle.dumps(freeze_grammars(so, vocab))
        mo = runner.execute(so)
        assert shadow.execute(pickle.loads(data)).sampled == mo.sampled
        sampled = [c for c in so.chunks if c.grammar is not None and c.num_samples]
        seen["grammar"] += bool(sampled)
        seen["drafts"] += any(c.num_draft for c in sampled)
        seen["fork"] += any(c.num_samples > 1 for c in sampled)
        sched.update(so, mo)
        steps += 1
        assert steps < 400
    assert seen["grammar"] >= 5 and seen["fork"] >= 1 and (seen["drafts"] >= 1 or not speculative), seen
    for r in reqs:
        if r.params.so_args is not None:
            assert r.finish_reason == "stop", r.output_token_ids
            json.loads(tok.decode(r.output_token_ids))
