"""Request models of the OpenAI endpoints, OpenAI error bodies, and request -> SamplingParams.

Unknown fields are accepted and ignored. Wrong types and out-of-range values are rejected with 400
and an error body naming the field (`param`), as OpenAI's API does.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepinfer.sampling_params import SamplingParams

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


# the error body's `type` of each status, in OpenAI's snake_case style
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIError(Exception):
    """An error answered with an OpenAI error body; its type follows the status (ERROR_TYPES)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field: exactly one of json (a JSON schema), regex, choice, grammar
    (EBNF as xgrammar reads it) or json_object."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_schema: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def so_args(self) -> tuple[dict, str]:
        """(SamplingParams.so_args, the field it came from: "structured_outputs.json", ...)."""
        given = [k for k in ("json_schema", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(given) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
                                f"(got {len(given)})", "structured_outputs")
        kind = given[0]
        if kind == "json_schema":
            args = {"schema_type": "json", "schema": self.json_schema}
        elif kind == "choice":
            args = {"schema_type": "regex", "schema": "(" + "|".join(_regex_literal(c) for c in self.choice) + ")"}
        elif kind == "json_object":
            args = {"schema_type": "json_object"}
        else:
            args = {"schema_type": "ebnf" if kind == "grammar" else "regex", "schema": getattr(self, kind)}
        return args, "structured_outputs." + ("json" if kind == "json_schema" else kind)


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


_REGEX_META = set(".^$*+?()[]{}|\\/")


class SamplingFields(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions (vLLM's extras: top_k, min_p, ignore_eos,
    stop_token_ids, prompt_logprobs, repetition_penalty, min_tokens, bad_words, allowed_token_ids). A field
    not declared here or in the request's model is refused (400 naming it), never ignored."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # OpenAI's: token id (a string in JSON) -> bias in [-100, 100]
    logit_bias: dict[int, float] | None = None
    # vLLM's extras
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: the top-k logprobs (and the prompt token's) at every prompt position, not streamed
    prompt_logprobs: int | None = Field(None, ge=0)
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (off) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or not all(stops):
            raise ValueError("must be up to 16 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is not None and not all(-100 <= b <= 100 for b in v.values()):
            raise ValueError("values must be in [-100, 100]")
        return v

    def unsupported(self) -> None:
        """Fields this server accepts only at some values (none on this class)."""


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise APIError(400, "echo: not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix: not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of: only best_of == n is supported", "best_of")


class ChatRequest(SamplingFields):
    """Typed for validation and the OpenAPI schema; the body itself goes to deepseek-recipe, which
    renders messages, tools, tool_choice, thinking and reasoning_effort."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    thinking: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        # a required or named tool choice is held to one call by its grammar; "auto" is not constrained
        if self.parallel_tool_calls is False and self.tools and self.tool_choice in (None, "auto"):
            raise APIError(400, "parallel_tool_calls: false is supported with tool_choice \"required\" or a named "
                                "function (whose calls follow a grammar), not with \"auto\"", "parallel_tool_calls")


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None, so_args: dict | None = None,
                    temperature: float | None = None, top_p: float | None = None,
                    seed: int | None = None, so_prefix_tokens: int = 0) -> SamplingParams:
    """SamplingParams for `req`; explicit arguments take precedence over the request's own fields (the chat
    path passes what deepseek-recipe resolved)."""
    temp = temperature if temperature is not None else req.temperature
    try:
        return SamplingParams(
            temperature=1.0 if temp is None else temp,
            top_p=top_p if top_p is not None else (1.0 if req.top_p is None else req.top_p),
            top_k=-1 if req.top_k is None else req.top_k, min_p=req.min_p or 0.0, max_tokens=max_tokens,
            stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs, n=req.n, seq_seed=seed if seed is not None else req.seed,
            so_args=so_args, so_prefix_tokens=so_prefix_tokens, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias, min_tokens=req.min_tokens or 0, bad_words=req.bad_words,
            allowed_token_ids=req.allowed_token_ids)
    except ValueError as e:  # "SamplingParams.<field> ..."
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise APIError(400, str(e).removeprefix("SamplingParams."), field) from None


def check_prompt_logprobs(req: SamplingFields, stream: bool) -> None:
    """prompt_logprobs are returned whole, in the response body: refused with stream=true, as vLLM refuses them."""
    if req.prompt_logprobs is not None and stream:
        raise APIError(400, "prompt_logprobs: not available with stream=true", "prompt_logprobs")


def so_args_of(fmt: ResponseFormat | None, structured: StructuredOutputs | None = None) -> tuple[dict | None, str]:
    """response_format or structured_outputs -> (SamplingParams.so_args (None for text), the field it came from)."""
    if structured is not None:
        if fmt is not None and fmt.type != "text":
            raise APIError(400, "structured_outputs: give it or response_format, not both", "structured_outputs")
        return structured.so_args()
    if fmt is None or fmt.type == "text":
        return None, "response_format"
    if fmt.type == "json_object":
        return {"schema_type": "json_object"}, "response_format"
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format.json_schema.schema: required for type 'json_schema'",
                       "response_format.json_schema")
    return {"schema_type": "json", "schema": fmt.json_schema.json_schema}, "response_format.json_schema.schema"
