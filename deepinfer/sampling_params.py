"""SamplingParams: vLLM's field names and semantics plus DeepInfer's `seq_seed` and `so_args`."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

_GREEDY_EPS = 1e-5
# a bad word's tokens: its last is masked where the output ends with the others (the runner keeps the last
# MAX_BAD_WORD_TOKENS - 1 outputs of each request on the device)
MAX_BAD_WORD_TOKENS = 8


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: per prompt position after the first, the prompt token's logprob and the top-k (raw model)
    prompt_logprobs: int | None = None
    n: int = 1
    seq_seed: int | None = None          # DeepInfer: per-request seed for deterministic sampling
    so_args: dict[str, Any] | None = None  # DeepInfer: structured-output arguments
    # DeepInfer: the prompt's last so_prefix_tokens tokens begin the output (an assistant prefix the model
    # continues): so_args' grammar (and its reasoning phase) starts as after them, and must accept them
    so_prefix_tokens: int = 0
    # vLLM's logits processing (worker/logits_processors.py), applied in this order before temperature and the
    # filters: allowed_token_ids, bad_words, min_tokens, logit_bias, then the penalties. Output logprobs stay the
    # raw model's.
    presence_penalty: float = 0.0    # minus this for every token the output holds
    frequency_penalty: float = 0.0   # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # tokens of the prompt or output: a positive logit / this, a negative * this
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0              # until this many outputs: EOS and stop_token_ids masked, stop strings unchecked
    bad_words: list[str] | None = None  # never emitted: a word's last token is masked after its other tokens
    allowed_token_ids: list[int] | None = None  # only these may be emitted
    # bad_words as token ids (the engine fills it from bad_words with the model's tokenizer; may be given instead)
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens}")
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
               f"must be None or an integer >= 0, got {self.logprobs}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               "prompt_logprobs", f"must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        _check(self.seq_seed is None or _is_int(self.seq_seed), "seq_seed",
               f"must be None or an integer, got {self.seq_seed!r}")
        _check(self.so_args is None or isinstance(self.so_args, dict), "so_args",
               f"must be None or a dict, got {type(self.so_args).__name__}")
        _check(_is_int(self.so_prefix_tokens) and self.so_prefix_tokens >= 0, "so_prefix_tokens",
               f"must be an integer >= 0, got {self.so_prefix_tokens!r}")
        _check(not self.so_prefix_tokens or self.so_args is not None, "so_prefix_tokens",
               "applies to structured outputs only (so_args is None)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        _check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must be a dict {token id: bias}")
            self.logit_bias = {int(t) if isinstance(t, str) and t.isdigit() else t: b
                               for t, b in self.logit_bias.items()}
            _check(all(_is_int(t) and t >= 0 for t in self.logit_bias), "logit_bias",
                   "keys must be token ids (non-negative integers)")
            _check(all(_is_num(b) and -100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
                   "values must be numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
                   "must be non-empty strings")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
            _check(all(w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_token_ids),
                   "bad_words_token_ids", "must be non-empty lists of token ids")
            _check(all(len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words_token_ids), "bad_words_token_ids",
                   f"each word may be at most {MAX_BAD_WORD_TOKENS} tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the presence, frequency or repetition penalty applies."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    # cached: the runner asks every step (the fields are not changed once a request is queued)
    @cached_property
    def needs_history(self) -> bool:
        """Whether the logits depend on the tokens before the sampled one: the penalties, min_tokens or a bad word
        of several tokens (the runner then keeps the request's history on the device)."""
        return self.penalized or self.min_tokens > 0 or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    @cached_property
    def processes_logits(self) -> bool:
        return self.needs_history or bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {msg}")
