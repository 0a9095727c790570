"""The indexer's top-k: ids of the k best candidate scores of each row, ties to the lowest id.

s [T, N] fp32 scores (not NaN), visible [T], optional allowed [T, N] bool, k <= N. Entry i of row
t is a candidate when i < visible[t], s[t, i] > -inf and allowed[t, i]:
  rank_i = #{j candidate : s_j > s_i} + #{j candidate, j < i : s_j == s_i}
  out[t, rank_i] = i when rank_i < k; out[t, r] = -1 for r >= the number of candidates.
This is the stable descending sort's first k ids (the reference). Integer results, identical to
the reference on every path:
  * short rows (N <= MAX_N, T * N^2 <= MAX_WORK: decode): one launch counting ranks, O(N^2)
    compares per row. Grid: one program per row; positions written by the scatter (< #candidates)
    and by the -1 fill (>= #candidates) never overlap, so no ordering between the two stores.
  * long rows: each score becomes a unique int64 key, (order-preserving bits of s) << 32 |
    (2^32 - 1 - i), non-candidates (INT32_MIN << 32 | ...): key order is the reference's order
    (score descending, then id ascending; -0.0 is keyed as +0.0, since the two compare equal), and
    with no ties left torch.topk (a radix select, no host sync) returns exactly the reference's
    first k. Launches: pack keys, topk, unpack ids.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used
    triton = None

MAX_N = 1024
MAX_WORK = 1 << 26
BLOCK = 64
PACK_BLOCK = 1024


def reference(s: torch.Tensor, visible: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    s = s.masked_fill(torch.arange(s.shape[1], device=s.device) >= visible[:, None], float("-inf"))
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    val, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    return torch.where(val[:, :k] > float("-inf"), idx[:, :k], -1)


if triton is not None:
    @triton.jit
    def _topk_kernel(s_ptr, vis_ptr, allow_ptr, out_ptr, N, K, BLOCK: tl.constexpr, HAS_ALLOW: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        vis = tl.load(vis_ptr + t)
        a = tl.arange(0, BLOCK)
        n_cand = tl.zeros([BLOCK], tl.int32)
        for i0 in range(0, N, BLOCK):
            i = i0 + a
            si = tl.load(s_ptr + t * N + i, mask=i < N, other=float("-inf"))
            ci = (i < vis) & (si > float("-inf"))
            if HAS_ALLOW:
                ci = ci & (tl.load(allow_ptr + t * N + i, mask=i < N, other=0) != 0)
            n_cand += ci.to(tl.int32)
            rank = tl.zeros([BLOCK], tl.int32)
            for j0 in range(0, N, BLOCK):
                j = j0 + a
                sj = tl.load(s_ptr + t * N + j, mask=j < N, other=float("-inf"))
                cj = (j < vis) & (sj > float("-inf"))
                if HAS_ALLOW:
                    cj = cj & (tl.load(allow_ptr + t * N + j, mask=j < N, other=0) != 0)
                ahead = (sj[None, :] > si[:, None]) | ((sj[None, :] == si[:, None]) & (j[None, :] < i[:, None]))
                rank += tl.sum((ahead & cj[None, :]).to(tl.int32), axis=1)
            tl.store(out_ptr + t * K + rank, i.to(tl.int64), mask=ci & (rank < K))
        total = tl.sum(n_cand, axis=0)
        for r0 in range(0, K, BLOCK):
            r = r0 + a
            tl.store(out_ptr + t * K + r, tl.full([BLOCK], -1, tl.int64), mask=(r < K) & (r >= total))

    @triton.jit
    def packed_key(s, i, ok):
        """The unique int64 sort key of score s at id i (see the module docstring); INT32_MIN high
        half where not ok."""
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0
        b = s.to(tl.int32, bitcast=True)
        hi = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # signed order of hi = float order of s
        hi = tl.where(ok, hi, -2147483648)
        return (hi.to(tl.int64) << 32) | (4294967295 - i.to(tl.int64))

    @triton.jit
    def _pack_kernel(s_ptr, vis_ptr, allow_ptr, key_ptr, N, BLOCK: tl.constexpr, HAS_ALLOW: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(s_ptr + t * N + i, mask=i < N, other=float("-inf"))
        ok = (i < tl.load(vis_ptr + t)) & (s > float("-inf"))
        if HAS_ALLOW:
            ok = ok & (tl.load(allow_ptr + t * N + i, mask=i < N, other=0) != 0)
        tl.store(key_ptr + t * N + i, packed_key(s, i, ok), mask=i < N)

    @triton.jit
    def _unpack_kernel(key_ptr, out_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(key_ptr + o, mask=o < n, other=0)
        ids = 4294967295 - (key & 4294967295)
        tl.store(out_ptr + o, tl.where((key >> 32) != -2147483648, ids, -1), mask=o < n)


def supported(s: torch.Tensor) -> bool:
    """The counting kernel fits (short rows)."""
    T, N = s.shape
    return triton is not None and s.is_cuda and s.dtype == torch.float32 and 0 < N <= MAX_N and T * N * N <= MAX_WORK


def index_topk(s: torch.Tensor, visible: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N] scores -> [T, k] int64 ids (-1 = none). CUDA: one counting launch for short rows, the
    packed-key select for long ones; the torch reference elsewhere."""
    if triton is None or not s.is_cuda or s.dtype != torch.float32 or s.shape[0] == 0 or k == 0:
        return reference(s, visible, k, allowed)
    if supported(s):
        return _launch(s, visible, k, allowed)
    return _launch_long(s, visible, k, allowed)


def _launch(s: torch.Tensor, visible: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The counting launch without the device / size checks (also runs under TRITON_INTERPRET=1)."""
    T, N = s.shape
    out = torch.empty(T, k, dtype=torch.int64, device=s.device)
    s = s.contiguous()
    _topk_kernel[(T,)](s, visible.contiguous(), s if allowed is None else allowed.contiguous(), out, N, k,
                       BLOCK=BLOCK, HAS_ALLOW=allowed is not None, num_warps=4)
    return out


def _launch_long(s: torch.Tensor, visible: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Pack, torch.topk, unpack (N < 2^32; also runs under TRITON_INTERPRET=1)."""
    T, N = s.shape
    keys = torch.empty(T, N, dtype=torch.int64, device=s.device)
    s = s.contiguous()
    _pack_kernel[(T, triton.cdiv(N, PACK_BLOCK))](s, visible.contiguous(), s if allowed is None else allowed.contiguous(),
                                                 keys, N, BLOCK=PACK_BLOCK, HAS_ALLOW=allowed is not None, num_warps=4)
    top = torch.topk(keys, k, dim=1).values.contiguous()
    out = torch.empty(T, k, dtype=torch.int64, device=s.device)
    _unpack_kernel[(triton.cdiv(T * k, PACK_BLOCK),)](top, out, T * k, BLOCK=PACK_BLOCK, num_warps=4)
    return out
