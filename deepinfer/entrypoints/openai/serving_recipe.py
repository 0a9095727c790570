"""/v1/chat/completions, /v1/messages and /v1/responses through deepseek-recipe: recipe converts the
request (messages, tools, tool_choice, thinking, reasoning effort, response format), renders and encodes
the V4 / V4.1 prompt, and parses the output (reasoning, content, DSML tool calls) into the protocol's
chunks or events; the engine only sees token ids and SamplingParams."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import deepseek_recipe as recipe
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.entrypoints.openai.protocol import (APIError, ChatRequest, SamplingFields, check_prompt_logprobs,
                                                   sampling_params)
from deepinfer.entrypoints.openai.serving import (ServerState, aborted, new_id, primed, prompt_logprobs_json, sse,
                                                  unless_disconnected)
from deepinfer.structured.backend import DSML_MARKER, opens_thinking
from deepinfer.structured.tool_calls import V4, V41, tool_call_tag


@dataclass(frozen=True)
class Protocol:
    request: type      # recipe's request class (body -> ConversationRequest)
    response: type     # recipe's response accumulator (chunks -> the non-streaming body)
    id_prefix: str
    n_choices: bool    # whether the protocol has OpenAI-style `choices` (n > 1 possible)
    format_field: str  # the request field of the answer's format (recipe's output constraint)
    schema_field: str  # the request field of that format's JSON schema


CHAT = Protocol(recipe.ChatCompletionRequest, recipe.ChatCompletionResponse, "chatcmpl", True, "response_format",
                "response_format.json_schema.schema")
MESSAGES = Protocol(recipe.MessagesRequest, recipe.MessagesResponse, "msg", False, "output_config.format",
                    "output_config.format.schema")
RESPONSES = Protocol(recipe.ResponsesRequest, recipe.ResponsesResponse, "resp", False, "text.format",
                     "text.format.schema")
_RECIPE_SCHEMA_ERROR = "Invalid json schema"  # how recipe's message begins for a schema it refuses (param null)

# fields this server reads itself (vLLM's sampling extras); recipe ignores them
_OWN_FIELDS = ("n", "top_k", "min_p", "ignore_eos", "stop_token_ids", "seed", "presence_penalty",
               "frequency_penalty", "structured_outputs", "prompt_logprobs", "logit_bias", "repetition_penalty",
               "min_tokens", "bad_words", "allowed_token_ids")


def _conversion_error(e: Exception, proto: Protocol) -> APIError:
    if not isinstance(e, recipe.ConversionError):
        return APIError(400, str(e))
    try:
        err = json.loads(e.body)["error"]
        message, param = err.get("message") or str(e), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(e.status_code, str(e))
    if param is None and message.startswith(_RECIPE_SCHEMA_ERROR):
        message, param = f"{proto.schema_field}: {message}", proto.schema_field
    return APIError(e.status_code, message, param)


def _so_args(conv, proto: Protocol, body: dict, dsml_id: int | None) -> tuple[dict | None, str]:
    """recipe's output constraint -> (SamplingParams.so_args, the request field it came from). A required tool call
    (tool_choice "required" or a named function: recipe renders the prompt into the opened calls block) follows
    the DSML tag of the tools recipe passes (structured/tool_calls.py); with "auto" the model may call a tool or
    not, and its output is parsed for calls without a constraint."""
    c = conv.inference_options.output_constraint
    if c is not None and c.kind == "tool_call_required" and conv.parsing_options.starts_in_tool_calls:
        if dsml_id is None:
            raise APIError(400, f"tool_choice: this model's tokenizer.json has no {DSML_MARKER} token, which a "
                                "required tool call is matched by", "tool_choice")
        fmt = V41 if conv.model_version == recipe.ModelVersion.DeepseekV41Flash else V4
        tag = tool_call_tag(json.loads(c.schema), fmt, dsml_id, body.get("parallel_tool_calls") is not False)
        return {"schema_type": "structural_tag", "schema": tag}, "tool_choice"
    if c is not None and c.kind == "json" and c.schema:
        return {"schema_type": "json", "schema": json.loads(c.schema)}, proto.schema_field
    if c is not None and c.kind == "json":
        return {"schema_type": "json_object"}, proto.format_field
    if c is not None and c.kind == "regex":
        return {"schema_type": "regex", "schema": c.schema}, proto.format_field
    return None, proto.format_field


def _output_prefix(conv, ids: list[int], hf) -> int:
    """How many of the prompt's last tokens begin the output: those of a continued assistant message (chat
    prefix completion, `"prefix": true`) after its rendered <｜Assistant｜><think>...</think> (or after its
    <think> where the message ends inside its reasoning); 0 without one. A constraint applies to the whole
    assistant message, so its grammar starts as after them (SamplingParams.so_prefix_tokens)."""
    msgs = conv.conversation.messages
    if not msgs or not msgs[-1].prefix:
        return 0
    sp = recipe.SpecialToken
    marks = {hf.token_to_id(sp.ThinkingStart.default_str()), hf.token_to_id(sp.ThinkingEnd.default_str())}
    assistant = hf.token_to_id(sp.Assistant.default_str())
    for k, t in enumerate(reversed(ids)):
        if t in marks or t == assistant:
            return k
    return 0


def _recipe_logprobs(ids: list[int], lps: list[dict], k: int):
    return [(d.get(t, 0.0), sorted(d.items(), key=lambda kv: -kv[1])[:k]) for t, d in zip(ids, lps)]


def _check_constraint_follows_reasoning(po, ids: list[int], think_ids: tuple[int | None, int | None],
                                        field: str) -> None:
    """In thinking mode the engine keeps the output free until its first </think> when the prompt opens a
    thinking block (structured.opens_thinking); recipe's parser puts that part in reasoning_content. Both
    must agree, or the constraint would apply to the reasoning (or never apply): APIError 400 if not."""
    stage = po.thinking_initial_stage
    parsed_as_reasoning = stage is not None and stage.starts_in_reasoning() and not po.starts_in_tool_calls
    if parsed_as_reasoning != opens_thinking(ids, *think_ids):
        raise APIError(400, f"{field}: the engine cannot tell this response's reasoning from its answer (the "
                            "model's tokenizer.json needs <think> and </think> tokens for that), so the constraint "
                            "would not apply to the answer alone; disable thinking for this request", field)


async def create(proto: Protocol, body: dict, raw: Request, state: ServerState):
    """`body`: the request JSON (a chat body already validated by ChatRequest)."""
    state.check_model(body.get("model"))
    own = SamplingFields.model_validate({k: body[k] for k in _OWN_FIELDS if k in body})
    own.unsupported()
    if own.prompt_logprobs is not None and proto is not CHAT:
        raise APIError(400, "prompt_logprobs: only /v1/completions and /v1/chat/completions return them",
                       "prompt_logprobs")
    check_prompt_logprobs(own, bool(body.get("stream")))
    body = {k: v for k, v in body.items() if k != "n"}
    if proto is CHAT and body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body["max_completion_tokens"]
    try:
        conv = proto.request(body).convert(state.recipe_options)
    except (recipe.ConversionError, ValueError, OverflowError, TypeError) as e:  # all about the request body
        raise _conversion_error(e, proto) from None
    try:
        ids = state.encoding(conv.model_version).encode(conv.conversation)
    except RuntimeError as e:
        raise APIError(400, f"messages: cannot be encoded: {e}", "messages") from None
    state.check_prompt(ids, None, "messages")
    try:
        max_tokens = conv.resolve_max_tokens(len(ids), state.max_model_len)
    except recipe.ConversionError as e:
        raise _conversion_error(e, proto) from None
    io, po = conv.inference_options, conv.parsing_options
    top = (io.top_logprobs or 0) if io.logprobs else None
    so_args, field = _so_args(conv, proto, body, state.tokenizer.dsml_id)
    constraint = "tool_choice" if field == "tool_choice" else proto.format_field
    if own.structured_outputs is not None:
        if so_args is not None:
            raise APIError(400, "structured_outputs: give it or response_format, not both", "structured_outputs")
        (so_args, field), constraint = own.structured_outputs.so_args(), "structured_outputs"
    prefix_len, prefix_field = 0, "messages"
    if so_args is not None:
        _check_constraint_follows_reasoning(po, ids, state.tokenizer.think_ids, constraint)
        prefix_len = _output_prefix(conv, ids, state.tokenizer.hf)
        if proto is CHAT:
            prefix_field = f"messages[{len(body['messages']) - 1}].content"
    params = sampling_params(own, max_tokens=max_tokens, logprobs=top, so_args=so_args, temperature=io.temperature,
                             top_p=io.top_p, seed=io.seed, so_prefix_tokens=prefix_len)
    params.stop = list(po.stop_sequences)
    rid, model, created = new_id(proto.id_prefix), body.get("model") or state.model_name, int(time.time())
    parsers = [SampleParser(proto, conv, rid, model, state.tokenizer.recipe, len(ids), state.eos_token_id, top)
               for _ in range(params.n)]
    ready = [p.start() for p in parsers]
    prompt_lps: list = []  # the engine's prompt_logprobs (from the leader's first delta)
    prompt_ranks: list = []  # and the prompt tokens' ranks

    async def chunks():
        """(sample index, recipe chunk) as the engine's tokens come."""
        async for d in state.run(ids, params, field, prefix_field):
            if d is None:  # accepted: the chunks the stream opens with
                for j, cs in enumerate(ready):
                    for c in cs:
                        yield j, c
                continue
            if d.prompt_logprobs is not None:
                prompt_lps[:] = d.prompt_logprobs
                prompt_ranks[:] = d.prompt_logprob_ranks
            for c in parsers[d.index].push(d):
                yield d.index, c

    def chat_chunk(j: int, text: str) -> str:
        """Chat chunks: choice index j; usage counts every token the engine generated (in every protocol's
        events: Messages' message_start / message_delta, Responses' response.completed)."""
        if not proto.n_choices:
            if '"output_tokens"' not in text:
                return text
            obj = json.loads(text)
            _fix_usage(obj, parsers[j].generated)
            return json.dumps(obj, ensure_ascii=False)
        if params.n == 1 and '"usage":null' in text:
            return text
        obj = json.loads(text)
        for ch in obj.get("choices", []):
            ch["index"] = j
        if obj.get("usage"):
            _count_usage(obj["usage"], parsers[j].generated)
        return json.dumps(obj, ensure_ascii=False)

    if not body.get("stream"):
        resps = [proto.response(rid, model, created, len(ids), 0) for _ in range(params.n)]

        async def collect():
            async for j, c in chunks():
                resps[j].accumulate(c)
        await unless_disconnected(raw, collect())
        body = _merge([json.loads(r.to_json()) for r in resps])
        _fix_usage(body, sum(p.generated for p in parsers))
        if proto is CHAT:  # vLLM's place for them in a chat response: the response, not its choices
            k = params.prompt_logprobs
            body["prompt_logprobs"] = None if k is None else prompt_logprobs_json(prompt_lps, prompt_ranks, ids,
                                                                                  k, state.tokenizer.hf)
        return JSONResponse(body)

    _, stream = await unless_disconnected(raw, primed(chunks()))

    async def events():
        try:
            async for j, c in stream:
                yield sse(chat_chunk(j, c.to_json()), proto.response.sse_event_name(c))
            done = proto.response.sse_done_data()
            if done is not None:
                yield sse(done)
        except APIError as e:
            yield sse(e.body(), "error")
    return StreamingResponse(events(), media_type="text/event-stream")


class SampleParser:
    """One sample's engine deltas -> the protocol's chunks, through recipe's stream processor (reasoning,
    content and DSML tool calls; stop sequences; logprobs)."""

    def __init__(self, proto: Protocol, conv, rid: str, model: str, tokenizer, prompt_tokens: int,
                 eos_token_id: int | None, top_logprobs: int | None):
        self.proc = recipe.StreamProcessor(proto.request.chunk_generator(conv, rid, model), conv.parsing_options,
                                           tokenizer)
        self.prompt_tokens, self.eos, self.top = prompt_tokens, eos_token_id, top_logprobs
        self.generated = 0  # tokens the engine generated (recipe's usage leaves out some special tokens)

    def start(self) -> list:
        return self.proc.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(
            prompt_tokens=self.prompt_tokens)))

    def push(self, d) -> list:
        """Chunks for one Delta; APIError 500 for an aborted sample or output recipe cannot parse."""
        ids, lps = d.token_ids, d.logprobs
        self.generated += len(ids)
        if d.finish_reason == "stop" and ids and ids[-1] == self.eos:  # EOS ends the turn; it is not output
            ids, lps = ids[:-1], (lps[:-1] if lps else lps)
        out = []
        try:
            if ids:
                lp = _recipe_logprobs(ids, lps, self.top) if self.top is not None and lps else None
                out += self.proc.push(recipe.InferenceChunk.tokens(ids, lp))
            if d.finish_reason == "abort":
                self.proc.close()
                raise aborted(d.error)
            if d.finish_reason is not None:
                reason = recipe.InferenceFinishReason.Length if d.finish_reason == "length" \
                    else recipe.InferenceFinishReason.Stop
                out += self.proc.push(recipe.InferenceChunk.finish(reason)) + self.proc.finish()
        except RuntimeError as e:  # the output could not be parsed into the protocol's chunks
            raise APIError(500, f"output parsing failed: {e}") from None
        return out


def _merge(bodies: list[dict]) -> dict:
    """n chat responses as one: choices j = sample j."""
    out = bodies[0]
    for j, b in enumerate(bodies[1:], 1):
        for ch in b["choices"]:
            out["choices"].append({**ch, "index": j})
    return out


def _count_usage(usage: dict, generated: int) -> None:
    """One usage object (chat's completion_tokens, or Messages' / Responses' output_tokens) set to the
    tokens the engine generated."""
    if "completion_tokens" in usage:
        usage["completion_tokens"] = generated
        usage["total_tokens"] = usage["prompt_tokens"] + generated
    if "output_tokens" in usage:
        usage["output_tokens"] = generated
        if "total_tokens" in usage:
            usage["total_tokens"] = usage.get("input_tokens", 0) + generated


def _fix_usage(obj: dict, generated: int) -> None:
    """Every usage object inside a response body or event (recipe's usage leaves out some special tokens)."""
    for key, v in obj.items():
        if key == "usage" and isinstance(v, dict):
            _count_usage(v, generated)
        elif isinstance(v, dict):
            _fix_usage(v, generated)


async def create_chat(req: ChatRequest, raw: Request, state: ServerState):
    req.unsupported()
    return await create(CHAT, req.model_dump(exclude_unset=True, by_alias=True), raw, state)
