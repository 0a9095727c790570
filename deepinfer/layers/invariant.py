"""Batch-invariant arithmetic (EngineConfig.batch_invariant / DEEPINFER_BATCH_INVARIANT).

Invariant: a row's (token's) result depends only on its own inputs — never on how many rows share
a call, where the row sits among them, or how wide the padded key lists of the step are.
- GEMMs: the CPU library picks its blocking (and reduction order) from M, so `linear` runs every
  call as a batch of fixed ROWS-row tiles (one bmm, rows padded with zeros): each tile is the same
  GEMM whatever the batch.
- Attention / indexer: keys are reduced in fixed blocks of KEYS in key order; the blocks a
  longer, padded key list adds hold masked keys whose terms are exact zeros.
- Transcendental elementwise ops (exp, sigmoid, silu, softplus, cos, sin): the CPU kernels run a
  vectorised loop and finish the last numel % vector-width elements with scalar code whose last
  bit differs, so which path a token's values take depends on the batch. `pointwise` flattens the
  input and pads it to a multiple of PAD elements: every element takes the vectorised path.
  Row-wise softmax / log_softmax over the last dim are row-local already.
- Threads: with one GEMM to run, the CPU library may split its reduction across threads, and
  elementwise loops split their range per thread (each part with its own scalar tail), so the
  results depend on how much work the step has. An invariant step runs on one CPU thread.
The mode is set around a model step (`mode`); the flag is thread-local, the thread count is
process-wide while the step runs. CUDA needs invariant kernels that do not exist yet: the engine
refuses it there.
"""
from __future__ import annotations

import contextlib
import threading

import torch

ROWS = 16
KEYS = 16
PAD = 64  # a multiple of every CPU vector width in elements (AVX-512 float: 16, bf16: 32)
_state = threading.local()


def enabled() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def mode(on: bool):
    prev, threads = enabled(), torch.get_num_threads()
    _state.on = on
    if on:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _state.on = prev
        if on:
            torch.set_num_threads(threads)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in tiles of exactly ROWS rows (same dtype for x and w)."""
    K, N = x.shape[-1], w.shape[0]
    rows = x.reshape(-1, K)
    T = rows.shape[0]
    if T == 0:
        return x.new_empty(*x.shape[:-1], N)
    n = -(-T // ROWS)
    if n * ROWS != T:
        rows = torch.cat((rows, rows.new_zeros(n * ROWS - T, K)))
    out = torch.bmm(rows.view(n, ROWS, K), w.t().expand(n, K, N))
    return out.reshape(n * ROWS, N)[:T].view(*x.shape[:-1], N)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn; in invariant mode on the CPU every element is computed by the
    same (vectorised) code whatever x's size (see the module docstring)."""
    if not enabled() or x.is_cuda:
        return fn(x)
    n = x.numel()
    flat = x.reshape(-1)
    if n % PAD:
        flat = torch.cat((flat, flat.new_zeros(PAD - n % PAD)))
    return fn(flat)[:n].view(x.shape)


def _key_blocks(n: int):
    return [slice(i, i + KEYS) for i in range(0, n, KEYS)]


def _pad_keys(keys: torch.Tensor, valid: torch.Tensor):
    pad = -keys.shape[1] % KEYS
    if pad:
        keys = torch.cat((keys, keys.new_zeros(keys.shape[0], pad, keys.shape[2])), dim=1)
        valid = torch.cat((valid, valid.new_zeros(valid.shape[0], pad)), dim=1)
    return keys, valid


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """kernels.sparse_attention.attend with fixed key blocks: logits per block, one max over all
    keys and the sink, then sum(p) and p @ V accumulated block by block in key order."""
    keys, valid = _pad_keys(keys, valid)
    qf = q.float()
    blocks = _key_blocks(keys.shape[1])
    logits = torch.cat([torch.einsum("thd,tkd->thk", qf, keys[:, b]) for b in blocks], dim=-1) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1)
    m = torch.maximum(logits.amax(-1), sink)
    p = pointwise(torch.exp, logits - m[..., None])
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qf)
    for b in blocks:
        denom = denom + p[..., b].sum(-1)
        acc = acc + torch.einsum("thk,tkd->thd", p[..., b], keys[:, b])
    denom = denom + pointwise(torch.exp, sink - m)
    return (acc / denom[..., None]).to(q.dtype)


def by_key_blocks(fn, keys: torch.Tensor) -> torch.Tensor:
    """fn(keys [T, C, D]) -> [T, C] scores; in invariant mode applied to fixed blocks of KEYS keys
    (padded with zero keys, cut off after), so a key's score does not depend on C."""
    if not enabled():
        return fn(keys)
    C = keys.shape[1]
    keys = torch.cat((keys, keys.new_zeros(keys.shape[0], -C % KEYS, keys.shape[2])), dim=1)
    return torch.cat([fn(keys[:, b]) for b in _key_blocks(keys.shape[1])], dim=-1)[:, :C]
