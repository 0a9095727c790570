"""SamplingParams: vLLM's field names plus DeepInfer's `seq_seed` and `so_args`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-5


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

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {msg}")
