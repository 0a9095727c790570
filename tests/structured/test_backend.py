"""Structured outputs on xgrammar: so_args parsing, the compile cache, and the property that sampling
uniformly among the tokens a mask allows, until the grammar terminates, always yields a valid
completion (JSON that validates against its schema, a full regex match, a parsing expression) on the
tiny byte-level tokenizer, whose model vocab is wider than the tokenizer."""
from __future__ import annotations

import ast
import json
import re
import sys
import time

import numpy as np
import pytest
import torch

from deepinfer.structured import GrammarKey, parse_so_args

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from deepinfer.structured import GrammarBackend  # noqa: E402
from deepinfer.tools.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer  # noqa: E402

TOK_VOCAB = 720    # the trained BPE has 686: the rest is <｜tok_N｜> padding (special) tokens
MODEL_VOCAB = 740  # logits width: ids 720..739 exist for the model only
W = (MODEL_VOCAB + 31) // 32
EOS = 1
THINK, END_THINK = SPECIAL_TOKENS.index("<think>"), SPECIAL_TOKENS.index("</think>")


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    tok = build_tokenizer(TOK_VOCAB)
    return write_tokenizer(tmp_path_factory.mktemp("tok"), TOK_VOCAB, tokenizer=tok), tok


@pytest.fixture(scope="module")
def backend(tok_path):
    be = GrammarBackend(tok_path[0], MODEL_VOCAB, [EOS])
    yield be
    be.close()


@pytest.fixture(scope="module")
def tok(tok_path):
    return tok_path[1]


@pytest.fixture(scope="module")
def forbidden(tok):
    """Ids a grammar may never allow: special tokens other than EOS, ids past the tokenizer."""
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special} - {EOS}
    assert len(special) >= len(SPECIAL_TOKENS)  # padding tokens are there too
    return np.array(sorted(special | set(range(TOK_VOCAB, MODEL_VOCAB))))


def allowed(mask: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(np.asarray(mask).view(np.uint8), bitorder="little")[:MODEL_VOCAB])[0]


def ready(backend, so_args, prompt=(0, 3, 4)):
    rg = backend.request_grammar(backend.validate(so_args), list(prompt))
    deadline = time.time() + 60
    while not rg.ready():
        assert time.time() < deadline
        time.sleep(0.002)
    return rg


def sample(rg, rng, forbidden, max_steps=400, masks=None):
    """Uniform over the allowed tokens until terminated: the token ids (EOS included if sampled)."""
    out, mask = [], np.zeros(W, dtype=np.int32)
    while not rg.terminated:
        assert len(out) < max_steps, "the grammar did not terminate"
        rg.fill_bitmask(mask)
        if masks is not None:
            masks.append(mask.copy())
        ok = allowed(mask)
        if not rg.in_reasoning:
            assert not np.isin(ok, forbidden).any(), "a special / padding id is allowed"
        t = int(rng.choice(ok))
        assert rg.accept(t)
        out.append(t)
    return out


def text_of(tok, ids):
    assert EOS not in ids[:-1]
    return tok.decode([i for i in ids if i != EOS], skip_special_tokens=False)


def whitespace_outside_strings(text: str) -> bool:
    in_str = esc = False
    for c in text:
        if in_str:
            esc, in_str = (not esc and c == "\\"), in_str if (esc or c != '"') else False
        elif c == '"':
            in_str = True
        elif c.isspace():
            return True
    return False


# ---- so_args parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("so_args, field", [
    ([1], "so_args must be a dict"),
    ({"schema_type": "json", "schema": {}, "grammar": 1}, "so_args: unknown keys ['grammar']"),
    ({"schema": "a"}, "so_args.schema_type"),
    ({"schema_type": "yaml", "schema": "a"}, "so_args.schema_type"),
    ({"schema_type": "json"}, "so_args.schema"),
    ({"schema_type": "json", "schema": "{not json"}, "so_args.schema"),
    ({"schema_type": "json", "schema": [1, 2]}, "so_args.schema"),
    ({"schema_type": "regex", "schema": ""}, "so_args.schema"),
    ({"schema_type": "ebnf", "schema": {"a": 1}}, "so_args.schema"),
    ({"schema_type": "json_object", "schema": {}}, "so_args.schema"),
    ({"schema_type": "json", "schema": {}, "any_whitespace": 1}, "so_args.any_whitespace"),
    ({"schema_type": "regex", "schema": "a", "any_whitespace": True}, "so_args.any_whitespace"),
])
def test_parse_so_args_errors_name_the_field(so_args, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        parse_so_args(so_args)


def test_parse_so_args_canonical_keys():
    a = parse_so_args({"schema_type": "json", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}})
    b = parse_so_args({"schema_type": "json", "schema": '{ "type": "object",\n "properties": {"x": {"type": "integer"}} }'})
    assert a == b == GrammarKey("json", '{"type":"object","properties":{"x":{"type":"integer"}}}', False)
    assert parse_so_args({"schema_type": "json_object", "any_whitespace": True}) == GrammarKey("json_object", "", True)
    assert parse_so_args({"schema_type": "regex", "schema": "a+"}) == GrammarKey("regex", "a+", False)


def test_without_xgrammar_the_error_names_so_args_and_the_package(monkeypatch, tok_path):
    import subprocess
    code = ("import sys\nsys.modules['xgrammar'] = None\nimport deepinfer, deepinfer.structured as s\n"
            "assert s.parse_so_args({'schema_type': 'json_object'}).schema_type == 'json_object'\n"
            "assert 'transformers' not in sys.modules\nprint('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    parse_so_args({"schema_type": "regex", "schema": "a"})  # needs no xgrammar
    with pytest.raises(ImportError, match="so_args.*xgrammar"):
        GrammarBackend(tok_path[0], MODEL_VOCAB, [EOS])


@pytest.mark.parametrize("so_args, message", [
    ({"schema_type": "json", "schema": {"type": "foo"}}, "foo"),
    ({"schema_type": "regex", "schema": "a(b"}, "parenthesis"),
    ({"schema_type": "ebnf", "schema": "root ::= foo"}, "foo"),
    ({"schema_type": "ebnf", "schema": "root ::= \"a"}, "line 1"),
])
def test_invalid_grammars_raise_at_validation(backend, so_args, message):
    with pytest.raises(ValueError, match=f"so_args.schema.*{message}"):
        backend.validate(so_args)


def test_compile_cache_is_keyed_by_grammar_key(backend):
    so = {"schema_type": "regex", "schema": "cache(d|e)[0-9]"}
    before = backend.compiles
    a = ready(backend, so)
    b = ready(backend, dict(so))
    assert backend.compiles == before + 1
    ready(backend, {"schema_type": "regex", "schema": "cache(d|e)[0-8]"})
    assert backend.compiles == before + 2
    m1, m2 = np.zeros(W, np.int32), np.zeros(W, np.int32)
    a.fill_bitmask(m1)
    b.fill_bitmask(m2)
    assert np.array_equal(m1, m2) and m1.any()


def test_a_grammar_the_vocab_cannot_start_fails_the_request(tok_path):
    be = GrammarBackend(tok_path[0], 40, [EOS])  # a model that only has the first 40 ids
    try:
        rg = ready(be, {"schema_type": "regex", "schema": "zzz"})
        assert rg.error is not None and rg.error.startswith("so_args.schema")
        assert ready(be, {"schema_type": "regex", "schema": "!+"}).error is None
    finally:
        be.close()


# ---- completions are valid -------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 3}},
     "required": ["color"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "tags": {
            "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["x", "tags"]}},
     "required": ["point"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"const": 7}}, "required": ["k"]},
     "minItems": 1, "maxItems": 2},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_sampled_json_validates(backend, tok, forbidden, schema):
    rng = np.random.default_rng(0)
    rg = ready(backend, {"schema_type": "json", "schema": schema})
    for _ in range(30):
        r = rg.fork()
        text = text_of(tok, sample(r, rng, forbidden))
        jsonschema.validate(json.loads(text), schema)
        assert not whitespace_outside_strings(text), text


def test_json_object_any_object_and_property_order(backend, tok, forbidden):
    rng = np.random.default_rng(1)
    rg = ready(backend, {"schema_type": "json_object"})
    for _ in range(10):
        text = text_of(tok, sample(rg.fork(), rng, forbidden, max_steps=2000))
        assert isinstance(json.loads(text), dict), text
        assert not whitespace_outside_strings(text), text
    schema = {"type": "object", "properties": {"z": {"const": 1}, "a": {"const": 2}}, "required": ["z", "a"]}
    assert text_of(tok, sample(ready(backend, {"schema_type": "json", "schema": schema}), rng, forbidden)) == '{"z":1,"a":2}'


@pytest.mark.parametrize("any_ws", [False, True])
def test_json_object_starts_at_its_brace_and_ends_only_at_its_close(backend, tok, any_ws):
    """No leading whitespace, no other JSON value, no stop token before the object is closed."""
    rg = ready(backend, {"schema_type": "json_object", "any_whitespace": any_ws})
    mask = np.zeros(W, np.int32)
    rg.fill_bitmask(mask)
    first = allowed(mask)
    assert len(first) and all(tok.decode([t]).startswith("{") for t in first), tok.decode(list(first))
    for t in tok.encode('{"a":[1').ids:
        assert not rg.terminated and rg.accept(t)
        rg.fill_bitmask(mask)
        assert EOS not in allowed(mask)
    for t in tok.encode(']}').ids:
        assert rg.accept(t)
    assert rg.terminated


def test_any_whitespace_allows_whitespace_compact_does_not(backend, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9, "minimum": 0}}, "required": ["a"]}
    space = {i for i in range(TOK_VOCAB) if tok.decode([i]).isspace()} | {tok.token_to_id("Ġ")}
    for any_ws in (False, True):
        rg = ready(backend, {"schema_type": "json", "schema": schema, "any_whitespace": any_ws})
        mask, seen = np.zeros(W, np.int32), False
        for t in tok.encode('{"a":').ids:
            rg.fill_bitmask(mask)
            seen |= bool(np.isin(allowed(mask), list(space)).any())
            assert rg.accept(t)
        rg.fill_bitmask(mask)
        seen |= bool(np.isin(allowed(mask), list(space)).any())
        assert seen == any_ws


@pytest.mark.parametrize("regex", [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[a-z]{1,8}@[a-z]{1,5}\.(com|org)",
                                   r"(ab)+|x", r"[A-Z][a-z ]{0,10}\."])
def test_sampled_text_fully_matches_the_regex(backend, tok, forbidden, regex):
    rng = np.random.default_rng(2)
    rg = ready(backend, {"schema_type": "regex", "schema": regex})
    for _ in range(30):
        text = text_of(tok, sample(rg.fork(), rng, forbidden))
        assert re.fullmatch(regex, text), (regex, text)


ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= "0" | [1-9] [0-9]?
"""


def _arith_ok(node) -> bool:
    if isinstance(node, ast.Expression):
        return _arith_ok(node.body)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)) and _arith_ok(node.left) and _arith_ok(node.right)
    return isinstance(node, ast.Constant) and type(node.value) is int


def test_sampled_arithmetic_expressions_parse(backend, tok, forbidden):
    rng = np.random.default_rng(3)
    rg = ready(backend, {"schema_type": "ebnf", "schema": ARITH})
    for _ in range(15):
        text = text_of(tok, sample(rg.fork(), rng, forbidden, max_steps=2000))
        assert _arith_ok(ast.parse(text, mode="eval")), text


def _byte_token(backend, b: bytes) -> int:
    return backend.tokenizer_info.decoded_vocab.index(b)


@pytest.mark.parametrize("so_args, prefix", [
    ({"schema_type": "json", "schema": {"type": "string", "maxLength": 4}}, b'"'),
    ({"schema_type": "json", "schema": {"type": "string"}}, b'"'),
    ({"schema_type": "json_object"}, b'{"'),
    ({"schema_type": "regex", "schema": "a.b"}, b"a"),
    ({"schema_type": "regex", "schema": "a[^b]c"}, b"a"),
    ({"schema_type": "regex", "schema": r"a[\s\S]c"}, b"a"),
])
def test_no_control_characters_in_json_strings_no_surrogates_anywhere(backend, so_args, prefix):
    rg = ready(backend, so_args)
    for b in prefix:
        assert rg.accept(_byte_token(backend, bytes([b])))
    if so_args["schema_type"] != "regex":
        assert not rg.accept(_byte_token(backend, b"\x10"))
    if so_args.get("schema") == "a.b":  # as in Python's and ECMA-262's regexes, `.` is no line break
        assert not rg.accept(_byte_token(backend, b"\n"))
    assert rg.accept(_byte_token(backend, b"\xed"))  # U+D000..U+D7FF start so
    assert not rg.accept(_byte_token(backend, b"\xb9"))  # U+DE40..: a surrogate
    assert rg.accept(_byte_token(backend, b"\x80"))


# ---- termination, reasoning, speculation -----------------------------------------------------

def test_terminated_after_the_grammar_forces_the_end_or_eos(backend, tok):
    rg = ready(backend, {"schema_type": "regex", "schema": "ab|a"})
    assert rg.accept(tok.token_to_id("a")) and not rg.terminated  # b may follow: EOS is a choice
    mask = np.zeros(W, np.int32)
    rg.fill_bitmask(mask)
    assert set(allowed(mask)) == {EOS, tok.token_to_id("b")}
    forced = rg.fork()
    assert forced.accept(tok.token_to_id("b")) and forced.terminated  # nothing can follow
    forced.fill_bitmask(mask)
    assert list(allowed(mask)) == [EOS]
    assert not rg.accept(tok.token_to_id("c"))
    assert rg.accept(EOS) and rg.terminated
    rg.fill_bitmask(mask)
    assert list(allowed(mask)) == [EOS]
    assert not rg.accept(tok.token_to_id("b"))


def test_reasoning_is_free_until_end_of_think(backend, tok, forbidden):
    schema = SCHEMAS[0]
    so = {"schema_type": "json", "schema": schema}
    start = np.zeros(W, np.int32)
    ready(backend, so).fill_bitmask(start)
    # the prompt closed its thinking block, or never opened one: constrained from the start
    for prompt in ([0, 3, THINK, 9, END_THINK, 4], [0, 3, 4]):
        m = np.zeros(W, np.int32)
        ready(backend, so, prompt).fill_bitmask(m)
        assert np.array_equal(m, start)
    rng = np.random.default_rng(4)
    for prompt in ([0, 3, 4, THINK], [0, THINK, 9, END_THINK, THINK, 12], [0, 3, 4, THINK], [THINK]):
        rg = ready(backend, so, prompt)
        thought = [int(t) for t in rng.integers(7, TOK_VOCAB, 5)] + [THINK, EOS]
        m = np.zeros(W, np.int32)
        for t in thought:
            rg.fill_bitmask(m)
            assert (m == -1).all() and not rg.terminated and rg.in_reasoning
            assert rg.accept(t)
        assert rg.accept(END_THINK) and not rg.in_reasoning
        rg.fill_bitmask(m)
        assert np.array_equal(m, start)
        body = sample(rg, rng, forbidden)
        jsonschema.validate(json.loads(text_of(tok, body)), schema)
        rg.rollback(len(body) + 1)  # back across </think>: free again
        assert rg.in_reasoning
        rg.fill_bitmask(m)
        assert (m == -1).all()
        assert rg.accept(END_THINK) and rg.valid_prefix(body) == len(body)


def test_speculation_helpers_match_step_by_step(backend, tok, forbidden):
    so = {"schema_type": "json", "schema": SCHEMAS[3]}
    rng = np.random.default_rng(5)
    for prompt, lead in (([0, 4], []), ([0, 4, THINK], [9, 10, END_THINK])):
        rg = ready(backend, so, prompt)
        masks = []
        for t in lead:
            masks.append(np.full(W, -1, np.int32))
            assert rg.accept(t)
        tokens = lead + sample(rg, rng, forbidden, masks=masks)
        masks.append(np.array([0] * (EOS // 32) + [1 << EOS] + [0] * (W - 1 - EOS // 32), np.int32))
        fresh = ready(backend, so, prompt)
        rows = np.zeros((len(tokens) + 1, W), np.int32)
        fresh.fill_bitmasks_along(tokens, rows)
        assert np.array_equal(rows, np.stack(masks))
        along = torch.zeros(len(tokens) + 1, W, dtype=torch.int32)  # CPU torch rows work too
        fresh.fill_bitmasks_along(tokens, along)
        assert np.array_equal(along.numpy(), rows)
        # state unchanged: the first mask again, all tokens accepted in order
        assert fresh.valid_prefix(tokens) == len(tokens)
        k = len(tokens) // 2
        bad = int(next(t for t in range(7, TOK_VOCAB) if not (masks[k][t // 32] >> (t % 32)) & 1))
        assert fresh.valid_prefix(tokens[:k] + [bad] + tokens[k:]) == k
        with pytest.raises(ValueError, match="not accepted"):
            fresh.fill_bitmasks_along(tokens[:k] + [bad], np.zeros((k + 2, W), np.int32))
        m = np.zeros(W, np.int32)
        fresh.fill_bitmask(m)
        assert np.array_equal(m, masks[0])
        for t in tokens:
            assert fresh.accept(t)
        assert fresh.terminated
        for n in (1, 4, len(tokens) - 5):
            fresh.rollback(n)
            pos = len(tokens) - n
            fresh.fill_bitmask(m)
            assert np.array_equal(m, masks[pos]), pos
            for t in tokens[pos:]:
                assert fresh.accept(t)
        with pytest.raises(ValueError, match="rollback"):
            fresh.rollback(len(tokens) + 1)


def test_fork_is_independent(backend, tok):
    rg = ready(backend, {"schema_type": "regex", "schema": "(a|b)c(d|e)"})
    assert rg.accept(tok.token_to_id("a"))
    other = rg.fork()
    assert other.accept(tok.token_to_id("c")) and other.accept(tok.token_to_id("d")) and other.terminated
    assert not rg.terminated and not rg.accept(tok.token_to_id("d"))
    assert rg.accept(tok.token_to_id("c")) and rg.accept(tok.token_to_id("e")) and rg.terminated
    other.rollback(2)
    assert other.accept(tok.token_to_id("c")) and not other.accept(tok.token_to_id("c"))


def test_fill_bitmasks_batch_equals_one_by_one(backend, forbidden):
    rng = np.random.default_rng(6)
    grammars = []
    for i, so in enumerate([{"schema_type": "json", "schema": SCHEMAS[i % len(SCHEMAS)]} for i in range(6)]
                           + [{"schema_type": "regex", "schema": "ab|a"}]):
        rg = ready(backend, so, [0, THINK] if i == 2 else [0])
        for _ in range(int(rng.integers(0, 4))):  # a few steps in: distinct states
            m = np.zeros(W, np.int32)
            rg.fill_bitmask(m)
            assert rg.accept(int(rng.choice(allowed(m))))
        grammars.append(rg)
    done = ready(backend, {"schema_type": "regex", "schema": "a"})
    assert done.accept(int(backend.tokenizer_info.decoded_vocab.index(b"a"))) and done.accept(EOS)
    grammars.append(done)  # terminated: only EOS
    rows = [int(r) for r in rng.permutation(12)[:len(grammars)]]
    for out in (np.zeros((12, W), np.int32), torch.zeros(12, W, dtype=torch.int32)):
        backend.fill_bitmasks(grammars, out, rows)
        out = np.asarray(out)
        for rg, r in zip(grammars, rows):
            want = np.zeros(W, np.int32)
            rg.fill_bitmask(want)
            assert np.array_equal(out[r], want), r
        assert not np.delete(out, rows, axis=0).any()


# ---- output prefixes (an assistant message continued) -----------------------------------------

def _ready_with_prefix(backend, so_args, prompt, k):
    """As the engine starts a request whose prompt's last k tokens begin its output."""
    cut = len(prompt) - k
    rg = backend.request_grammar(backend.validate(so_args), list(prompt[:cut]))
    rg.begin_with(prompt[cut:])
    deadline = time.time() + 60
    while not rg.ready():
        assert time.time() < deadline
        time.sleep(0.002)
    return rg


def test_output_prefix_advances_the_grammar(backend, tok, forbidden):
    """The prompt's last k tokens begin the output: the grammar starts after them, every completion of the
    prefix validates, and the prefix is never rolled back."""
    schema = SCHEMAS[0]
    so = {"schema_type": "json", "schema": schema}
    head = tok.encode('{"', add_special_tokens=False).ids
    prompt = [0, 3, 4] + head
    rg = _ready_with_prefix(backend, so, prompt, len(head))
    assert rg.error is None
    backend.check_prefix(backend.validate(so), prompt, len(head))  # accepted at submission too
    fresh, m, m0 = ready(backend, so, prompt[:3]), np.zeros(W, np.int32), np.zeros(W, np.int32)
    for t in head:
        assert fresh.accept(t)
    fresh.fill_bitmask(m0)
    rg.fill_bitmask(m)
    assert np.array_equal(m, m0)  # the state after accepting the prefix as output
    rng = np.random.default_rng(8)
    for _ in range(3):
        one = rg.fork()
        body = sample(one, rng, forbidden)
        jsonschema.validate(json.loads(text_of(tok, head + body)), schema)
        with pytest.raises(ValueError, match="rollback"):
            one.rollback(len(body) + 1)
    with pytest.raises(ValueError, match="begin_with: only once"):
        rg.begin_with(head)
    # without the prefix, the grammar would start from `{` again
    plain = ready(backend, so, prompt)
    assert plain.valid_prefix(tok.encode('"', add_special_tokens=False).ids) == 0


@pytest.mark.parametrize("so_args, text, shown", [
    ({"schema_type": "json", "schema": SCHEMAS[0]}, '{"zz', '{"'),
    ({"schema_type": "json", "schema": SCHEMAS[0]}, '{ "', '{'),  # compact JSON
    ({"schema_type": "regex", "schema": "(red|green)-[0-9]"}, "gree-", "gree"),
])
def test_a_prefix_the_grammar_refuses_is_named_at_submission(backend, tok, so_args, text, shown):
    ids = tok.encode(text, add_special_tokens=False).ids
    key = backend.validate(so_args)
    with pytest.raises(ValueError, match=r"^so_prefix_tokens: the output prefix is not a valid start") as e:
        backend.check_prefix(key, [0, 3] + ids, len(ids))
    assert repr(shown) in str(e.value)
    rg = _ready_with_prefix(backend, so_args, [0, 3] + ids, len(ids))  # the engine's own check agrees
    assert rg.error is not None and rg.error.startswith("so_prefix_tokens")
    with pytest.raises(ValueError, match="so_prefix_tokens"):
        rg.fill_bitmask(np.zeros(W, np.int32))


def test_a_special_token_in_the_prefix_is_refused(backend, tok):
    key = backend.validate({"schema_type": "regex", "schema": ".*"})
    with pytest.raises(ValueError, match="so_prefix_tokens"):
        backend.check_prefix(key, [0, 3, EOS], 1)
    with pytest.raises(ValueError, match=r"so_prefix_tokens 4 is not in \[0, 3\]"):
        backend.check_prefix(key, [0, 3, 5], 4)


def test_output_prefix_with_reasoning(backend, tok, forbidden):
    """Thinking: a prefix inside the reasoning leaves the grammar at its start (even text the grammar would
    refuse); one that closes it with </think> advances the grammar over what follows."""
    schema = SCHEMAS[0]
    so = {"schema_type": "json", "schema": schema}
    key = backend.validate(so)
    start = np.zeros(W, np.int32)
    ready(backend, so).fill_bitmask(start)
    thought = tok.encode("}}not json", add_special_tokens=False).ids
    inside = [0, 3, THINK] + thought
    backend.check_prefix(key, inside, len(thought))
    rg = _ready_with_prefix(backend, so, inside, len(thought))
    m = np.zeros(W, np.int32)
    rg.fill_bitmask(m)
    assert rg.in_reasoning and (m == -1).all() and rg.error is None
    assert rg.accept(END_THINK)
    rg.fill_bitmask(m)
    assert np.array_equal(m, start)
    # the prefix closes the reasoning, then begins the answer: the grammar is past `{"`
    head = tok.encode('{"', add_special_tokens=False).ids
    closed = [0, 3, THINK] + thought + [END_THINK] + head
    for k in (len(head), len(head) + 1 + len(thought)):  # cut after </think>, or after <think>
        backend.check_prefix(key, closed, k)
        rg = _ready_with_prefix(backend, so, closed, k)
        assert not rg.in_reasoning and rg.error is None
        body = sample(rg, np.random.default_rng(k), forbidden)
        jsonschema.validate(json.loads(text_of(tok, head + body)), schema)
        with pytest.raises(ValueError, match="rollback"):
            rg.rollback(len(body) + 1)  # neither the prefix nor its </think> can be undone
    bad = [0, 3, THINK] + thought + [END_THINK] + tok.encode("}", add_special_tokens=False).ids
    with pytest.raises(ValueError, match="so_prefix_tokens"):
        backend.check_prefix(key, bad, len(thought) + 2)


def test_so_prefix_tokens_is_checked():
    from deepinfer.sampling_params import SamplingParams
    so = {"schema_type": "regex", "schema": "a"}
    assert SamplingParams(so_args=so, so_prefix_tokens=3).so_prefix_tokens == 3
    for bad, msg in (({"so_prefix_tokens": -1, "so_args": so}, "must be an integer >= 0"),
                     ({"so_prefix_tokens": True, "so_args": so}, "must be an integer >= 0"),
                     ({"so_prefix_tokens": 2}, "applies to structured outputs only")):
        with pytest.raises(ValueError, match=f"^SamplingParams.so_prefix_tokens {msg}"):
            SamplingParams(**bad)
