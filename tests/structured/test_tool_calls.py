"""structured/tool_calls.py: the DSML tool-call tag accepts, token for token, the calls block deepseek-recipe itself
renders for an assistant's tool calls (V4 and V4.1 formats, on the trained demo's tokenizer, whose ｜DSML｜ is one
token), and refuses calls that would not parse into valid arguments, a byte-spelled marker and an empty block."""
from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")
recipe = pytest.importorskip("deepseek_recipe")

from deepinfer.entrypoints.openai.tokenizer import ServingTokenizer  # noqa: E402
from deepinfer.structured import GrammarBackend  # noqa: E402
from deepinfer.structured.tool_calls import MARKER, V4, V41, tool_call_tag  # noqa: E402
from deepinfer.tools.demo import resolve_demo  # noqa: E402

EOS = 1
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"filters": {"type": "object", "properties": {"year": {"type": "integer"}}},
                                         "exact": {"type": "boolean"}}, "required": ["filters", "exact"]}}},
]
CALLS = [("get_weather", {"city": "Paris <b> & </div>", "days": 3}),
         ("search", {"filters": {"year": 2024}, "exact": True}), ("get_weather", {"city": "Rome", "unit": "f"})]
VERSIONS = {V41: ("DeepSeek-V4.1-Flash", recipe.DeepseekV41Encoding, "｜DSML｜ calls>"),
            V4: ("DeepSeek-V4-Pro", recipe.DeepseekV4Encoding, "｜DSML｜tool_calls>")}


@pytest.fixture(scope="module")
def demo():
    path = resolve_demo("demo")
    tok = ServingTokenizer.load(path)
    assert tok.dsml_id is not None
    return tok, GrammarBackend(f"{path}/tokenizer.json", 4096, [EOS])


def _rendered_block(tok, fmt: str, calls) -> list[int]:
    """The tokens recipe renders for an assistant turn with `calls`, from after the opened calls block through its
    closing tag (what the model must write once the prompt opened the block)."""
    model, encoding, opener = VERSIONS[fmt]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for i, (n, a) in enumerate(calls)]}]
    msgs += [{"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(len(calls))]
    conv = recipe.ChatCompletionRequest({"model": model, "messages": msgs, "tools": TOOLS,
                                         "thinking": {"type": "disabled"}}).convert(recipe.ConversionOptions())
    text = encoding().render_conversation(conv.conversation).prompt
    start = text.rindex("<" + opener) + len("<" + opener) + 1  # the opener and its newline (the last: the turn's)
    end = text.index("</" + opener, start) + len("</" + opener)
    return tok.hf.encode(text[start:end], add_special_tokens=False).ids


def _matcher(backend, tag):
    key = backend.validate({"schema_type": "structural_tag", "schema": tag})
    return xgr.GrammarMatcher(backend._compile(key).grammar)


def _accepts(backend, tag, ids) -> bool:
    m = _matcher(backend, tag)
    return all(m.accept_token(t) for t in ids) and m.accept_token(EOS) and m.is_terminated()


@pytest.mark.parametrize("fmt", [V41, V4])
def test_the_tag_accepts_what_recipe_renders(demo, fmt):
    tok, backend = demo
    one, several = _rendered_block(tok, fmt, CALLS[:1]), _rendered_block(tok, fmt, CALLS)
    assert tok.dsml_id in one  # the marker is its own token in the rendered text
    assert _accepts(backend, tool_call_tag(TOOLS, fmt, tok.dsml_id), several)
    assert _accepts(backend, tool_call_tag(TOOLS, fmt, tok.dsml_id, parallel=False), one)
    assert not _accepts(backend, tool_call_tag(TOOLS, fmt, tok.dsml_id, parallel=False), several)
    other = V4 if fmt == V41 else V41
    assert not _accepts(backend, tool_call_tag(TOOLS, other, tok.dsml_id), one)


@pytest.mark.parametrize("calls", [
    [("get_weather", {"days": 3})],                        # a required parameter left out
    [("get_weather", {"city": "x", "days": "three"})],     # a value of the wrong type
    [("get_weather", {"city": "x", "unit": "k"})],         # outside the enum
    [("nope", {})],                                        # a tool that was not offered
    [("search", {"filters": {"year": 1}, "exact": True, "more": 1})],  # an undeclared parameter
], ids=["missing", "type", "enum", "tool", "extra"])
def test_calls_that_would_not_validate_are_refused(demo, calls):
    tok, backend = demo
    assert not _accepts(backend, tool_call_tag(TOOLS, V41, tok.dsml_id), _rendered_block(tok, V41, calls)), calls


def test_the_marker_must_be_its_token_and_the_block_must_hold_a_call(demo):
    tok, backend = demo
    ids = _rendered_block(tok, V41, CALLS[:1])
    marker = tok.dsml_id
    spelled = []
    for t in ids:
        spelled += tok.hf.encode("\uff5c", add_special_tokens=False).ids + \
            tok.hf.encode("DSML\uff5c", add_special_tokens=False).ids if t == marker else [t]
    assert marker not in spelled and not _accepts(backend, tool_call_tag(TOOLS, V41, marker), spelled)
    closing = tok.hf.encode("</" + MARKER + " calls>", add_special_tokens=False).ids
    assert not _accepts(backend, tool_call_tag(TOOLS, V41, marker), closing)
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_tag([], V41, marker)
