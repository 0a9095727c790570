"""Enforced tool calls through `deepinfer serve` and the openai client, on the trained demo (its tokenizer has
DeepSeek's ｜DSML｜ marker as a token): tool_choice "required" and a named function always come back as parsed
tool calls whose arguments validate against the tool's schema; parallel_tool_calls=false holds a turn to one call;
"auto" stays free. The grammar: structured/tool_calls.py."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_process import ServerProcess

from deepinfer.tools.demo import resolve_demo

# finite arguments (an enum string, a boolean, an optional bounded array of booleans): a call always closes
WEATHER = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                            "detailed": {"type": "boolean"}}, "required": ["unit"]}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "description": "An alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
NO_THINKING = {"thinking": {"type": "disabled"}}
MSGS = [{"role": "user", "content": "What is the weather in Paris, and wake me at 7?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    srv = ServerProcess(resolve_demo("demo"), tmp_path_factory.mktemp("log") / "server.log", "--served-model-name",
                        "demo", "--max-model-len", "2048", "--max-num-seqs", "4", "--kv-cache-memory", str(64 << 20))
    yield openai.OpenAI(api_key="none", base_url=f"{srv.url}/v1", max_retries=0, timeout=300)
    if srv.proc.poll() is None:
        srv.stop_cleanly()


def _calls(out) -> list[tuple[str, dict]]:
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    return calls


def test_required_returns_valid_calls(client):
    out = client.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, tool_choice="required",
                                         max_tokens=400, temperature=1.0, seed=0, extra_body=NO_THINKING)
    assert len(_calls(out)) >= 1


def test_a_named_function_streamed_in_one_call(client):
    """A named function with parallel_tool_calls=false, streamed: one call of that function, its argument deltas
    joining into arguments that validate."""
    named = {"type": "function", "function": {"name": "set_alarm"}}
    stream = client.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, tool_choice=named,
                                            parallel_tool_calls=False, max_tokens=400, temperature=0, stream=True,
                                            extra_body=NO_THINKING)
    names, args, finish = [], {}, None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.function.name:
                names.append(d.function.name)
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names == ["set_alarm"] and list(args) == [0]
    jsonschema.validate(json.loads(args[0]), ALARM)


def test_auto_is_not_constrained_and_refuses_one_call_a_turn(client):
    out = client.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=8,
                                         temperature=0, extra_body=NO_THINKING)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, parallel_tool_calls=False,
                                       max_tokens=8, extra_body=NO_THINKING)
    assert e.value.body["param"] == "parallel_tool_calls"
