"""`deepinfer serve --model demo` (the random V4.1 demo checkpoint) under load, fuzzed, then with its
engine-core process killed. One server for the module; the kill test runs last."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

N_REQUESTS, MAX_TOKENS = 200, 3
FUZZ_EXAMPLES = 15  # per POST endpoint
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("demo", tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", "demo",
                        "--max-model-len", "512", "--kv-cache-memory", str(256 << 20), "--max-queue-len", "256")
    yield srv
    if srv.proc.poll() is None:  # a test failed before the engine was killed
        srv.stop()


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
    """One streaming request (completions or chat, alternately); checks the stream and returns its usage.
    Prompts are a few tokens (distinct per request): the prefill of 200 of them is this test's cost."""
    kw = dict(model="demo", max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}, seed=i)
    if i % 2:
        stream = await client.completions.create(prompt=f"{i}:", **kw,
                                                 extra_body={"ignore_eos": True})
    else:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": f"{i}"}],
                                                      **kw, extra_body={"ignore_eos": True, **NO_THINKING})
    chunks = [c async for c in stream]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"], (i, chunks)
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS, (i, chunks)
    return usage[0].prompt_tokens, usage[0].completion_tokens


def test_a_first_chat_of_the_demo_has_content(server):
    """The demo never learnt to think: a chat that names no thinking mode gets none, and an answer."""
    client = openai.OpenAI(api_key="none", base_url=f"{server.url}/v1", max_retries=0, timeout=120)
    kw = dict(model="demo", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=16, seed=0)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content and msg.model_extra.get("reasoning_content") is None, msg
    asked = client.chat.completions.create(**kw, extra_body={"thinking": {"type": "enabled"}}).choices[0].message
    assert asked.model_extra.get("reasoning_content") is not None, asked


def test_200_concurrent_streams_complete_and_metrics_agree(server):
    before = server.metrics()

    async def main():
        async with openai.AsyncOpenAI(api_key="none", base_url=f"{server.url}/v1", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(_one(c, i) for i in range(N_REQUESTS)))

    t0 = time.monotonic()
    usages = asyncio.run(main())
    elapsed = time.monotonic() - t0
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert len(usages) == N_REQUESTS
    assert delta("deepinfer:request_success_total{length}") == N_REQUESTS
    assert delta("deepinfer:generation_tokens_total") == N_REQUESTS * MAX_TOKENS == sum(u[1] for u in usages)
    assert delta("deepinfer:prompt_tokens_total") == sum(u[0] for u in usages)
    assert delta("deepinfer:e2e_request_latency_seconds_count") == N_REQUESTS
    assert delta("deepinfer:time_to_first_token_seconds_count") == N_REQUESTS
    assert after["deepinfer:num_requests_in_flight"] == 0
    assert after["deepinfer:kv_cache_free_blocks"] == after["deepinfer:kv_cache_total_blocks"]
    print(f"{N_REQUESTS} streams in {elapsed:.1f} s")


# issue 40's load test: the whole request surface at once
MIXED_REQUESTS, MIXED_CONCURRENCY = 1000, 256
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS = [{"type": "function", "function": {"name": "set_alarm", "description": "An alarm", "parameters": ALARM}}]
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def _mixed(i: int) -> tuple[str, str, dict, int]:
    """Request i of the mix: (kind, path, body, samples): streamed and not, n = 2, structured outputs, logprobs,
    prompt logprobs, penalties, enforced tool calls, a client that leaves mid-stream, and a refused field."""
    chat = [{"role": "user", "content": f"request {i}"}]
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    # grammar requests 1 in 20 each: every step they are in samples after the step before is read back (a grammar
    # mask needs its token), which made 1 in 10 each half of this test's time on two cores
    kind = ("stream", "n2", "schema", "penalties", "tools", "leave", "bad", "chat-stream", "prompt-lp", "allowed",
            "stream", "n2", "penalties", "penalties", "chat-stream", "leave", "bad", "chat-stream", "prompt-lp",
            "allowed")[i % 20]
    c, h = "/v1/completions", "/v1/chat/completions"
    body = {
        "stream": (c, {"prompt": f"{i}:", "max_tokens": 3, "ignore_eos": True, "logprobs": 2, **stream}),
        "n2": (h, {"messages": chat, "max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 2, "seed": i,
                   "ignore_eos": True, **NO_THINKING}),
        "schema": (h, {"messages": chat, "max_tokens": 8, "temperature": 0, **NO_THINKING,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}}),
        "penalties": (c, {"prompt": f"def f{i}(", "max_tokens": 4, "frequency_penalty": 1.0, "presence_penalty": 0.5,
                          "repetition_penalty": 1.2, "logit_bias": {"5": 2.0}, "min_tokens": 2, "bad_words": ["self"],
                          **stream}),
        "tools": (h, {"messages": chat, "max_tokens": 12, "tools": TOOLS, "tool_choice": "required", **NO_THINKING,
                      **stream}),
        "leave": (c, {"prompt": f"{i}", "max_tokens": 400, "ignore_eos": True, **stream}),
        "bad": (c, {"prompt": "x", "max_tokens": 2, "no_such_field": 1}),
        "chat-stream": (h, {"messages": chat, "max_tokens": 3, "n": 2, "seed": i, "ignore_eos": True, **NO_THINKING,
                            **stream}),
        "prompt-lp": (c, {"prompt": f"x = {i}", "max_tokens": 2, "prompt_logprobs": 1, "ignore_eos": True}),
        "allowed": (c, {"prompt": f"{i}", "max_tokens": 3, "allowed_token_ids": list(range(10, 200)),
                        "ignore_eos": True}),
    }[kind]
    return kind, body[0], {"model": "demo", **body[1]}, body[1].get("n", 1)


async def _send(http: httpx.AsyncClient, i: int) -> dict:
    """Sends request i; returns its status and, for a completed one, its samples' finish reasons and usage."""
    kind, path, body, n = _mixed(i)
    rec = {"i": i, "kind": kind, "samples": n, "reasons": [], "usage": None}
    if not body.get("stream"):
        r = await http.post(path, json=body)
        rec["status"] = r.status_code
        if r.status_code == 200:
            out = r.json()
            rec["reasons"] = [ch["finish_reason"] for ch in out["choices"]]
            rec["usage"] = out["usage"]
        return rec
    async with http.stream("POST", path, json=body) as r:
        rec["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            return rec
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, (i, ev)
            rec["reasons"] += [ch["finish_reason"] for ch in ev.get("choices", []) if ch.get("finish_reason")]
            rec["usage"] = ev.get("usage") or rec["usage"]
            if kind == "leave":  # the client goes away after its first tokens
                rec["left"] = True
                return rec
    return rec


def test_1000_mixed_requests_at_concurrency_256(server):
    """Every request is answered (200, each sample finished) or refused with a 4xx; none gets a 5xx; /metrics
    counts every finished sample by reason (the clients that left as aborts); the cache is free at the end."""
    before = server.metrics()

    async def main():
        sem = asyncio.Semaphore(MIXED_CONCURRENCY)
        # a new connection a request: a pooled one the server closed while idle (uvicorn's keep-alive timeout) fails
        # the next request on it with ReadError, a client-side race (seen once in CI at b21f8ed)
        limits = httpx.Limits(max_connections=MIXED_CONCURRENCY + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
            async def one(i):
                async with sem:
                    return await _send(http, i)
            return await asyncio.gather(*(one(i) for i in range(MIXED_REQUESTS)))

    t0 = time.monotonic()
    recs = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert not [r for r in recs if r["status"] >= 500], [r for r in recs if r["status"] >= 500][:3]
    refused = [r for r in recs if 400 <= r["status"] < 500]
    assert {r["kind"] for r in refused} <= {"bad"} | ({"n2", "chat-stream"} if any(r["status"] == 429 for r in refused)
                                                    else set()), refused[:3]
    assert all(r["status"] == 400 for r in recs if r["kind"] == "bad")
    done = [r for r in recs if r["status"] == 200 and not r.get("left")]
    left = [r for r in recs if r.get("left")]
    for r in done:
        assert len(r["reasons"]) == r["samples"] and r["usage"], r
        if r["kind"] == "tools":
            assert set(r["reasons"]) <= {"tool_calls", "length"}, r
    m = server.wait_cache_free(within_s=60)

    def delta(name):
        return m.get(name, 0) - before.get(name, 0)

    finished = sum(r["samples"] for r in done)
    assert delta("deepinfer:request_success_total{length}") + delta("deepinfer:request_success_total{stop}") \
        == finished
    assert delta("deepinfer:request_success_total{abort}") == len(left) == MIXED_REQUESTS // 10
    assert {r["kind"] for r in done} == {"stream", "n2", "schema", "penalties", "tools", "chat-stream", "prompt-lp",
                                         "allowed"}
    assert delta("deepinfer:generation_tokens_total") >= sum(r["usage"]["completion_tokens"] for r in done)
    print(f"{MIXED_REQUESTS} mixed requests in {elapsed:.1f} s: {len(done)} answered, {len(left)} left, "
          f"{len(refused)} refused")


def test_fuzzed_requests_never_get_5xx(server):
    """schemathesis cases from the server's own OpenAPI schema, a bounded number per POST endpoint."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures, calls = [], [0]
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() != "POST":
            continue

        _fuzz(op, failures, calls)()
    assert calls[0] >= FUZZ_EXAMPLES and not failures, failures[:5]
    assert server.proc.poll() is None and httpx.get(f"{server.url}/health").status_code == 200


def _fuzz(op, failures: list, calls: list):
    from hypothesis import HealthCheck, given, settings

    @given(case=op.as_strategy())
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        if isinstance(case.body, dict):  # keep generation short: the fuzz is about request handling
            for k in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(k), int) and case.body[k] > 2:
                    case.body[k] = 2
            case.body.setdefault("max_tokens", 1)
        r = case.call(timeout=60)
        calls[0] += 1
        if r.status_code >= 500:
            failures.append((op.method, op.path, case.body, r.status_code, r.text[:300]))
    return check


def test_engine_death_gives_503_and_a_nonzero_exit(server):
    """Runs last: the engine-core process is killed mid-request."""
    client = httpx.Client(base_url=server.url, timeout=60)
    body = {"model": "demo", "prompt": "long", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        os.kill(server.engine_pid(), signal.SIGKILL)
        tail = list(r.iter_lines())  # the stream ends (with an error event) instead of hanging
    assert any("engine unavailable" in line for line in tail), tail
    try:
        r = client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "engine unavailable" in r.json()["error"]["message"]
    except httpx.TransportError:
        pass  # the server may already have exited
    assert server.proc.wait(30) != 0
