"""Structured outputs through LLM on tiny random-weight checkpoints (CPU): with random weights only the
grammar makes the text valid, so every completion must parse / validate / match."""
import ast
import json
import random
import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.loader.model_config import read_model_config
from deepinfer.worker.kv_cache import cache_spec

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MAX_TOKENS = 400
REGEXES = [r"[a-z]{1,6}@[a-z]{2,5}\.(com|org|net)", r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-F0-9]{2,8}",
           r"(\+|-)?[1-9][0-9]{0,3}(\.[0-9]{1,2})?"]
# arithmetic expressions, bounded (a random walk through an unbounded repetition need not end)
ARITH = """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def _scalar(rng):
    kind = rng.choice(["integer", "string", "enum", "boolean", "number"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, 3.5, None, True], rng.randint(1, 4))}
    return {"type": "boolean"}


def random_schema(rng, depth=0):
    """Objects (required and optional keys), arrays (bounded), enums, nested, bounded numbers and strings."""
    kind = rng.choice(["object", "array", "scalar"] if depth < 2 else ["scalar"])
    if kind == "scalar":
        return _scalar(rng)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    names = rng.sample(["id", "name", "tags", "score", "ok", "meta", "kind"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False}


SCHEMAS = [random_schema(random.Random(s)) for s in range(8)]


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20, seed=0)


def _prompts(llm, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = 500  # ordinary tokens of the tiny tokenizer
    return [[0] + torch.randint(7, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _json_ok(text, schema):
    jsonschema.validate(json.loads(text), schema)


def _arith_ok(text):
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div))
               for n in ast.walk(tree)), text


def _check_all(outs, check):
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            check(c.text)


class Modes:
    """The property tests' engines: plain; thinking (prompts open a <think> block; </think> nudged so the
    random model closes it soon; the grammar applies after it); speculative (prompt lookup, k = 3)."""

    def __init__(self, ckpt):
        self.ckpt, self.engines = ckpt, {}

    def get(self, mode):
        if mode not in self.engines:
            spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2} if mode == "speculative" else None
            llm = LLM(str(self.ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20, seed=0, speculative_config=spec)
            if mode == "thinking":
                end, compute = llm.detokenizer.tok.token_to_id("</think>"), llm.model.compute_logits

                def nudged(h):  # random weights would think ~vocab tokens long
                    logits = compute(h)
                    logits[..., end] += 6.0
                    return logits
                llm.model.compute_logits = nudged
            self.engines[mode] = llm
        return self.engines[mode]


@pytest.fixture(scope="module")
def modes(ckpt):
    return Modes(ckpt)


@pytest.fixture(params=["plain", "thinking", "speculative"])
def run(request, modes):
    """run(prompts, params) -> [(finish_reason, answer text)] of every completion; with thinking, the
    answer is the text after the completion's </think> (which it must contain)."""
    mode = request.param
    llm = modes.get(mode)
    tok = llm.detokenizer.tok
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")

    def go(prompts, params):
        if mode == "thinking":
            prompts = [p + [think] for p in prompts]
        done = []
        for o in llm.generate(prompts, params, use_tqdm=False):
            for c in o.outputs:
                if mode == "thinking":
                    assert end in c.token_ids, c
                    done.append((c.finish_reason, tok.decode(c.token_ids[c.token_ids.index(end) + 1:],
                                                             skip_special_tokens=True)))
                else:
                    done.append((c.finish_reason, c.text))
        return done
    go.mode = mode
    return go


def _check_answers(answers, check):
    for reason, text in answers:
        assert reason == "stop", (reason, text)
        check(text)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_completion_validates_against_its_json_schema(run, i):
    schema = SCHEMAS[i]
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seq_seed=s, so_args={"schema_type": "json", "schema": schema})
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3))]
    answers = run(_prompts(None, 4, i), params)
    _check_answers(answers, lambda text: _json_ok(text, schema))
    for _, text in answers:  # compact by default: no whitespace outside string literals
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text


def test_json_schema_as_a_string_and_json_object(llm):
    schema = SCHEMAS[0]
    outs = llm.generate(_prompts(llm, 2), [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seq_seed=5, so_args={"schema_type": "json", "schema": json.dumps(schema)}),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, so_args={"schema_type": "json_object"})], use_tqdm=False)
    _json_ok(outs[0].outputs[0].text, schema)
    anything = outs[1].outputs[0]  # any JSON value: unbounded, so a greedy walk may reach max_tokens
    if anything.finish_reason == "stop":
        json.loads(anything.text)
    else:
        assert anything.finish_reason == "length" and anything.text[:1] in '{["-0123456789tfn', anything.text


@pytest.mark.parametrize("pattern", REGEXES)
def test_every_completion_fully_matches_its_regex(run, pattern):
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seq_seed=s, so_args={"schema_type": "regex", "schema": pattern})
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    _check_answers(run(_prompts(None, 3), params), lambda text: re.fullmatch(pattern, text) or pytest.fail(f"{text!r} !~ {pattern}"))


def test_penalties_bias_and_min_tokens_keep_the_grammar(run):
    """vLLM's logits processing on top of the grammar's masks (plain, thinking, speculative): every answer still
    parses, and the penalties change the greedy walk (the expressions' digits repeat without them)."""
    extra = dict(frequency_penalty=1.5, repetition_penalty=1.4, presence_penalty=0.5, min_tokens=2,
                 logit_bias={run_tok: 2.0 for run_tok in range(7, 40)})
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seq_seed=s, so_args={"schema_type": "ebnf", "schema": ARITH},
                             **extra) for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    answers = run(_prompts(None, 3, seed=5), params)
    _check_answers(answers, _arith_ok)
    plain = run(_prompts(None, 1, seed=5), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                          so_args={"schema_type": "ebnf", "schema": ARITH}))
    assert plain[0][1] != answers[0][1]


def test_an_arithmetic_ebnf_always_parses(run):
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seq_seed=s, so_args={"schema_type": "ebnf", "schema": ARITH})
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3))]
    _check_answers(run(_prompts(None, 4), params), _arith_ok)


def test_n_siblings_chunked_prefill_and_preemption_stay_valid(ckpt):
    """A small cache (two request slots, a quarter of the compressed-entry pools left), a 16-token budget:
    5 prompts of up to 45 tokens, n = 2, outputs of ~40-60 tokens; running requests get preempted and
    recompute, the grammar state stays with their outputs."""
    spec = cache_spec(read_model_config(ckpt), "float32", 4)
    per_token = sum(b / (4 * m) for m, b in spec.block_bytes.items())
    small = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4,
                kv_cache_memory=3 * spec.slot_bytes + int(300 * per_token) + 1, max_num_seqs=3,
                max_num_batched_tokens=16, max_model_len=200, seed=0)
    kv = small.scheduler.kv  # three quarters of every pool away: the running requests outgrow the rest
    for m, free in kv.free_blocks.items():
        for _ in range(3 * len(free) // 4):
            free.pop()
            kv.num_blocks[m] -= 1
    schema = {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 8}, "minItems": 6, "maxItems": 8}
    long_prompts = [(p * 6)[:45] for p in _prompts(small, 5, 7)]
    sp = SamplingParams(temperature=1.0, max_tokens=150, n=2, so_args={"schema_type": "json", "schema": schema})
    outs = small.generate(long_prompts, sp, use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    _check_all(outs, lambda text: _json_ok(text, schema))
    assert small.get_metrics()["num_preemptions"] > 0 and small.scheduler.kv.all_free()


def test_dspark_drafts_are_checked_against_the_grammar(ckpt41, monkeypatch):
    from deepinfer.engine.scheduler import Scheduler

    checked = []  # (drafts proposed, drafts the grammar kept) per call
    prefix = Scheduler._grammar_prefix

    def recording(req, drafts):
        kept = prefix(req, drafts)
        if req.grammar is not None and drafts:
            checked.append((len(drafts), len(kept)))
        return kept

    monkeypatch.setattr(Scheduler, "_grammar_prefix", staticmethod(recording))
    llm = LLM(str(ckpt41), device="cpu", dtype="float32", kv_cache_memory=64 << 20, seed=0, num_speculative_tokens=3)
    pattern = REGEXES[0]
    outs = llm.generate(_prompts(llm, 2), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                          so_args={"schema_type": "regex", "schema": pattern}), use_tqdm=False)
    _check_all(outs, lambda text: re.fullmatch(pattern, text) or pytest.fail(text))
    # the random-weight draft stages propose tokens the grammar refuses: some drafts were cut, and some
    # survived to be verified
    assert checked and any(kept < n for n, kept in checked), checked
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_greedy_constrained_tokens_do_not_depend_on_speculation(ckpt):
    schema = SCHEMAS[3]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, so_args={"schema_type": "json", "schema": schema})
    prompts = _prompts(None, 3, 11)
    off = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20).generate(prompts, sp, use_tqdm=False)
    on = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_seeded_constrained_request_is_batch_invariant(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20, batch_invariant=True)
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seq_seed=42, so_args={"schema_type": "json", "schema": SCHEMAS[4]})
    target = _prompts(llm, 1, 3)[0]
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    free = SamplingParams(temperature=1.0, max_tokens=20)
    mixed = llm.generate(_prompts(llm, 2, 4) + [target], [free, free, sp], use_tqdm=False)[2].outputs[0].token_ids
    assert mixed == alone


def test_max_tokens_cut_is_length_and_stop_strings_still_apply(llm):
    cut = llm.generate(_prompts(llm, 1), SamplingParams(temperature=0.0, max_tokens=2,
                                                        so_args={"schema_type": "json", "schema": SCHEMAS[0]}), use_tqdm=False)
    assert cut[0].outputs[0].finish_reason == "length"
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3}
    out = llm.generate(_prompts(llm, 1), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[","],
                                                        so_args={"schema_type": "json", "schema": schema}), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and re.fullmatch(r"\[\d", c.text), c.text  # cut at the first ","


def test_logprobs_are_of_the_constrained_distribution(llm):
    out = llm.generate(_prompts(llm, 1), SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, logprobs=5, seq_seed=3,
                                                        so_args={"schema_type": "regex", "schema": r"(yes|no)"}), use_tqdm=False)
    c = out[0].outputs[0]
    tok = llm.detokenizer.tok
    starts = {"y", "ye", "yes", "n", "no"}
    first = {t: lp for t, lp in c.logprobs[0].items() if lp > float("-inf")}
    assert first and all(tok.decode([t]) in starts for t in first), {tok.decode([t]): lp for t, lp in first.items()}
    # the allowed first tokens are few: the listed ones carry (nearly) all the probability
    assert sum(torch.tensor(list(first.values())).exp().tolist()) > 0.99


@pytest.mark.parametrize("so_args, field", [
    ({"schema_type": "xml", "schema": "x"}, "so_args.schema_type"),
    ({"schema_type": "json", "schema": {"type": "nonsense"}}, "so_args.schema"),
    ({"schema_type": "json", "schema": "{not json"}, "so_args.schema"),
    ({"schema_type": "regex", "schema": "(unclosed"}, "so_args.schema"),
    ({"schema_type": "ebnf", "schema": "root ::= missing_rule"}, "so_args.schema"),
    ({"schema_type": "regex"}, "so_args.schema"),
    ({"schema_type": "json", "schema": {}, "colour": 1}, "so_args"),
])
def test_bad_structured_output_arguments_are_named_and_nothing_runs(llm, so_args, field):
    ok = SamplingParams(max_tokens=2)
    before = llm.engine.has_unfinished()
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(_prompts(llm, 2), [ok, SamplingParams(so_args=so_args)], use_tqdm=False)
    assert llm.engine.has_unfinished() == before is False
    assert llm.generate(_prompts(llm, 1), ok, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_structured_outputs_need_the_tokenizer(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="so_args.*tokenizer"):
        llm.generate([[0, 9, 10]], SamplingParams(so_args={"schema_type": "regex", "schema": "a"}), use_tqdm=False)


def test_async_steps_defer_only_the_constrained_sampling(ckpt):
    """Async scheduling keeps running with constrained requests: the next step's forward is launched
    ahead and only its sampling waits for the grammar to take the token in flight. Same tokens as
    synchronous steps (seeded and greedy), and deferred steps were taken."""
    schema = {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 8}, "minItems": 6, "maxItems": 8}
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, so_args={"schema_type": "json", "schema": schema}),
              SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seq_seed=9, so_args={"schema_type": "json", "schema": schema}),
              SamplingParams(temperature=1.0, max_tokens=30, seq_seed=4)]
    prompts = _prompts(None, 3, 21)
    runs, deferred = {}, []
    for mode in (False, True):
        llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20, async_scheduling=mode)
        complete = llm.engine.core.runner.complete

        def counted(h, complete=complete):
            deferred.append(h.deferred is not None)
            return complete(h)
        llm.engine.core.runner.complete = counted
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]
    assert sum(deferred) > 10
    _json_ok(LLM_TEXT(ckpt, runs[True][0]), schema)


def LLM_TEXT(ckpt, ids):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(ckpt / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def test_a_grammar_that_fails_to_compile_aborts_its_request_alone(ckpt, monkeypatch):
    from deepinfer.llm import GenerationError
    from deepinfer.structured import backend as be

    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20)
    real = be.GrammarBackend.request_grammar

    def failing(self, key, ids):
        g = real(self, key, ids)
        g.fails = key.schema_type == "regex"
        return g
    monkeypatch.setattr(be.GrammarBackend, "request_grammar", failing)
    monkeypatch.setattr(be.RequestGrammar, "error", property(
        lambda g: "so_args.schema: no token can start it" if g.ready() and g.fails else None))
    free = SamplingParams(temperature=0.0, max_tokens=5)
    with pytest.raises(GenerationError) as e:
        llm.generate(_prompts(None, 3), [SamplingParams(so_args={"schema_type": "regex", "schema": "a+"}), free,
                                         SamplingParams(max_tokens=200, so_args={"schema_type": "json", "schema": SCHEMAS[0]})],
                     use_tqdm=False)
    (i, c), = e.value.failed
    assert i == 0 and c.finish_reason == "abort" and "no token can start it" in c.error
    outs = e.value.outputs
    assert outs[1].outputs[0].finish_reason == "length" and outs[2].outputs[0].finish_reason == "stop"
    assert llm.scheduler.kv.all_free()
