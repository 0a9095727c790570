"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, min-p, logprobs.

Per-row parameters travel as tensors, so one call serves a mixed batch with no per-request
host sync; the caller reads the result back once per step. Every row argmax is `row_argmax`: torch's
`argmax(-1)` indices exactly (a split Triton reduction on CUDA, torch itself on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels.row_argmax import row_argmax
from deepinfer.state.forward_batch import to_device
from deepinfer.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [R] 0 for greedy rows
    top_k: torch.Tensor        # [R] vocab size when off
    top_p: torch.Tensor        # [R]
    min_p: torch.Tensor        # [R]
    needs_sort: bool           # any row with top-k or top-p
    max_logprobs: int          # largest logprobs request (-1: none)
    seed_keys: list[int | None] = field(default_factory=list)  # per row: counter-based RNG key, or None
    all_greedy: bool = False   # every row greedy (known on the host: sampling is one argmax)

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device,
              seeds: list[tuple[int, ...] | None] | None = None) -> "SamplingBatch":
        # one host -> device copy for the four per-row rows (top-k as float: exact, vocab < 2^24)
        rows = to_device(torch.tensor([[0.0 if p.greedy else p.temperature for p in params],
                                       [p.top_k if p.top_k > 0 else vocab for p in params],
                                       [p.top_p for p in params], [p.min_p for p in params]],
                                      dtype=torch.float32).view(4, len(params)), device)
        return cls(
            rows[0], rows[1].long(), rows[2], rows[3],
            any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy),
            max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            [None if k is None else seed_key(*k) for k in (seeds or [None] * len(params))],
            all(p.greedy for p in params),
        )


_MASK64 = (1 << 64) - 1


def seed_key(*parts: int) -> int:
    """A 63-bit generator seed from integers (seq_seed, position, sample index): splitmix64 mixing,
    so nearby seeds / positions give unrelated streams (counter-based: no state between steps)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


def _filter(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / top-p nucleus / min-p floor."""
    if sb.needs_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        drop = rank >= sb.top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the first token)
        drop |= (probs.cumsum(-1) - probs) >= sb.top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    floor = sb.min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


def filtered_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [R, V] fp32 -> [R, V] the distribution each sampled row draws from: temperature, then
    top-k / top-p / min-p, renormalised (greedy rows: a temperature-1e-5 distribution, unused). Speculative
    verification's p, and a proposer's q, so that both sides filter alike."""
    return _filter(logits / sb.temperature.clamp(min=1e-5)[:, None], sb).softmax(-1)


def race_noise(like: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """E ~ Exp(1), shaped and placed like `like` [R, V]: seeded rows (sb.seed_keys[r] set) from a generator
    keyed by that row's key, so a row's numbers are the same alone or in any batch; the rest from `generator`
    (the global one when None), consumed for all R rows in one draw."""
    noise = torch.empty_like(like).exponential_(generator=generator)
    for r, key in enumerate(sb.seed_keys):
        if key is not None:
            noise[r].exponential_(generator=torch.Generator(device=like.device).manual_seed(key))
    return noise


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax(w / E) per row [R, V] -> [R]: a draw from normalize(w) when E ~ Exp(1),
    with no cumulative-sum search (w need not be normalised; zero-weight tokens are never drawn
    unless the whole row is zero)."""
    return row_argmax(weights / noise)


def sample(logits: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [R, V] fp32 -> token ids [R]: argmax on greedy rows, race(filtered_probs, race_noise) on the others.
    An all-greedy batch is one argmax (no noise drawn: `generator` is left as it was)."""
    if sb.all_greedy:
        return row_argmax(logits)
    probs = filtered_probs(logits, sb)
    drawn = race(probs, race_noise(probs, sb, generator))
    return torch.where(sb.temperature == 0, row_argmax(logits), drawn)


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [R, V], tokens [R] -> [R] each token's 1-based rank in its row, as vLLM counts it: the tokens whose
    logit is at least the token's own (ties rank together, behind)."""
    return (logits >= logits.gather(-1, tokens[:, None])).sum(-1)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Raw-model logprobs: (of the chosen tokens [R], top-k values [R, k], top-k ids [R, k])."""
    lp = logits.log_softmax(-1)
    top = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return lp.gather(-1, tokens[:, None]).squeeze(-1), top[0], top[1]
