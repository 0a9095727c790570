"""One streamed request of `deepinfer bench serve`, timed as vLLM's serving benchmark times it.

TTFT is the time from sending the request to the first chunk that carries text (content, or
reasoning content for chat); every later chunk with text adds one inter-token latency (ITL: a chunk
holding several tokens, as speculative decoding sends, is one gap); E2EL ends when the stream's
`data: [DONE]` arrives. A request succeeds only when the server answers 200 and the stream ends with
`[DONE]` (a stream without text has TTFT = E2EL); anything else (an HTTP error, an `error` event, a dropped connection) fails it with the
reason recorded.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from deepinfer.entrypoints.bench_datasets import BenchRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
_ERROR_BODY_CHARS = 500


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds, one per text chunk after the first
    text: str = ""
    chunks: int = 0  # chunks that carried text
    prompt_tokens: int | None = None  # the server's usage, when it sent one
    completion_tokens: int | None = None


def payload(endpoint: str, model: str, req: BenchRequest, *, ignore_eos: bool, temperature: float) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": temperature}
    if endpoint == CHAT:
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(obj: dict, chat: bool) -> str:
    parts = []
    for choice in obj.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            parts += [delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content")]
        else:
            parts.append(choice.get("text") or "")
    return "".join(p for p in parts if isinstance(p, str))


async def send(client, url: str, headers: dict, body: dict) -> RequestResult:
    """POST `body` to `url` with streaming and time what comes back (never raises for a failed request)."""
    out = RequestResult()
    chat = "messages" in body
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:_ERROR_BODY_CHARS]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    out.latency = time.perf_counter() - start
                    out.success = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    out.error = f"stream error event: {json.dumps(obj['error'])[:_ERROR_BODY_CHARS]}"
                    return out
                if usage := obj.get("usage"):
                    out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                    out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
                if text := _chunk_text(obj, chat):
                    now = time.perf_counter()
                    if out.chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.chunks += 1
                    out.text += text
            else:
                out.error = "stream ended before data: [DONE]"
    except Exception as e:  # a failed request is a result, whatever broke it
        out.success = False
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if out.success and out.chunks == 0:
        out.ttft = out.latency  # nothing to show before the end (e.g. only tokens that decode to "")
    return out
