"""What every endpoint shares: the server's state, admission (429), running one engine request with its
metrics, SSE framing, and waiting on a result while watching for the client going away."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from deepinfer.entrypoints.openai.engine_client import Delta, EngineClient, EngineDeadError, RequestRejected
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.entrypoints.openai.protocol import APIError
from deepinfer.entrypoints.openai.tokenizer import ServingTokenizer
from deepinfer.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.2
RETRY_AFTER_S = 1
_SO_ARGS_NAME = re.compile(r"^so_args(\.\w+)?:? ")  # the engine's name of the constraint, in its messages


@dataclass
class ServerState:
    client: EngineClient
    metrics: ServerMetrics
    tokenizer: ServingTokenizer
    model_name: str
    max_model_len: int
    max_queue_len: int  # samples beyond the engine's max_num_seqs that may wait; more -> 429
    max_num_seqs: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    recipe_options: object = None  # deepseek_recipe.ConversionOptions (the served names as aliases)
    encodings: dict = field(default_factory=dict)  # deepseek_recipe.ModelVersion -> its prompt encoding
    aliases: set[str] = field(default_factory=set)
    in_flight: int = 0  # samples admitted and not finished
    started: float = 0.0  # time.time() at start-up
    model_dir: str = ""  # the checkpoint's directory (/v1/models reports it as `root`, as vLLM does)

    def encoding(self, version):
        return self.encodings[version]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str = "prompt") -> None:
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens; this model's context (max_model_len) "
                                f"is {self.max_model_len} and one more token must fit", param)
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise APIError(400, f"max_tokens: {max_tokens} with a prompt of {len(ids)} tokens exceeds "
                                f"max_model_len {self.max_model_len}", "max_tokens")

    async def run(self, ids: list[int], params: SamplingParams, so_field: str = "response_format",
                  prefix_field: str = "messages") -> AsyncIterator[Delta | None]:
        """None once the engine accepted the prompt, then its deltas (params.n samples), recording metrics;
        APIError 429 when the queue is full, 400 when the engine refuses the parameters or aborts a sample for
        its constraint (a grammar that failed to compile), 503 when the engine is gone. `so_field`: the request
        field params.so_args came from (named in its errors); `prefix_field`: the one holding the output prefix
        of params.so_prefix_tokens."""
        if params.n > self.max_num_seqs + self.max_queue_len:
            raise APIError(400, f"n: {params.n} samples can never be admitted (max_num_seqs + max_queue_len is "
                                f"{self.max_num_seqs + self.max_queue_len})", "n")
        if self.client.dead:
            raise APIError(503, f"engine unavailable: {self.client.dead}")
        if self.in_flight + params.n > self.max_num_seqs + self.max_queue_len:
            self.metrics.rejected.labels(self.model_name, "429").inc()
            raise APIError(429, f"the server's queue is full ({self.in_flight} requests in flight); retry later",
                           None, "rate_limit_exceeded", {"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += params.n
        start, first = time.monotonic(), [None] * params.n
        counts, done = [0] * params.n, [False] * params.n

        def finished(j: int, reason: str) -> None:
            done[j] = True
            self.metrics.finished(reason, len(ids) if j == 0 else 0, counts[j], start, first[j], time.monotonic())

        try:
            async for d in self.client.generate(ids, params):
                if d is None:
                    yield d
                    continue
                if d.token_ids and first[d.index] is None:
                    first[d.index] = time.monotonic()
                counts[d.index] += len(d.token_ids)
                if d.finish_reason is not None:
                    finished(d.index, d.finish_reason)
                err = constraint_error(d.error or "", so_field, prefix_field) if d.finish_reason == "abort" else None
                if err is not None:
                    raise err
                yield d
        except RequestRejected as e:
            self.metrics.rejected.labels(self.model_name, "400").inc()
            done = [True] * params.n
            msg = str(e).removeprefix("SamplingParams.")
            param = msg.split(":", 1)[0].split(" ", 1)[0]
            raise constraint_error(msg, so_field, prefix_field) or APIError(400, msg, param)
        except EngineDeadError as e:
            raise APIError(503, f"engine unavailable: {e}") from None
        finally:
            self.in_flight -= params.n
            for j in range(params.n):
                if not done[j]:  # the client went away (its request was aborted) or the engine died
                    finished(j, "abort")


def prompt_logprobs_json(lps: list[dict[int, float] | None], ranks: list[int | None], prompt: list[int], k: int,
                         hf) -> list[dict | None]:
    """The engine's prompt_logprobs in vLLM's response shape: per prompt position None (position 0: nothing
    predicts it) or {str(token id): {"logprob", "rank", "decoded_token"}} for the top-k and the prompt token.
    rank: 1-based; the prompt token's is the engine's count over the whole vocabulary (`ranks`), the top-k's their
    order."""
    names: dict[int, str] = {}

    def entry(d: dict[int, float], t: int, rank: int | None) -> dict:
        if t not in names:
            names[t] = hf.decode([t], skip_special_tokens=False)
        return {"logprob": d[t], "rank": rank, "decoded_token": names[t]}

    out: list[dict | None] = []
    for tok, d, rank in zip(prompt, lps, ranks):
        if d is None:
            out.append(None)
            continue
        outside = len(d) > k  # the prompt token is not among the top-k: the engine added it
        top = sorted((t for t in d if not (outside and t == tok)), key=lambda t: -d[t])
        one = {str(t): entry(d, t, r) for r, t in enumerate(top, 1)}
        one[str(tok)] = entry(d, tok, rank)
        out.append(one)
    return out


def constraint_error(error: str, so_field: str, prefix_field: str) -> APIError | None:
    """The 400 of an engine error about the request's constraint (SamplingParams.so_args: the request field
    `so_field`) or its output prefix (so_prefix_tokens: `prefix_field`), naming that field; None for any other."""
    if error.startswith("so_args"):
        detail = _SO_ARGS_NAME.sub("", error, count=1)
        return APIError(400, f"{so_field}: {detail}", so_field)
    if error.startswith("so_prefix_tokens"):
        return APIError(400, f"{prefix_field}: {error.removeprefix('so_prefix_tokens: ')} ({so_field} applies to the "
                             "whole assistant message)", prefix_field)
    return None


def aborted(error: str | None) -> APIError:
    """The error of a sample the engine aborted for any reason but its constraint (state.run raises those)."""
    return APIError(500, f"generation failed: {error}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str, event: str | None = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


async def unless_disconnected(request: Request, coro):
    """`coro`'s result; if the client goes away first, `coro` is cancelled (its engine requests aborted,
    their cache freed) and ClientDisconnected raised."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class ClientDisconnected(Exception):
    pass


async def merged(sources: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(source index, item) from several async iterators as they come; the first error ends them all.
    Closing this iterator cancels (and so closes) every source."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, src):
        try:
            async for item in src:
                await q.put((i, item))
            await q.put((i, end))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await q.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    left = len(tasks)
    try:
        while left:
            i, item = await q.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def primed(agen: AsyncIterator) -> tuple[object, AsyncIterator]:
    """(first item, an iterator over all items): errors raised before the first item (400 / 429 / 503)
    surface here, before any response has started (engine requests yield None once accepted)."""
    first = await agen.__anext__()

    async def chain():
        yield first
        async for x in agen:
            yield x
    return first, chain()
