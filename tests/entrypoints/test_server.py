"""`deepinfer serve` as a real subprocess (a tiny random V4.1 checkpoint), driven by the official openai
client: completions and chat (streaming and not), logprobs, n, stop, seeds under batch invariance,
response_format, tools through deepseek-recipe, error bodies (400 / 401 / 429), client disconnects
freeing the cache, graceful shutdown. One server for the module."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_process import ServerProcess

from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

KEY = "sk-test-key"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS, MAX_QUEUE_LEN = 4, 2
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("tiny41") / "ckpt", PRESETS["tiny41"], seed=5, dtype="fp8")
    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", "tiny",
                        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-queue-len", str(MAX_QUEUE_LEN), "--kv-cache-memory", str(64 << 20),
                        "--batch-invariant", api_key=KEY)
    yield srv
    if srv.proc.poll() is None:
        srv.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key=KEY, base_url=f"{server.url}/v1", max_retries=0, timeout=120)


def test_models_and_health(server, client):
    (model,) = client.models.list().data
    assert model.id == "tiny" and (Path(model.root) / "tokenizer.json").is_file()  # root: where bench finds it
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_logprobs_and_n(client):
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, logprobs=2, n=2, seed=3,
                                    temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices) == 12
    for c in out.choices:
        assert c.finish_reason == "length"
        assert len(c.logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in c.logprobs.top_logprobs)


def test_several_prompts_in_one_completion_request(client):
    kw = dict(model="tiny", prompt=["Once upon", "A small model"], max_tokens=3, n=2, seed=6)
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3] and whole.usage.completion_tokens == 12
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in whole.choices]


def test_seed_gives_identical_outputs_streamed_or_not(client):
    def run(seed, stream=False):
        kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=10, seed=seed, temperature=1.0)
        if not stream:
            return client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
        assert chunks[-2].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks if c.choices)

    a = run(7)
    assert run(7) == a and run(7, stream=True) == a
    assert len({a, run(8), run(9)}) > 1  # seeds matter


def test_stop_string_cuts_the_text(client):
    kw = dict(model="tiny", prompt="Machine learning models", max_tokens=16, seed=11, temperature=1.0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:5]
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    assert out.text == full[:full.index(stop)] and out.finish_reason == "stop"


def test_chat_thinking_on_and_off(client):
    msgs = [{"role": "user", "content": "Say hi"}]
    think = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=1)
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=1, extra_body=NO_THINKING)
    assert think.choices[0].message.model_extra.get("reasoning_content") is not None
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None
    assert plain.usage.completion_tokens == 5 and 1 <= think.usage.completion_tokens <= 5
    assert think.usage.prompt_tokens != plain.usage.prompt_tokens  # recipe renders the two modes differently


def test_chat_stream_logprobs_and_n(client):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=6, seed=5, logprobs=True, top_logprobs=2, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kw, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 12
    stream = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert stream[-1].usage.completion_tokens == 6
    lps = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert lps and all(len(t.top_logprobs) == 2 for t in lps)
    both = list(client.chat.completions.create(**kw, n=2, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in both if c.choices and c.choices[0].index == j)
             for j in range(2)]
    assert texts == [c.message.content for c in whole.choices]  # seeded: sample j streams what it returned whole
    assert sorted(c.choices[0].index for c in both if c.choices and c.choices[0].finish_reason) == [0, 1]


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give me JSON"}], max_tokens=120, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}, extra_body=NO_THINKING)
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    plain = client.completions.create(model="tiny", prompt="JSON:", max_tokens=120, seed=3, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    assert plain.choices[0].finish_reason == "stop", plain
    jsonschema.validate(json.loads(plain.choices[0].text), schema)


def test_response_format_with_thinking_on(client):
    """Accepted in thinking mode: the reasoning is free and the schema applies to the answer after </think>
    (which this random model seldom writes: test_server_structured_thinking.py makes it close the block)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Give me JSON"}], max_tokens=24, seed=2,
              response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    out = client.chat.completions.create(**kw)
    (choice,) = out.choices
    assert choice.message.model_extra.get("reasoning_content") is not None
    assert choice.finish_reason in ("stop", "length") and 1 <= out.usage.completion_tokens <= 24
    if choice.message.content and choice.finish_reason == "stop":  # the answer is complete: it follows the schema
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == (choice.message.content or "")  # seeded
    assert [d.finish_reason for d in deltas if d.finish_reason] == [choice.finish_reason]
    assert stream[-1].usage.completion_tokens == out.usage.completion_tokens
    so = client.chat.completions.create(model="tiny", messages=kw["messages"], max_tokens=8,
                                        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert so.choices[0].message.model_extra.get("reasoning_content") is not None


def test_structured_outputs_field(client):
    """vLLM's structured_outputs extra field: regex and choice."""
    def run(**so):
        out = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, seed=4,
                                        extra_body={"structured_outputs": so}).choices[0]
        assert out.finish_reason == "stop", out
        return out.text

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", run(regex="[0-9]{3}-[a-z]{2}"))
    assert run(choice=["red fox", "a.b|c", "blue"]) in {"red fox", "a.b|c", "blue"}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick"}], max_tokens=20,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}, **NO_THINKING})
    assert chat.choices[0].message.content in {"yes", "no"}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_round_trip_through_recipe(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    bare = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, extra_body=NO_THINKING)
    with_tools = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, tools=TOOLS,
                                                tool_choice="auto", extra_body=NO_THINKING)
    assert with_tools.usage.prompt_tokens > bare.usage.prompt_tokens + 50  # the tool schemas were rendered
    history = msgs + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    nxt = client.chat.completions.create(model="tiny", messages=history, max_tokens=3, tools=TOOLS,
                                         extra_body=NO_THINKING)
    assert nxt.usage.prompt_tokens > with_tools.usage.prompt_tokens  # the call and its result were rendered
    assert nxt.choices[0].finish_reason == "length"


def _error(server, path, body, headers=None):
    r = httpx.post(f"{server.url}{path}", content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={**server.headers, "content-type": "application/json", **(headers or {})}, timeout=60)
    return r.status_code, r.json()["error"], r.headers


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b"{not json", "body"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", [1, 2]]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * MAX_MODEL_LEN}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi " * (2 * MAX_MODEL_LEN)}]},
     "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": MAX_NUM_SEQS + MAX_QUEUE_LEN + 1}, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 0}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
     "structured_outputs.regex"),
])
def test_bad_requests_are_400_naming_the_field(server, path, body, param):
    status, err, _ = _error(server, path, body)
    assert status == 400 and err["type"] == "invalid_request_error", err
    assert err["param"] == param and err["message"], err


def test_unknown_model_404_and_unknown_fields_400(server, client):
    """Request fields are understood or refused, never ignored: an unknown field, or one this server does not
    implement (vLLM's truncate_prompt_tokens, its old guided_json), is a 400 naming it, on both endpoints."""
    status, err, _ = _error(server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert (status, err["type"], err["param"], err["code"]) == (404, "not_found_error", "model", "model_not_found")
    chat = [{"role": "user", "content": "hi"}]
    for field, value in (("no_such_field", [1]), ("truncate_prompt_tokens", 3), ("guided_json", {"type": "object"})):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:  # "auto" is not constrained: one call a turn cannot be held
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, tools=TOOLS,
                                       parallel_tool_calls=False, extra_body=NO_THINKING)
    assert e.value.body["param"] == "parallel_tool_calls"
    with pytest.raises(openai.BadRequestError) as e:  # the tiny tokenizer has no ｜DSML｜ token to enforce calls by
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, tools=TOOLS, tool_choice="required",
                                       extra_body=NO_THINKING)
    assert e.value.body["param"] == "tool_choice"
    out = client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, parallel_tool_calls=True)
    assert out.usage.completion_tokens == 2


def test_sampling_fields_act_and_equal_the_offline_engine(server, client):
    """Each of vLLM's sampling fields changes the greedy tokens the server emits, and the server's tokens equal the
    offline LLM's with the same SamplingParams (whose processing tests/engine/test_logits_processors.py holds to a
    torch reference of vLLM's definitions)."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(client.models.list().data[0].root, device="cpu", dtype="float32", kv_cache_memory=64 << 20,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, batch_invariant=True)
    prompt = [0] + [5, 9, 12, 5, 9, 30, 12, 7] * 3

    def offline(**fields):
        sp = SamplingParams(temperature=0, max_tokens=10, **{k: ({int(t): b for t, b in v.items()}
                                                                  if k == "logit_bias" else v) for k, v in fields.items()})
        return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]

    plain = offline().token_ids
    enc = llm.detokenizer.encode
    # a word the greedy output holds as one token (bad_words bans it with and without a leading space)
    word = next(w for t in plain for w in [llm.detokenizer.decode([t]).strip()]
                if w and t in (enc(w, None) + enc(" " + w, None))[:1] + enc(" " + w, None)[:1])
    bias = {"7": 4.0}
    cases = [({"repetition_penalty": 1.8, "logit_bias": bias}, {"logit_bias": bias}),
             ({"frequency_penalty": 1.5, "logit_bias": bias}, {"logit_bias": bias}),
             ({"presence_penalty": 2.0, "logit_bias": bias}, {"logit_bias": bias}), ({"logit_bias": {"7": 5.0}}, {}),
             ({"min_tokens": 6, "stop_token_ids": [plain[1]]}, {"stop_token_ids": [plain[1]]}),
             ({"allowed_token_ids": [5, 6, 7, 8]}, {}), ({"bad_words": [word]}, {})]
    for fields, base in cases:
        want = offline(**fields)
        assert want.token_ids != offline(**base).token_ids, fields
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body=fields)
        assert (out.choices[0].text, out.usage.completion_tokens) == (want.text, len(want.token_ids)), fields
    with pytest.raises(openai.BadRequestError) as e:  # checked against the model's vocabulary
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logit_bias={"999999": 1})
    assert e.value.body["param"] == "logit_bias", e.value.body


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_messages_and_responses_endpoints(server, client):
    r = httpx.post(f"{server.url}/v1/messages", headers=server.headers, timeout=60, json={
        "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **NO_THINKING})
    body = r.json()
    assert r.status_code == 200 and body["type"] == "message"
    # sampled at the API's default temperature, the tiny random model may end the message with EOS (counted in
    # output_tokens) at or before max_tokens
    assert (body["usage"]["output_tokens"], body["stop_reason"]) == (3, "max_tokens") or \
        (body["usage"]["output_tokens"] <= 3 and body["stop_reason"] in ("end_turn", "stop_sequence")), body
    with httpx.stream("POST", f"{server.url}/v1/messages", headers=server.headers, timeout=60, json={
            "model": "tiny", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}],
            **NO_THINKING}) as r:
        events = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    resp = client.responses.create(model="tiny", input="hi", max_output_tokens=3)
    assert resp.status == "incomplete" and 1 <= resp.usage.output_tokens <= 3


def test_non_streaming_client_that_leaves_is_aborted(server):
    m0 = server.metrics()
    body = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=1.0)
    m = server.wait_cache_free()
    assert m["deepinfer:request_success_total{abort}"] - m0.get("deepinfer:request_success_total{abort}", 0) == 1
    assert m["deepinfer:generation_tokens_total"] - m0["deepinfer:generation_tokens_total"] < body["max_tokens"] / 4


def test_full_queue_429_then_disconnects_free_the_cache(server):
    m0 = server.metrics()
    body = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": MAX_MODEL_LEN - 16, "stream": True,
            "ignore_eos": True}
    clients = [httpx.Client(base_url=server.url, headers=server.headers, timeout=60)
               for _ in range(MAX_NUM_SEQS + MAX_QUEUE_LEN)]
    streams = []
    try:
        for c in clients:
            s = c.stream("POST", "/v1/completions", json=body)
            r = s.__enter__()
            assert r.status_code == 200
            streams.append((s, r, r.iter_lines()))
        for _, _, lines in streams[:MAX_NUM_SEQS]:
            assert next(lines).startswith("data: ")  # decoding
        status, err, headers = _error(server, "/v1/completions", {**body, "stream": False})
        assert status == 429 and headers["retry-after"] and err["message"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        busy = server.metrics()
        assert busy["deepinfer:kv_cache_free_blocks"] < busy["deepinfer:kv_cache_total_blocks"]
    finally:
        for s, _, _ in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    m = server.wait_cache_free()
    aborted = m.get("deepinfer:request_success_total{abort}", 0) - m0.get("deepinfer:request_success_total{abort}", 0)
    assert aborted == MAX_NUM_SEQS + MAX_QUEUE_LEN
    generated = m["deepinfer:generation_tokens_total"] - m0["deepinfer:generation_tokens_total"]
    assert generated < (MAX_NUM_SEQS + MAX_QUEUE_LEN) * body["max_tokens"] / 4  # stopped long before the end


def test_graceful_shutdown_drains_requests_in_flight(server, client):
    """Runs last: SIGTERM while a request decodes; it completes, then the server exits 0 without a word."""
    result = {}

    def call():
        result["out"] = client.completions.create(model="tiny", prompt="hi", max_tokens=40,
                                                  extra_body={"ignore_eos": True})

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    server.stop_cleanly()
    t.join(30)
    out = result["out"]
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 40
