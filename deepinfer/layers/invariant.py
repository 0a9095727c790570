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
On CUDA the same property comes from kernels whose tiling is fixed whatever the shapes:
- GEMMs (`linear`, `linear_fp32`): kernels/invariant_matmul.py (cuBLAS picks kernels and split-K
  by shape); grouped / quantised GEMMs run kernels/grouped_gemm.py with GEMM_TILES for every M.
- Reductions over a dim (`reduce_sum`): torch's reduction kernels choose how to split a row's sum
  from the tensor's shape, so sums run as a GEMM with a ones vector on the invariant tiling.
- Sparse attention: one tiling (ATTENTION_TILES) for prefill and decode, with fixed key splits:
  split 0 is the window, split s the entry tiles (s-1)*4 .. s*4-1, folded in split order (as
  parallel programs plus an in-order merge at decode, in registers in one program otherwise: the
  same bits); the key blocks and splits a wider (padded) entry list adds are fully masked and
  change nothing.
- Row-local Triton kernels (RMSNorm, RoPE, SwiGLU, MoE combine, mHC) are invariant as they are;
  the mHC mix runs a fixed row block and a split count from K alone (kernels/mhc_mix.py fixed_splits).
The mode is set around a model step (`mode`); the flag is thread-local, the thread count is
process-wide while the step runs.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from deepinfer.kernels import invariant_matmul as _imm

ROWS = 16
KEYS = 16
PAD = 64  # a multiple of every CPU vector width in elements (AVX-512 float: 16, bf16: 32)
GEMM_TILES = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)  # grouped_gemm, any M
# fixed key splits (kernels/sparse_attention.py `_launch`): 4 entry tiles of 32 per split, so decode
# at long context keeps its parallelism; software pipelining (num_stages) changes no arithmetic
ATTENTION_TILES = dict(block_h=16, block_n=32, num_warps=8, num_stages=2, tiles_per_split=4)
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


def gemm_tiles() -> dict:
    """Tile kwargs for kernels.grouped_gemm: fixed in invariant mode, its shape-tuned defaults otherwise."""
    return GEMM_TILES if enabled() else {}


def attention_tiles() -> dict:
    return ATTENTION_TILES if enabled() else {}


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (same dtype for x and w): on CUDA the fixed-tiling Triton GEMM; on the
    CPU in tiles of exactly ROWS rows."""
    if x.is_cuda:
        return _imm.matmul(x, w)
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


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T with an fp32 result; on CUDA bf16 operands stay bf16 (their products are exact in fp32)."""
    if x.is_cuda and x.dtype == w.dtype:
        return _imm.matmul(x, w, torch.float32)
    return linear(x.float(), w.float())


def reduce_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.sum(dim); in invariant mode on CUDA as a GEMM with a ones vector (fixed summation order)."""
    if not (enabled() and x.is_cuda):
        return x.sum(dim)
    xt = x.movedim(dim, -1)
    ones = torch.ones(1, xt.shape[-1], dtype=x.dtype, device=x.device)
    return _imm.matmul(xt.reshape(-1, xt.shape[-1]), ones).view(xt.shape[:-1])


def reduce_mean(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.mean(dim); in invariant mode on CUDA `reduce_sum` times 1 / n (torch's CUDA reductions split
    a row by the tensor's shape, so a row's mean depends on how many rows there are)."""
    if not (enabled() and x.is_cuda):
        return x.mean(dim)
    return reduce_sum(x, dim) * (1.0 / x.shape[dim])


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
    logits = torch.cat([qk(qf, keys[:, b]) for b in blocks], dim=-1) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1)
    m = torch.maximum(logits.amax(-1), sink)
    p = pointwise(torch.exp, logits - m[..., None])
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qf)
    for b in blocks:
        denom = denom + p[..., b].sum(-1)
        acc = acc + _pv(p[..., b], keys[:, b])
    denom = denom + pointwise(torch.exp, sink - m)
    return (acc / denom[..., None]).to(q.dtype)


def qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[T, H, D] x [T, K, D] -> [T, H, K]; on CUDA as products + fixed-order sums (a batched GEMM's
    kernel, and so its reduction order, depends on the batch count)."""
    if enabled() and q.is_cuda:
        return reduce_sum(q[:, :, None, :] * k[:, None, :, :], -1)
    return torch.einsum("thd,tkd->thk", q, k)


def _pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, H, K] x [T, K, D] -> [T, H, D] (see qk)."""
    if enabled() and p.is_cuda:
        return reduce_sum(p[:, :, :, None] * v[:, None, :, :], 2)
    return torch.einsum("thk,tkd->thd", p, v)


def by_key_blocks(fn, keys: torch.Tensor) -> torch.Tensor:
    """fn(keys [T, C, D]) -> [T, C] scores; in invariant mode applied to fixed blocks of KEYS keys
    (padded with zero keys, cut off after), so a key's score does not depend on C."""
    if not enabled():
        return fn(keys)
    C = keys.shape[1]
    keys = torch.cat((keys, keys.new_zeros(keys.shape[0], -C % KEYS, keys.shape[2])), dim=1)
    return torch.cat([fn(keys[:, b]) for b in _key_blocks(keys.shape[1])], dim=-1)[:, :C]
