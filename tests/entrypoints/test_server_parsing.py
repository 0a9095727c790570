"""The server's recipe glue without a server: the tokenizer's special tokens, and engine deltas -> chat
chunks (reasoning, content, DSML tool calls, logprobs, EOS) through deepseek-recipe's stream processor."""
from __future__ import annotations

import json

import deepseek_recipe as recipe
import pytest

from deepinfer.entrypoints.openai.engine_client import Delta
from deepinfer.entrypoints.openai.protocol import APIError
from deepinfer.entrypoints.openai.serving import constraint_error
from deepinfer.entrypoints.openai.serving_recipe import CHAT, SampleParser
from deepinfer.entrypoints.openai.tokenizer import ServingTokenizer, complete_specials, special_spellings
from deepinfer.tools.tiny_tokenizer import EOS, build_tokenizer, write_tokenizer

VOCAB = 1024
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, VOCAB)
    return ServingTokenizer.load(d)


def test_missing_special_tokens_take_padding_entries():
    spec = json.loads(build_tokenizer(VOCAB).to_str())
    fixed, added = complete_specials(spec)
    contents = {a["content"]: a["id"] for a in fixed["added_tokens"]}
    assert added and all(s in contents for s in special_spellings())
    assert sorted(contents.values()) == sorted(a["id"] for a in spec["added_tokens"])  # same ids, same vocab size
    assert contents[EOS] == 1
    assert complete_specials(fixed)[1] == []
    no_pads = {**spec, "added_tokens": [a for a in spec["added_tokens"] if "tok_" not in a["content"]]}
    with pytest.raises(ValueError, match="tokenizer.json"):
        complete_specials(no_pads)


def _parse(tok, body, deltas, top=None):
    opts = recipe.ConversionOptions().with_model_alias("m", recipe.ModelVersion.DeepseekV41Flash)
    conv = recipe.ChatCompletionRequest({"model": "m", **body}).convert(opts)
    p = SampleParser(CHAT, conv, "chatcmpl-1", "m", tok.recipe, 7, 1, top)
    resp = recipe.ChatCompletionResponse("chatcmpl-1", "m", 0, 7, 0)
    for c in p.start() + [c for d in deltas for c in p.push(d)]:
        resp.accumulate(c)
    return json.loads(resp.to_json()), p


def test_dsml_tool_call_parsed_from_engine_tokens(tok):
    ids = tok.hf.encode("Checking." + CALL, add_special_tokens=False).ids
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "thinking": {"type": "disabled"}}
    half = len(ids) // 2
    out, p = _parse(tok, body, [Delta(0, ids[:half], None, None), Delta(0, ids[half:] + [1], None, "stop")])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert p.generated == len(ids) + 1  # the EOS is generated (usage) but not parsed as output


def test_reasoning_content_and_logprobs(tok):
    ids = tok.hf.encode("I think</think>The answer.", add_special_tokens=False).ids
    lps = [{t: -0.5, 7: -1.0, 8: -2.0} for t in ids]
    out, _ = _parse(tok, {"messages": [{"role": "user", "content": "Q"}], "logprobs": True, "top_logprobs": 2},
                    [Delta(0, ids, lps, "length")], top=2)
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"] == "I think" and msg["content"] == "The answer."
    assert out["choices"][0]["finish_reason"] == "length"
    content = out["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 2 and t["logprob"] == -0.5 for t in content)


def test_aborted_sample_is_a_server_error(tok):
    opts = recipe.ConversionOptions().with_model_alias("m", recipe.ModelVersion.DeepseekV41Flash)
    conv = recipe.ChatCompletionRequest({"model": "m", "messages": [{"role": "user", "content": "Q"}]}).convert(opts)
    p = SampleParser(CHAT, conv, "chatcmpl-1", "m", tok.recipe, 7, 1, None)
    p.start()
    with pytest.raises(APIError) as e:
        p.push(Delta(0, [40], None, "abort", "step failed"))
    assert e.value.status == 500 and "step failed" in e.value.message
    # a grammar that failed to compile: the request's fault (state.run raises it), naming the field it came from
    e = constraint_error("so_args.schema: compiling the json grammar failed: x", "structured_outputs.json", "messages")
    assert (e.status, e.param, e.message) == (400, "structured_outputs.json",
                                              "structured_outputs.json: compiling the json grammar failed: x")
    assert constraint_error("step failed", "response_format", "messages") is None


def _no_engine(model_dir, **kw):
    """An EngineClient stand-in of a V4.1 checkpoint in model_dir (its tokenizer and config written here)."""
    from types import SimpleNamespace

    write_tokenizer(model_dir, VOCAB)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    return SimpleNamespace(info={"model_dir": str(model_dir), "max_model_len": 512, "max_num_seqs": 4,
                                 "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1}, stats={}, **kw)


def test_every_model_name_renders_as_the_served_model(tmp_path):
    """A V4.1 checkpoint asked for by recipe's V4 name still gets the V4.1 encoding."""
    from deepinfer.entrypoints.openai.server import build_state

    state = build_state(_no_engine(tmp_path), "mine", 8, default_thinking=False)
    assert {"mine", "DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"} <= state.aliases
    for name in state.aliases:
        conv = recipe.ChatCompletionRequest({"model": name, "messages": [{"role": "user", "content": "x"}]}).convert(
            state.recipe_options)
        assert conv.model_version == recipe.ModelVersion.DeepseekV41Flash
        assert not conv.conversation.thinking_mode  # --no-thinking: the default for requests that do not ask


def test_error_bodies_have_openai_types_and_codes(tmp_path):
    """Every error status has its snake_case type; an unknown model is a 404 with code model_not_found."""
    import asyncio

    import httpx

    from deepinfer.entrypoints.openai.app import build_app
    from deepinfer.entrypoints.openai.server import build_state

    app = build_app(build_state(_no_engine(tmp_path, dead="gone"), "mine", 8, default_thinking=False), api_key="k")

    async def call(method, path, key="k", **kw):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.request(method, path, headers={"Authorization": f"Bearer {key}"}, **kw)
            return r.status_code, r.json()["error"]
    chat = {"model": "mine", "messages": [{"role": "user", "content": "x"}]}
    cases = [(("POST", "/v1/chat/completions"), {"json": {**chat, "model": "nope"}},
              (404, "not_found_error", "model", "model_not_found")),
             (("GET", "/v1/nowhere"), {}, (404, "not_found_error", None, None)),
             (("POST", "/v1/chat/completions", "wrong"), {"json": chat},
              (401, "authentication_error", None, "invalid_api_key")),
             (("POST", "/v1/chat/completions"), {"json": {**chat, "n": 0}}, (400, "invalid_request_error", "n", None)),
             (("POST", "/v1/chat/completions"), {"json": chat}, (503, "service_unavailable_error", None, None))]
    for args, kw, want in cases:
        status, err = asyncio.run(call(*args, **kw))
        assert (status, err["type"], err["param"], err["code"]) == want, (args, err)
