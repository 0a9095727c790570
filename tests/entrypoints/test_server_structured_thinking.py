"""response_format / structured_outputs on thinking-mode chat requests, through the server's whole request
path (recipe conversion and encoding, the engine loop, recipe's reasoning / content split, SSE) in-process:
the app over an EngineLoop on a thread, its tiny random model's </think> logit raised so that it closes
its thinking block within a few tokens. The constraint must apply to `content` only."""
from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch

from deepinfer import LLM
from deepinfer.entrypoints.openai.app import build_app
from deepinfer.entrypoints.openai.engine_client import EngineClient
from deepinfer.entrypoints.openai.engine_proc import EngineLoop, engine_info
from deepinfer.entrypoints.openai.server import build_state
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint
from deepinfer.tools.tiny_tokenizer import write_tokenizer

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Give me an item as JSON"}]


class _EngineThread(threading.Thread):
    exitcode = 0  # EngineClient reads a process's exit code once its engine is gone


class InProcessEngine(EngineClient):
    """EngineClient over an EngineLoop on a thread of this process (plain queues, no spawned process)."""

    def __init__(self, llm: LLM):
        super().__init__({})
        self.inbox, self.outbox = queue.Queue(), queue.Queue()
        self.proc = _EngineThread(target=EngineLoop(llm, self.inbox, self.outbox).run, daemon=True)
        self.info = engine_info(llm)
        self.stats = self.info["stats"]
        self.proc.start()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(event loop, httpx client on the app): one loop for the module, as the engine's reader thread
    delivers to one loop."""
    ckpt = write_checkpoint(tmp_path_factory.mktemp("tiny41") / "ckpt", PRESETS["tiny41"], seed=5, dtype="fp8")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=64 << 20, seed=0)
    end = llm.detokenizer.tok.token_to_id("</think>")
    bias = torch.zeros(llm.model.config.vocab_size)
    bias[end] = 6.0  # random weights would think ~vocab tokens long
    llm.model.compute_logits = lambda h, logits=llm.model.compute_logits: logits(h) + bias
    engine = InProcessEngine(llm)
    state = build_state(engine, "tiny", 8, default_thinking=True)
    assert state.tokenizer.think_ids == (llm.detokenizer.tok.token_to_id("<think>"), end) and end is not None
    loop, before = asyncio.new_event_loop(), set(threading.enumerate())
    engine.attach(loop)
    (reader,) = set(threading.enumerate()) - before
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://test", timeout=120)
    yield loop, http
    loop.run_until_complete(http.aclose())
    engine.shutdown()
    reader.join(10)  # it may still hand the loop the engine's last message
    loop.close()
    llm.close()


def _post(served, body: dict) -> httpx.Response:
    loop, http = served
    return loop.run_until_complete(http.post("/v1/chat/completions", json={"model": "tiny", **body}))


def _generated_total(served) -> float:
    text = _get(served, "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deepinfer:generation_tokens_total"))


def _get(served, path: str) -> httpx.Response:
    loop, http = served
    return loop.run_until_complete(http.get(path))


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_json_schema_constrains_the_content_not_the_reasoning(served):
    body = {"messages": ASK, "response_format": FORMAT, "max_tokens": 200, "seed": 1, "temperature": 1.0,
            "logprobs": True}
    before = _generated_total(served)
    r = _post(served, body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    msg, usage, lps = choice["message"], r.json()["usage"], choice["logprobs"]
    assert choice["finish_reason"] == "stop"  # the grammar completed (no EOS needed)
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    assert msg["reasoning_content"] is not None
    # the answer holds only grammar tokens; usage counts every engine token (reasoning, </think>, answer;
    # tokens without text, such as </think>, have no logprobs entry)
    assert "".join(t["token"] for t in lps["content"]) == msg["content"]
    assert len(lps["reasoning_content"]) + 1 + len(lps["content"]) <= usage["completion_tokens"]
    assert _generated_total(served) - before == usage["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    s = _post(served, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert s.status_code == 200, s.text
    chunks = _sse(s.text)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == msg["content"]  # same seed, same tokens
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["stop"]
    assert chunks[-1]["usage"] == usage


def test_structured_outputs_regex_with_thinking_each_sample(served):
    pattern = r"(red|green|blue)-[0-9]{2}"
    r = _post(served, {"messages": ASK, "structured_outputs": {"regex": pattern}, "n": 2, "max_tokens": 100,
                       "seed": 3, "temperature": 1.0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert c["finish_reason"] == "stop" and c["message"]["reasoning_content"] is not None, c
        assert re.fullmatch(pattern, c["message"]["content"]), c


@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}},
                                 {"structured_outputs": {"json_object": True}}], ids=["response_format", "so"])
def test_json_object_content_is_an_object(served, fmt):
    """recipe parses a json_object answer as JSON: the grammar must give an object, whole when it stops."""
    r = _post(served, {"messages": [{"role": "user", "content": "Reply in JSON"}], **fmt, "n": 4, "max_tokens": 40,
                       "seed": 1, "temperature": 1.0, "thinking": {"type": "disabled"}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert "stop" in [c["finish_reason"] for c in choices], choices
    for c in choices:
        content = c["message"]["content"]
        assert content.startswith("{"), c
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict), c


def test_refused_where_the_engine_cannot_find_the_reasoning(tmp_path):
    """A tokenizer.json without <think> / </think>: the server gives them padding entries, but the engine's
    grammar would not know them and would constrain the reasoning. Thinking off stays allowed."""
    write_tokenizer(tmp_path, 1024)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    for a in spec["added_tokens"]:
        if a["content"] in ("<think>", "</think>"):
            a["content"] = f"<｜tok_{a['id']}｜>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    gone = SimpleNamespace(info={"model_dir": str(tmp_path), "max_model_len": 512, "max_num_seqs": 4,
                                 "vocab_size": 1024, "bos_token_id": 0, "eos_token_id": 1}, stats={}, dead="gone")
    state = build_state(gone, "tiny", 8, default_thinking=True)
    assert state.tokenizer.think_ids == (None, None)  # as the engine sees tokenizer.json
    assert None not in (state.tokenizer.hf.token_to_id("<think>"), state.tokenizer.hf.token_to_id("</think>"))
    app = build_app(state)

    async def post(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body})
    r = asyncio.run(post({"response_format": FORMAT}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "<think>" in r.json()["error"]["message"]
    # thinking off: past the check, to the (gone) engine
    assert asyncio.run(post({"response_format": FORMAT, "thinking": {"type": "disabled"}})).status_code == 503


def test_responses_text_format_with_thinking(served):
    """/v1/responses' text.format: the reasoning item is free, the message item follows the schema."""
    loop, http = served
    r = loop.run_until_complete(http.post("/v1/responses", json={
        "model": "tiny", "input": "Give me an item as JSON", "max_output_tokens": 200, "temperature": 0.0,
        "text": {"format": {"type": "json_schema", "name": "item", "schema": SCHEMA}}}))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "completed", out
    kinds = [o["type"] for o in out["output"]]
    assert "reasoning" in kinds, out
    (text,) = [c["text"] for o in out["output"] if o["type"] == "message" for c in o["content"]]
    jsonschema.validate(json.loads(text), SCHEMA)


BAD_SCHEMA = {"type": "nonsense"}
BAD_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": BAD_FORMAT}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ("/v1/completions", {"response_format": BAD_FORMAT}, "response_format.json_schema.schema"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
     "text.format.schema"),
])
def test_an_invalid_constraint_is_400_naming_its_field(served, path, body, param):
    loop, http = served
    prompt = {"/v1/chat/completions": {"messages": ASK, "thinking": {"type": "disabled"}, "max_tokens": 4},
              "/v1/completions": {"prompt": "x", "max_tokens": 4}, "/v1/responses": {"input": "x"}}[path]
    r = loop.run_until_complete(http.post(path, json={"model": "tiny", **prompt, **body}))
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"].startswith(param), err
