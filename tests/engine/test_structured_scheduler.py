"""Structured outputs in the scheduler (CPU, no model): a grammar still compiling never holds the batch,
emitted tokens advance the grammar, a complete grammar finishes its request, drafts are cut to the
grammar's prefix, n > 1 siblings fork the state, async look-ahead waits for constrained requests."""
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ModelOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.ngram import NgramProposer


class FakeGrammar:
    """Accepts the tokens of `allowed` in order, then is complete; ready once `compiled`."""

    def __init__(self, allowed: list[int], compiled: bool = True):
        self.allowed, self.pos, self.compiled, self.error = allowed, 0, compiled, None
        self.accepted: list[int] = []

    def ready(self) -> bool:
        return self.compiled

    def accept(self, tok: int) -> bool:
        if self.pos >= len(self.allowed) or self.allowed[self.pos] != tok:
            return False
        self.pos += 1
        self.accepted.append(tok)
        return True

    def rollback(self, n: int) -> None:
        self.pos -= n
        del self.accepted[len(self.accepted) - n:]

    def valid_prefix(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and self.pos + n < len(self.allowed) and self.allowed[self.pos + n] == tokens[n]:
            n += 1
        return n

    def fork(self) -> "FakeGrammar":
        g = FakeGrammar(self.allowed)
        g.pos, g.accepted = self.pos, list(self.accepted)
        return g

    @property
    def terminated(self) -> bool:
        return self.pos == len(self.allowed)


def _sched(**kw):
    kv = KVCacheManager(num_slots=8, num_blocks={4: 100, 16: 100}, block_size=4)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1000, **kw)


def _req(i, prompt, max_tokens=20, n=1):
    return Request(str(i), list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n))


def test_a_compiling_grammar_waits_in_the_queue_and_never_holds_the_batch():
    sched = _sched()
    slow, free = _req(0, [1, 2, 3]), _req(1, [4, 5])
    slow.grammar = FakeGrammar([9, 9, 8], compiled=False)
    sched.add(slow)
    sched.add(free)
    so = sched.schedule()
    assert [c.request_id for c in so.chunks] == ["1"]  # the unconstrained request runs at once
    sched.update(so, ModelOutput({"1": [6]}))
    for _ in range(2):
        so = sched.schedule()
        assert [c.request_id for c in so.chunks] == ["1"]
        sched.update(so, ModelOutput({"1": [6]}))
    slow.grammar.compiled = True
    so = sched.schedule()  # compiled now: admitted behind the running request
    assert [c.request_id for c in so.chunks] == ["1", "0"] and so.chunks[1].grammar is slow.grammar


def test_emitted_tokens_advance_the_grammar_and_its_completion_finishes_the_request():
    sched = _sched()
    req = _req(0, [1, 2, 3], max_tokens=50)
    req.grammar = FakeGrammar([9, 8, 7])
    sched.add(req)
    for tok in (9, 8, 7):
        so = sched.schedule()
        sched.update(so, ModelOutput({"0": [tok]}))
    assert req.output_token_ids == [9, 8, 7] and req.finish_reason == "stop"
    assert req.grammar.accepted == [9, 8, 7] and not sched.has_unfinished()


def test_a_token_the_grammar_rejects_aborts_its_request_alone():
    sched = _sched()
    bad, ok = _req(0, [1, 2]), _req(1, [3, 4], max_tokens=2)
    bad.grammar = FakeGrammar([9, 9])
    sched.add(bad)
    sched.add(ok)
    so = sched.schedule()
    sched.update(so, ModelOutput({"0": [5], "1": [6]}))
    assert bad.finish_reason == "abort" and "grammar rejected token 5" in bad.error
    so = sched.schedule()
    sched.update(so, ModelOutput({"1": [6]}))
    assert ok.finish_reason == "length" and ok.output_token_ids == [6, 6]


def test_drafts_are_cut_where_the_grammar_stops_accepting_and_verified_tokens_advance_it():
    sched = _sched(proposer=NgramProposer(4, 2, 1))
    # the prompt repeats 9 8 7 6, so prompt lookup drafts 8 7 6 ... after a 9
    req = _req(0, [9, 8, 7, 6, 9, 8, 7, 6], max_tokens=50)
    req.grammar = FakeGrammar([9, 8, 5, 5, 5])
    sched.add(req)
    so = sched.schedule()
    sched.update(so, ModelOutput({"0": [9]}))
    so = sched.schedule()
    (c,) = so.chunks
    assert c.num_draft == 1 and c.token_ids == [9, 8]  # 8 is in the grammar, 7 is not
    assert req.grammar.accepted == [9]  # drafts checked without advancing the state
    sched.update(so, ModelOutput({"0": [8, 5]}))  # the draft accepted, then the target's token
    assert req.output_token_ids == [9, 8, 5] and req.grammar.accepted == [9, 8, 5]


def test_n_siblings_fork_the_grammar_before_the_leaders_token():
    sched = _sched()
    req = _req(0, [1, 2, 3], n=2)
    sib = _req(1, [1, 2, 3])
    req.siblings = [sib]
    req.grammar = FakeGrammar([9, 8])
    sched.add(req)
    so = sched.schedule()
    sched.update(so, ModelOutput({"0": [9, 9]}))
    assert sib.grammar is not None and sib.grammar is not req.grammar
    assert req.grammar.accepted == [9] and sib.grammar.accepted == [9]


def test_look_ahead_carries_a_constrained_request_with_its_grammar():
    """Async scheduling plans the next step of a constrained request too (its forward needs no mask);
    the runner samples it once the step in flight has advanced the grammar (ModelRunner.complete)."""
    sched = _sched()
    bound = _req(1, [3, 4])
    bound.grammar = FakeGrammar([9] * 10)
    sched.add(bound)
    so = sched.schedule()
    sched.update(so, ModelOutput({"1": [9]}))
    ahead = sched.schedule_ahead(sched.schedule())
    assert ahead is not None and ahead.chunks[0].grammar is bound.grammar


def test_a_grammar_that_failed_to_compile_is_never_admitted():
    """(EngineCore aborts it with the grammar's error before the next schedule; between the two, a compile
    that fails must not reach a step, whose other requests would fail with it.)"""
    sched = _sched()
    bad, ok = _req(0, [1, 2]), _req(1, [3, 4])
    bad.grammar = FakeGrammar([9])
    bad.grammar.error = "so_args.schema: cannot start"
    sched.add(bad)
    sched.add(ok)
    so = sched.schedule()
    assert [c.request_id for c in so.chunks] == ["1"] and bad in sched.waiting
