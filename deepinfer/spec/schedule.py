"""How many draft tokens each request verifies in a step (DSpark's confidence-scheduled verification).

Every request in a decode step verifies its base token (the newest accepted token, whose target
forward yields the bonus token) plus l_r of its drafted tokens d_{r,1..l_r}. The drafter gives, per
request and draft position j = 1..gamma, a calibrated conditional confidence c_{r,j}: the chance that
d_{r,j} is accepted given d_{r,1..j-1} were. The cumulative survival a_{r,j} = prod_{i<=j} c_{r,i} is
the chance that d_{r,j} is accepted at all, so a step with lengths l emits in expectation

    tau = sum_r (1 + sum_{j<=l_r} a_{r,j})   tokens, and takes B = sum_r (1 + l_r) verify tokens.

With SPS(B) the target's steps per second at B tokens (`SPSTable`), the expected throughput is
Theta = tau * SPS(B). The four ways to choose l, all under the same per-request limits `max_len`:
the most drafts request r may verify, min(its draft length, tokens left before max_tokens - 1, as
a step emits up to l_r + 1 tokens); a limit must not depend on the drafted tokens themselves.

* `allocate` (paper Alg. 1, DEEPINFER_ENABLE_MTP_VARLEN=1 with synchronous scheduling): every
  candidate (r, j) sorted by a_{r,j}, highest first, ties by request then position; admitted in
  that order while Theta strictly improves; the first non-improvement stops the search.
* `budget_from_stale` + `allocate_top_k` (the paper's §5.2 production form, for asynchronous
  scheduling, where the next step's size must be fixed before the current step's drafts exist):
  the budget K (draft tokens in the step, so B = number of requests + K) is the best point of the
  whole Theta curve (no early stop) computed from confidences two steps old; the K draft tokens
  then go to the K best candidates by fresh confidences (dynamic top-K).
* `uniform_length` (DEEPINFER_ENABLE_MTP_VARLEN=1 where steps replay CUDA graphs, which pad each request to
  the step's longest): one length l for every request, the best point of Theta over l with the step times
  measured by (requests, drafts each) (`StepTimes`), from confidences two steps old as `budget_from_stale`;
  l = 0 also stops drafting (the step costs a plain decode step) until a later step's l is > 0 again.
* `allocate_fixed` (DEEPINFER_ENABLE_MTP_VARLEN=0): every request min(k, max_len_r).

Prefix order. c in [0, 1] makes a_{r,j} non-increasing in j (also in floating point: x * c <= x
for c <= 1), and ties go to the lower position, so in the sorted order (r, j) always comes before
(r, j + 1): any top-k of the order gives each request a prefix 1..l_r of its drafts, and for a
given number of draft tokens the top-k has the largest tau of all prefix allocations. The best
prefix allocation overall is therefore the best point of the Theta curve along the sorted order
(`budget_from_stale` finds it; the tests check it against brute force).

What is causal, and why it matters for sampling. c_{r,j} is computed from the draft hidden state
and the previous draft token d_{r,j-1}, so a_{r,j} depends on d_{r,1..j-1} but not on d_{r,j};
a_{r,j+1} and later do depend on d_{r,j}. Rejection sampling leaves the target distribution
unchanged only if whether d_{r,j} is verified does not depend on d_{r,j} itself (otherwise the
verified d_{r,j} is no longer a sample of the draft distribution the acceptance test assumes).
* `allocate` is causal: (r, j) is admitted iff Theta improved at every rank up to its own, and
  those Theta values use only candidates ranked at or above (r, j), none of which is (r, j+1..).
* `allocate_top_k` with a K fixed beforehand is causal: (r, j) is admitted iff fewer than K
  candidates rank above it, again none of them (r, j+1..).
* `uniform_length` reads the whole curve like `budget_from_stale`, and is fed stale confidences likewise.
* `budget_from_stale` looks at the whole curve, later positions included, so it is NOT causal on
  the confidences it is given (the paper's Appendix A point; `test_full_search_leaks_...` shows a
  case): it must only see confidences that no draft of the step being verified went into, which
  is why §5.2 feeds it confidences two steps old. Its K is then a constant for the fresh drafts.
* `allocate_fixed` uses no confidence.
Greedy decoding (temperature 0) is lossless with any lengths; the above is what sampling needs.

Inputs are array-likes (lists, numpy arrays, CPU torch tensors); results are numpy int64 arrays of
length R. Everything is vectorised: one sort, one cumulative sum and one table lookup per prefix.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


class SPSTable:
    """Steps per second of a verify step as a function of its token count B = 1..max_batch.

    Built from measured (B, seconds per step) points. Between two measured points the *time* is
    interpolated linearly (time is what adds up over a step's work; SPS is its reciprocal). Below
    the first point the time is the first point's (a step never costs less than the smallest one
    measured). Past the last point, up to max_batch, the time grows in proportion to B (tokens per
    second held at the last measured value: the unmeasured range is treated as compute-bound,
    which never makes a bigger step look cheaper than measured). B = 0 (no requests) reads as
    B = 1. A query past max_batch is refused: max_batch is the step's token cap."""

    def __init__(self, seconds: np.ndarray):
        s = np.asarray(seconds, dtype=np.float64)
        if s.ndim != 1 or s.size < 2:
            raise ValueError(f"seconds: need a 1-D array over B = 0..max_batch (max_batch >= 1), got shape {s.shape}")
        if not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise ValueError("seconds: every step time must be finite and > 0")
        self.seconds = s
        self.sps = 1.0 / s

    @classmethod
    def from_points(cls, points: Iterable[tuple[int, float]], max_batch: int) -> "SPSTable":
        pts = sorted((int(b), float(t)) for b, t in points)
        if not pts:
            raise ValueError("points: at least one measured (B, seconds) point is needed")
        if int(max_batch) < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        bs = np.array([b for b, _ in pts], dtype=np.int64)
        ts = np.array([t for _, t in pts], dtype=np.float64)
        if bs[0] < 1 or bs[-1] > max_batch:
            raise ValueError(f"points: B must lie in 1..max_batch={max_batch}, got {bs[0]}..{bs[-1]}")
        if np.any(np.diff(bs) == 0):
            raise ValueError(f"points: B measured twice: {sorted(set(bs[:-1][np.diff(bs) == 0].tolist()))}")
        if not np.all(np.isfinite(ts)) or np.any(ts <= 0):
            raise ValueError("points: every seconds-per-step value must be finite and > 0")
        grid = np.arange(max_batch + 1)
        seconds = np.interp(grid, bs, ts)          # constant below the first point
        past = grid > bs[-1]
        seconds[past] = ts[-1] * grid[past] / bs[-1]
        seconds[0] = seconds[1]
        return cls(seconds)

    @property
    def max_batch(self) -> int:
        return self.seconds.size - 1

    def __call__(self, batch):
        """SPS at B (an int or an integer array), O(1) per query."""
        b = np.asarray(batch)
        if np.any(b < 0) or np.any(b > self.max_batch):
            raise ValueError(f"batch: B must lie in 0..max_batch={self.max_batch}, got {batch}")
        out = self.sps[b]
        return float(out) if out.ndim == 0 else out


def survival(conf) -> np.ndarray:
    """Conditional confidences c [R, gamma] -> cumulative survival a [R, gamma] (validated)."""
    c = np.asarray(conf, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"conf: need shape [requests, gamma], got {c.shape}")
    if not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(c > 1):
        raise ValueError("conf: confidences must be finite and in [0, 1]")
    return np.cumprod(c, axis=1)


def _max_len(max_len, num_requests: int, gamma: int) -> np.ndarray:
    if max_len is None:
        return np.full(num_requests, gamma, dtype=np.int64)
    m = np.asarray(max_len)
    if m.shape != (num_requests,) or (m.size and not np.issubdtype(m.dtype, np.integer)):
        raise ValueError(f"max_len: need {num_requests} integers (one per request), got {m.dtype} {m.shape}")
    if np.any(m < 0):
        raise ValueError("max_len: must be >= 0")
    return np.minimum(m.astype(np.int64), gamma)


def _ranked(conf, max_len) -> tuple[np.ndarray, np.ndarray, int]:
    """The admissible candidates, best first: their survival a and request index; and R."""
    a = survival(conf)
    num_requests, gamma = a.shape
    limit = _max_len(max_len, num_requests, gamma)
    allowed = np.arange(1, gamma + 1)[None, :] <= limit[:, None]
    flat_a, flat_r = a[allowed], np.nonzero(allowed)[0]      # row-major: (r, j) ascending
    order = np.argsort(-flat_a, kind="stable")                # ties keep request, then position, order
    return flat_a[order], flat_r[order], num_requests


def _theta(a_ranked: np.ndarray, num_requests: int, sps: SPSTable, budget) -> np.ndarray:
    """Theta after admitting the first k ranked candidates, k = 0..M (M capped by the table and budget)."""
    if num_requests > sps.max_batch:
        raise ValueError(f"conf: {num_requests} requests do not fit the SPS table's max_batch={sps.max_batch}")
    m = min(a_ranked.size, sps.max_batch - num_requests)
    if budget is not None:
        if int(budget) < 0:
            raise ValueError(f"budget: must be >= 0, got {budget}")
        m = min(m, int(budget))
    tau = num_requests + np.concatenate(([0.0], np.cumsum(a_ranked[:m])))
    return tau * sps.sps[num_requests + np.arange(m + 1)]


def _lengths(r_ranked: np.ndarray, k: int, num_requests: int) -> np.ndarray:
    return np.bincount(r_ranked[:k], minlength=num_requests).astype(np.int64)


def allocate(conf, sps: SPSTable, budget: int | None = None, max_len=None) -> np.ndarray:
    """Paper Alg. 1: lengths l [R] from conditional confidences conf [R, gamma]; greedy with early stop.
    `budget` caps the draft tokens admitted (sum of l)."""
    a, r, num_requests = _ranked(conf, max_len)
    theta = _theta(a, num_requests, sps, budget)
    worse = np.flatnonzero(np.diff(theta) <= 0)
    k = int(worse[0]) if worse.size else theta.size - 1
    return _lengths(r, k, num_requests)


def budget_from_stale(conf_stale, sps: SPSTable, max_len=None) -> int:
    """§5.2: the draft-token budget K maximising Theta over the whole curve (no early stop; the
    smallest such K on ties), from confidences no draft of the step to verify went into."""
    a, _, num_requests = _ranked(conf_stale, max_len)
    return int(np.argmax(_theta(a, num_requests, sps, None)))


def allocate_top_k(conf_fresh, budget: int, max_len=None) -> np.ndarray:
    """§5.2 dynamic top-K: the `budget` best candidates by fresh survival (all, if fewer)."""
    if int(budget) < 0:
        raise ValueError(f"budget: must be >= 0, got {budget}")
    _, r, num_requests = _ranked(conf_fresh, max_len)
    return _lengths(r, int(budget), num_requests)


def allocate_fixed(k: int, max_len) -> np.ndarray:
    """DEEPINFER_ENABLE_MTP_VARLEN=0: every request min(k, max_len_r)."""
    if int(k) < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    m = np.asarray(max_len)
    return _max_len(m, m.size, int(k))


def expected_throughput(conf, lengths, sps: SPSTable) -> float:
    """Theta = tau * SPS(B) of the allocation `lengths` (each l_r <= gamma)."""
    a = survival(conf)
    num_requests, gamma = a.shape
    ls = np.asarray(lengths, dtype=np.int64)
    if ls.shape != (num_requests,) or np.any(ls < 0) or np.any(ls > gamma):
        raise ValueError(f"lengths: need {num_requests} integers in 0..{gamma}, got {lengths}")
    kept = np.arange(1, gamma + 1)[None, :] <= ls[:, None]
    return float((num_requests + a[kept].sum()) * sps(num_requests + int(ls.sum())))


class StepTimes:
    """Seconds of a step of n decoding requests that each verify l drafts, l = 0..k, measured at start-up
    (worker/sps_profile.py profile_step_times): seconds[i, l] at n = buckets[i]; a step at l > 0 also
    drafts the next block, a step at l = 0 neither verifies nor drafts. Between buckets a step costs the
    next bucket's time (CUDA graphs pad the batch up to it). np.inf marks a size the step cannot take."""

    def __init__(self, buckets, seconds):
        b = np.asarray(buckets, dtype=np.int64)
        s = np.asarray(seconds, dtype=np.float64)
        if b.ndim != 1 or b.size < 1 or np.any(b < 1) or np.any(np.diff(b) <= 0):
            raise ValueError(f"buckets: need increasing request counts >= 1, got {buckets}")
        if s.shape[0] != b.size or s.ndim != 2 or s.shape[1] < 1:
            raise ValueError(f"seconds: need shape [{b.size}, k + 1], got {s.shape}")
        if np.any(np.isnan(s)) or np.any(s <= 0) or not np.all(np.isfinite(s[:, 0])):
            raise ValueError("seconds: every step time must be > 0 (np.inf: not possible), and finite at l = 0")
        self.buckets, self.seconds = b, s

    @property
    def k(self) -> int:
        return self.seconds.shape[1] - 1

    def __call__(self, n: int, l: int) -> float:
        if not 1 <= n <= self.buckets[-1] or not 0 <= l <= self.k:
            raise ValueError(f"StepTimes: (n={n}, l={l}) outside 1..{self.buckets[-1]} x 0..{self.k}")
        return float(self.seconds[int(np.searchsorted(self.buckets, n)), l])


def uniform_length(conf, times: StepTimes, max_len=None) -> int:
    """The draft count l (0..min(gamma, times.k)) every request of a step verifies, each at most its max_len_r:
    the l maximising Theta(l) = (R + sum_r sum_{j <= min(l, max_len_r)} a_{r,j}) / times(R, l), the smallest on
    ties. R = the rows of conf [R, gamma] (a request with no confidences: a row of zeros, one token a step).

    For CUDA-graph steps, which pad every request to the step's longest: a shorter length for some requests
    would cost as much. Reads the whole curve, so, as budget_from_stale, it is causal only on confidences no
    draft of the step to verify went into."""
    a = survival(conf)
    num_requests, gamma = a.shape
    if not num_requests:
        return 0
    limit = _max_len(max_len, num_requests, gamma)
    top = min(gamma, times.k)
    gain = np.where(np.arange(1, gamma + 1)[None, :] <= limit[:, None], a, 0.0).sum(0)[:top]
    tau = num_requests + np.concatenate(([0.0], np.cumsum(gain)))
    theta = tau / np.array([times(num_requests, l) for l in range(top + 1)])
    return int(np.argmax(theta))
