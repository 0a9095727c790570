"""Chat prefix completion (`{"role": "assistant", "content": ..., "prefix": true}` last) with a constraint: the
constraint applies to the whole assistant message, so the grammar starts as after the prefix and the
continuation completes it; a prefix the grammar refuses is a 400 naming the message, before the engine runs
it. Thinking: a prefix inside the reasoning leaves the grammar at its start; one whose reasoning is closed
(reasoning_content given) advances it over the content. The served tiny model is test_server_structured_thinking's."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from test_server_structured_thinking import SCHEMA, _post, _sse, served  # noqa: F401 - `served` is a fixture

jsonschema = pytest.importorskip("jsonschema")

FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Give me an item as JSON"}]
OFF = {"thinking": {"type": "disabled"}}


def _prefix(content: str, reasoning: str | None = None) -> list[dict]:
    msg = {"role": "assistant", "content": content, "prefix": True}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return ASK + [msg]


def _contents(r) -> list[str]:
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop"] * len(choices), choices
    return [c["message"]["content"] for c in choices]


@pytest.mark.parametrize("head", ['{"name":"', '{"name":"ab","n":', "{"])
def test_json_schema_prefix_is_completed(served, head):
    body = {"messages": _prefix(head), "response_format": FORMAT, "max_tokens": 60, "seed": 2, "temperature": 1.0,
            "n": 2, **OFF}
    contents = _contents(_post(served, body))
    for c in contents:
        jsonschema.validate(json.loads(head + c), SCHEMA)  # the message (prefix + continuation) is the value
    s = _post(served, {**body, "stream": True})
    assert s.status_code == 200, s.text
    streamed = ["", ""]
    for chunk in _sse(s.text):
        for ch in chunk["choices"]:
            streamed[ch["index"]] += ch["delta"].get("content") or ""
    assert streamed == contents  # same seed, same tokens


@pytest.mark.parametrize("head, field", [('{"nam":', "response_format"), ('{"name": "', "response_format"),
                                         ("pink", "structured_outputs")])
def test_a_prefix_the_grammar_refuses_is_400_and_others_run(served, head, field):
    loop, http = served
    so = {"response_format": FORMAT} if field == "response_format" else \
        {"structured_outputs": {"regex": "(red|green|blue)-[0-9]{2}"}}
    bad = {"model": "tiny", "messages": _prefix(head), "max_tokens": 40, **so, **OFF}
    good = {"model": "tiny", "messages": _prefix('{"name":"'), "response_format": FORMAT, "max_tokens": 60,
            "seed": 4, "temperature": 1.0, **OFF}

    async def both(stream: bool):
        return await asyncio.gather(http.post("/v1/chat/completions", json={**bad, "stream": stream}),
                                    http.post("/v1/chat/completions", json=good))
    for stream in (False, True):
        r, ok = loop.run_until_complete(both(stream))
        assert r.status_code == 400, r.text  # streaming too: refused before the stream starts
        err = r.json()["error"]
        assert err["param"] == "messages[1].content", err
        assert err["message"].startswith("messages[1].content: the output prefix is not a valid start")
        assert field in err["message"], err
        jsonschema.validate(json.loads('{"name":"' + _contents(ok)[0]), SCHEMA)


def test_regex_prefix_is_completed(served):
    pattern = r"(red|green|blue)-[0-9]{2}"
    for head in ("gre", "blue-", "red-4"):
        r = _post(served, {"messages": _prefix(head), "structured_outputs": {"regex": pattern}, "n": 2,
                           "max_tokens": 20, "seed": 3, "temperature": 1.0, **OFF})
        for c in _contents(r):
            assert re.fullmatch(pattern, head + c), (head, c)


def test_json_object_prefix(served):
    """recipe refuses response_format json_object with a prefix (as DeepSeek's API does); vLLM's
    structured_outputs json_object continues it."""
    r = _post(served, {"messages": _prefix('{"a":[1,'), "response_format": {"type": "json_object"}, **OFF})
    assert r.status_code == 400 and "prefix" in r.json()["error"]["message"], r.text
    r = _post(served, {"messages": _prefix('{"a":[1,'), "structured_outputs": {"json_object": True},
                       "max_tokens": 60, "seed": 4, "temperature": 1.0, **OFF})
    (c,) = _contents(r)
    assert isinstance(json.loads('{"a":[1,' + c), dict), c
    r = _post(served, {"messages": _prefix("[1,"), "structured_outputs": {"json_object": True}, **OFF})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content", r.text


def test_prefix_after_the_reasoning_advances_the_grammar(served):
    """reasoning_content given: recipe renders <think>reasoning</think>content; the output is the answer's
    continuation (reasoning_content stays empty), the grammar is past the prefix."""
    r = _post(served, {"messages": _prefix('{"name":"', "I will answer }}} now"), "response_format": FORMAT,
                       "max_tokens": 60, "seed": 6, "temperature": 1.0, "n": 2})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert not ch["message"].get("reasoning_content"), ch
        jsonschema.validate(json.loads('{"name":"' + ch["message"]["content"]), SCHEMA)
    r = _post(served, {"messages": _prefix('{"nam":', "thinking"), "response_format": FORMAT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content", r.text


def test_prefix_inside_the_reasoning_leaves_the_grammar_at_its_start(served):
    """Only reasoning_content (text no grammar would accept): the output goes on reasoning, and the answer
    after its </think> is a whole value."""
    r = _post(served, {"messages": _prefix("", "so {\"name\": }} maybe"), "response_format": FORMAT,
                       "max_tokens": 200, "seed": 7, "temperature": 1.0, "n": 2})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "stop" and ch["message"]["reasoning_content"] is not None, ch
        jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)


def test_a_prefix_that_completes_the_value_ends_the_answer(served):
    for thinking in (OFF, {}):
        r = _post(served, {"messages": _prefix('{"name":"a","n":1}', "done" if thinking == {} else None),
                           "response_format": FORMAT, "max_tokens": 20, **thinking})
        assert _contents(r) == [""]
        assert r.json()["usage"]["completion_tokens"] == 1  # only EOS could follow


def test_a_prefix_the_engine_refuses_later_is_400_too():
    """The engine's token-level check (after the compile) names the prefix, as the submission check does."""
    from deepinfer.entrypoints.openai.serving import constraint_error
    e = constraint_error("so_prefix_tokens: the grammar refuses the output prefix's token 0 (id 5) of 3",
                         "response_format", "messages[1].content")
    assert (e.status, e.param) == (400, "messages[1].content") and "token 0" in e.message
