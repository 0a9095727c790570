"""/v1/completions: text (or token-id) prompts, detokenised here with the model's tokenizer."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.engine.detokenizer import DecodeState, Detokenizer
from deepinfer.entrypoints.openai.protocol import (APIError, CompletionRequest, check_prompt_logprobs,
                                                   sampling_params, so_args_of)
from deepinfer.entrypoints.openai.serving import (ServerState, aborted, merged, new_id, primed, prompt_logprobs_json,
                                                  sse, unless_disconnected)


@dataclass
class _Choice:
    """One sample's text as it decodes; stop strings cut it (the engine has stopped it already)."""
    index: int
    detok: Detokenizer
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    lps: list[dict] = field(default_factory=list)
    st: DecodeState = field(default_factory=DecodeState)
    sent: int = 0  # characters of st.text already streamed
    finish_reason: str | None = None

    def add(self, delta) -> None:
        """APIError for a sample the engine aborted."""
        if delta.finish_reason == "abort":
            raise aborted(delta.error)
        self.ids += delta.token_ids
        self.lps += delta.logprobs or []
        self.detok.update(self.st, self.ids, self.stop)
        if delta.finish_reason is not None:
            self.finish_reason = "stop" if self.st.stop_hit else delta.finish_reason
            self.st.text = self.detok.finalize(self.st, self.ids)

    def new_text(self) -> str:
        """Text not streamed yet; while running, a tail that could begin a stop string is held back."""
        hold = 0 if self.finish_reason is not None else max((len(s) - 1 for s in self.stop), default=0)
        upto = max(self.sent, len(self.st.text) - hold)
        text, self.sent = self.st.text[self.sent:upto], upto
        return text


def _prompts(req: CompletionRequest, state: ServerState) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise APIError(400, "prompt: must not be empty", "prompt")
    bos = state.bos_token_id
    out = []
    for i, one in enumerate(p):
        where = "prompt" if len(p) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            if not one:
                raise APIError(400, f"{where}: must not be empty", where)
            ids = ([bos] if bos is not None else []) + state.tokenizer.hf.encode(one, add_special_tokens=False).ids
        else:
            if not one:
                raise APIError(400, f"{where}: must not be empty", where)
            bad = [t for t in one if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                               where)
            ids = list(one)
        state.check_prompt(ids, req.max_tokens, where)
        out.append(ids)
    return out


def _logprobs_json(choice: _Choice, hf, lo: int, hi: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, d in zip(choice.ids[lo:hi], choice.lps[lo:hi]):
        s = hf.decode([t], skip_special_tokens=False)
        tokens.append(s)
        token_lps.append(d.get(t))
        tops.append({hf.decode([k], skip_special_tokens=False): v for k, v in sorted(d.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState):
    state.check_model(req.model)
    req.unsupported()
    check_prompt_logprobs(req, req.stream)
    prompts = _prompts(req, state)
    so_args, so_field = so_args_of(req.response_format, req.structured_outputs)
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, so_args=so_args)
    rid, created, model = new_id("cmpl"), int(time.time()), req.model or state.model_name
    detok = Detokenizer(state.tokenizer.hf)
    choices = [_Choice(i * params.n + j, detok, params.stop) for i in range(len(prompts)) for j in range(params.n)]
    source = merged([state.run(ids, params, so_field) for ids in prompts])
    want_lps = req.logprobs is not None

    def usage():
        n_out = sum(len(c.ids) for c in choices)
        n_in = sum(len(p) for p in prompts)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    if not req.stream:
        prompt_lps: list[list | None] = [None] * len(prompts)  # per prompt: the engine's, from its leader
        prompt_ranks: list[list | None] = [None] * len(prompts)  # and the prompt tokens' ranks

        async def collect():
            async for i, d in source:
                if d is not None:
                    choices[i * params.n + d.index].add(d)
                    if d.prompt_logprobs is not None:
                        prompt_lps[i], prompt_ranks[i] = d.prompt_logprobs, d.prompt_logprob_ranks
        await unless_disconnected(raw, collect())
        k = params.prompt_logprobs
        per_prompt = [None if k is None else prompt_logprobs_json(lps or [], ranks or [], ids, k, state.tokenizer.hf)
                      for lps, ranks, ids in zip(prompt_lps, prompt_ranks, prompts)]
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "usage": usage(),
                "choices": [{"index": c.index, "text": c.st.text, "finish_reason": c.finish_reason,
                             "logprobs": _logprobs_json(c, state.tokenizer.hf, 0, len(c.ids), 0) if want_lps else None,
                             "prompt_logprobs": per_prompt[c.index // params.n]}
                            for c in choices]}
        return JSONResponse(body)

    _, stream = await unless_disconnected(raw, primed(source))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        try:
            async for i, d in stream:
                if d is None:
                    continue
                c = choices[i * params.n + d.index]
                before, start = len(c.ids), c.sent
                c.add(d)
                text = c.new_text()
                if not text and d.finish_reason is None:
                    continue
                lps = _logprobs_json(c, state.tokenizer.hf, before, len(c.ids), start) if want_lps else None
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": c.index, "text": text, "logprobs": lps,
                                        "finish_reason": c.finish_reason}]})
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage()})
            yield sse("[DONE]")
        except APIError as e:
            yield sse(e.body())
    return StreamingResponse(events(), media_type="text/event-stream")
